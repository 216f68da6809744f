"""Deferrable wait on a Ray job: polls with async HTTP, forwards new log lines, yields one event."""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from verl_pipeline.jobs.gpu_usage import NodeGpuSample, append_samples
from verl_pipeline.jobs.logstream import LineReader, WaitCursor
from verl_pipeline.jobs.outcome import WaitEvent
from verl_pipeline.jobs.progress import (
    GpuSummary,
    Progress,
    ProgressTracker,
    metrics_file_due,
    parse_console_line,
    parse_jsonl_row,
    record_first_step,
)
from verl_pipeline.jobs.wait_request import WaitRequest
from verl_pipeline.jobs.watchdog import NodeWatch, StallWatch, WatchSettings, speaks_of_a_death
from verl_pipeline.rundir import RunDir

if TYPE_CHECKING:
    from verl_pipeline.jobs.client import JobInfo

#: Where Airflow finds the trigger again (kept as it is: deferred tasks of a running deployment resume by it).
CLASSPATH = "verl_pipeline.airflow.triggers.RayJobTrigger"

#: Lines per forwarded log record (one record per batch keeps a chatty job cheap for the triggerer).
LINES_PER_RECORD = 200
_METRICS_READ_BYTES = 1024 * 1024
#: A chatty job's cursor is saved to the run directory at most this often (a quiet one's at once).
CURSOR_SAVE_INTERVAL_S = 30.0
#: Polls between two reads of a running job's log (the nodes are counted on the polls between). A
#: read costs a request whatever it brings, so a read every other poll, of twice the output, halves
#: what forwarding costs the triggerer; a new step is seen at most one poll later.
LOG_READ_EVERY_POLLS = 2
#: The waiters of one cluster (in one triggerer) share its node summary: a read serves every waiter of
#: that cluster that needs one within this share of its poll interval, so a node loss is seen at most
#: half a poll later than by reading for each waiter, and a cluster of N waiters is read about twice
#: per poll interval instead of N / 2 times.
NODE_SUMMARY_SHARED_FOR_POLLS = 0.5
#: Likewise the job statuses: with at least ``JOB_LIST_MIN_WAITERS`` waiters on one cluster, one read
#: of Ray's job list (``GET /api/jobs/``) at most half a poll old gives each its job's status instead of
#: a request per waiter per poll; a job's end is seen at most half a poll later.
JOB_LIST_SHARED_FOR_POLLS = 0.5
JOB_LIST_MIN_WAITERS = 2
#: Ray's list holds every job the cluster ever ran. Longer than this many jobs per waiter, one list
#: costs more than the waiters' own reads: they read their own until enough waiters joined for the
#: length last read, or ``JOB_LIST_RETRY_S`` passed (the list is read again to measure it).
JOB_LIST_MAX_PER_WAITER = 8
JOB_LIST_RETRY_S = 600.0
#: Shared reads older than this are dropped when another is kept (dead clusters, loops).
_SHARED_READS_KEPT_S = 600.0

Cluster = tuple[str, str]

#: A wait that starts with its job polls again after this many seconds, then after twice as long each
#: time, until ``poll_interval``: a short job (a preflight, a probe) is seen to end within about its
#: own duration, not a whole interval later, and a week-long one pays 3 or 4 extra polls at its start.
FIRST_POLL_S = 0.5


def poll_pause(polls: int, poll_interval: float, *, fresh: bool) -> float:
    """Seconds to sleep after a wait's ``polls``-th poll. Only a fresh wait (nothing of its job read
    yet) starts fast: a triggerer restarting with many long-running waits polls them at the interval."""
    if not fresh or polls < 1:
        return poll_interval
    return min(poll_interval, FIRST_POLL_S * 2 ** min(polls - 1, 30))


@dataclass
class _SharedRead:
    loop: asyncio.AbstractEventLoop
    started: float
    task: asyncio.Task[tuple[float, Any]]


class SharedClusterReads:
    """The latest read of one kind (node summary, job list) of each cluster, shared by its waiters.

    Keyed by the cluster (its dashboard URL and connection) and the event loop (a triggerer runs
    every trigger in one loop; ``airflow dags test`` runs each in its own): a waiter takes a read
    started at most ``max_age`` seconds ago, finished or in flight, else starts one with its own
    hook. A read that failed is not shared.
    """

    def __init__(self) -> None:
        self._reads: dict[Cluster, _SharedRead] = {}

    async def read(self, cluster: Cluster, max_age: float, read: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
        """``(time.time() when read, what was read)``; raises what the read raised."""
        loop, now = asyncio.get_running_loop(), time.monotonic()
        shared = self._reads.get(cluster)
        if (shared is None or shared.loop is not loop or now - shared.started > max_age
                or (shared.task.done() and (shared.task.cancelled() or shared.task.exception() is not None))):
            for key in [k for k, r in self._reads.items() if now - r.started > _SHARED_READS_KEPT_S]:
                del self._reads[key]

            async def timed() -> tuple[float, Any]:
                result = await read()
                return time.time(), result

            shared = self._reads[cluster] = _SharedRead(loop, now, loop.create_task(timed()))
        # A waiter cancelled mid-read (its job ended, the triggerer stops it) leaves the read to the others.
        return await asyncio.shield(shared.task)


class ClusterWaiters:
    """How many waiters of each cluster this process runs now (per event loop), and how long each
    cluster's job list was when last read."""

    def __init__(self) -> None:
        self._count: dict[tuple[Cluster, asyncio.AbstractEventLoop], int] = {}
        self._list_length: dict[Cluster, tuple[int, float]] = {}

    def join(self, cluster: Cluster) -> None:
        key = (cluster, asyncio.get_running_loop())
        self._count[key] = self._count.get(key, 0) + 1

    def leave(self, cluster: Cluster) -> None:
        key = (cluster, asyncio.get_running_loop())
        left = self._count.get(key, 0) - 1
        if left > 0:
            self._count[key] = left
        else:
            self._count.pop(key, None)

    def count(self, cluster: Cluster) -> int:
        return self._count.get((cluster, asyncio.get_running_loop()), 0)

    def share_job_list(self, cluster: Cluster) -> bool:
        """Whether the cluster's waiters read their statuses from its job list: enough of them, and the
        list, as last read, not longer than they are worth (read again after ``JOB_LIST_RETRY_S``)."""
        waiters = self.count(cluster)
        if waiters < JOB_LIST_MIN_WAITERS:
            return False
        seen = self._list_length.get(cluster)
        return (seen is None or seen[0] <= JOB_LIST_MAX_PER_WAITER * waiters
                or time.monotonic() - seen[1] > JOB_LIST_RETRY_S)

    def job_list_read(self, cluster: Cluster, jobs: int) -> None:
        self._list_length[cluster] = (jobs, time.monotonic())


#: One each per process: what the triggerer's waiters share.
NODE_READS = SharedClusterReads()
JOB_LIST_READS = SharedClusterReads()
WAITERS = ClusterWaiters()


class RayJobTrigger(BaseTrigger):
    """Wait until a Ray job is terminal, forwarding its new log lines and verl's training progress.

    Never raises: every outcome is one ``TriggerEvent`` whose ``status`` is a
    :class:`~verl_pipeline.jobs.outcome.WaitEvent` value, plus ``job_id``, ``message`` and the cursors a resumed
    trigger continues from: ``log_offset_bytes`` (bytes of the driver log file already forwarded or
    skipped, always at a line end), ``metrics_offset_bytes`` (bytes of verl's metrics JSONL read)
    and ``progress`` (the last step verl reported, see :mod:`verl_pipeline.jobs.progress`).

    Polls come every ``poll_interval`` seconds, sooner at the start of a wait that starts with its
    job (:func:`poll_pause`). Each poll asks for the job's status, so the job's end is seen on the
    first poll after it (half a poll later at most where several waiters of one cluster share its job
    list: ``JOB_LIST_*``). The
    log is read on every other poll (``LOG_READ_EVERY_POLLS``), on the first, on the one after a read
    that could not take everything, and on the poll that sees the job ended; the nodes are counted on
    the polls between. Logs are read from the driver node's dashboard agent with an HTTP ``Range``
    request from the cursor, so a read brings the job's new output, not its whole log. At most
    ``max_lines_per_poll`` lines are forwarded and at most ``max_read_bytes`` read per poll since the
    last read.

    Progress (``step 120/500 (24%) · 3.1 min/step · ETA … · GPU 87% (2 nodes, min 80%)``) comes from
    verl's console metric lines in the log, or from ``metrics_path`` (verl's file logger, when the
    triggerer can read it): the file is read when the log shows a step the file has not given yet,
    and every poll while the log shows none (see :func:`~verl_pipeline.jobs.progress.metrics_file_due`).
    It is logged when a new step arrived and ``progress_interval`` seconds have passed since the last
    report, so every step is reported when steps are slower than that; the last step
    (``total_steps``) is always logged, and so is the last step of a job that ended (once).

    ``node_lost``: fewer Ray nodes than the cluster was provisioned with (``expected_nodes``) stayed
    alive for ``node_grace_polls`` counts in a row while the job still ran. A job can hang instead
    of failing when a node dies (collectives waiting on a dead peer, work waiting for a node that
    will not return), so the waiter does not wait for the job to notice. The nodes are counted every
    other poll, every poll once one is missing, and at once when the log says something died (see
    :class:`~verl_pipeline.jobs.watchdog.NodeWatch`): a loss ends the wait at most one poll later
    than counting every poll would. The waiters of one cluster share its node summary
    (:class:`SharedClusterReads`: a read at most half a poll interval old serves them all).

    GPUs: the node counts read Ray's node summary, which carries each GPU's utilisation and memory;
    the waiter keeps the latest for the progress line and the watchdog, and appends one sample per
    GPU node every ``gpu_sample_interval`` seconds to the run directory's ``gpu-usage.jsonl``
    (:mod:`verl_pipeline.jobs.gpu_usage`). On a cluster the pipeline does not own (no node counts),
    it reads the summary that often for the samples alone.

    ``cursor_dir`` (the run directory, when the triggerer can write it): the cursor is saved there
    when it moved — on the first quiet read, every ``CURSOR_SAVE_INTERVAL_S`` while the job keeps
    printing, and when the job ended — and a waiter starting over the same job (a restarted
    triggerer runs the trigger again from the kwargs it was deferred with) continues from the saved
    one: no line is forwarded twice, except up to that interval of output when the triggerer died
    while the job was printing. The cursor and the GPU samples of a poll are written in one go, off
    the event loop.

    ``hung``: the job ran without a new training step for longer than the watchdog allows
    (``watch``, a :class:`~verl_pipeline.jobs.watchdog.WatchSettings` dict; None: no watchdog, as for
    preflight jobs, which have no steps). The event's ``hang`` is the watchdog's
    :class:`~verl_pipeline.jobs.watchdog.Hang` as a dict (the last step, the seconds without one, the
    limit, what the GPUs were doing, read again when the hang is found): what the wait's decision
    reads; its ``message`` says the same for people.

    The keyword arguments are the fields of :class:`~verl_pipeline.jobs.wait_request.WaitRequest`
    (their defaults and meaning are written there): ``RayJobTrigger(**request.to_dict())``.

    A user who marks the deferred task failed or success, or clears it, ends the wait through
    :meth:`on_kill`, which stops the Ray job. :meth:`cleanup` (every exit, a triggerer restart
    included) stops nothing: the next waiter reattaches.
    """

    def __init__(self, *, log_offset: int | None = None, **kwargs: Any) -> None:
        """``kwargs``: the fields of :class:`~verl_pipeline.jobs.wait_request.WaitRequest`, as its
        ``to_dict()`` (and this trigger's :meth:`serialize`) writes them."""
        super().__init__()
        request = WaitRequest(**kwargs)
        if log_offset and not request.log_offset_bytes:
            # ``log_offset`` (characters) is what triggers serialized before the byte cursor carry;
            # for the ASCII lines Ray's job logs are mostly made of, the two agree.
            request = replace(request, log_offset_bytes=log_offset)
        self.request = request
        # The cursor moves as the job is read; every event carries it.
        self.log_offset_bytes = request.log_offset_bytes
        self.metrics_offset_bytes = request.metrics_offset_bytes
        self.progress = request.progress
        self.cursor_dir = request.cursor_dir
        self._saved_offsets = (self.log_offset_bytes, self.metrics_offset_bytes)
        self._saved_at = float("-inf")
        self._tracker: ProgressTracker | None = None
        self._stall: StallWatch | None = None
        self._reported_step = -1
        self._reported_at = float("-inf")
        self._first_step_recorded = False
        # What the log showed, for the metrics file's reads and the node counts.
        self._console_step: int | None = None
        self._file_step: int | None = None
        self._log_complete = True
        self._death_in_log = False
        self._poll = 0
        self._log_read_poll: int | None = None  # the poll that last read the log
        # The nodes and their GPUs.
        self._nodes = NodeWatch(request.expected_nodes, request.node_grace_polls) if request.expected_nodes else None
        self._recording_gpus = bool(request.cursor_dir) and request.gpu_sample_interval > 0
        self._gpus: list[NodeGpuSample] = []
        self._gpus_read_at = float("-inf")
        self._gpus_written_at = float("-inf")
        self._gpus_to_write: list[NodeGpuSample] = []
        #: A wait that starts with the job (nothing read of it yet) polls sooner at first: see poll_pause.
        self._fresh = not (request.log_offset_bytes or request.metrics_offset_bytes or request.progress)
        #: The key its waiters share reads by.
        self._cluster: Cluster = (str(request.cluster.get("dashboard_url")), request.conn_id or "")

    @property
    def job_id(self) -> str:
        return self.request.job_id

    def serialize(self) -> tuple[str, dict[str, Any]]:
        """The request, with the cursor as far as this waiter got."""
        return CLASSPATH, replace(self.request, log_offset_bytes=self.log_offset_bytes,
                                  metrics_offset_bytes=self.metrics_offset_bytes, progress=self.progress,
                                  cursor_dir=self.cursor_dir).to_dict()

    def _hook(self) -> Any:
        from verl_pipeline.airflow.hooks import RayJobsHook

        return RayJobsHook(self.request.cluster, conn_id=self.request.conn_id)

    def _event(self, status: WaitEvent, message: str, **extra: Any) -> TriggerEvent:
        return TriggerEvent({"status": status.value, "job_id": self.job_id, "message": message,
                             "log_offset_bytes": self.log_offset_bytes,
                             "metrics_offset_bytes": self.metrics_offset_bytes,
                             "progress": self.progress, **extra})

    # -- logs ---------------------------------------------------------------------------------------
    async def _forward(self, hook: Any, info: Any, polls: int) -> None:
        """Forward the lines written since the cursor, ``polls`` polls' worth at most; the cursor moves
        past every whole line read."""
        room = self.request.max_lines_per_poll * polls
        skipped = 0
        batch: list[str] = []
        async with hook.alog_stream(info, self.log_offset_bytes,
                                    max_bytes=self.request.max_read_bytes * polls) as stream:
            reader = LineReader(stream.start, mid_line=stream.mid_line)
            async for chunk in stream.chunks():
                lines = reader.feed(chunk)
                if self._tracker is not None:
                    self._observe_console(lines)
                taken = lines[:room]
                batch += taken
                room -= len(taken)
                skipped += len(lines) - len(taken)
                while len(batch) >= LINES_PER_RECORD:
                    self._log_lines(batch[:LINES_PER_RECORD])
                    batch = batch[LINES_PER_RECORD:]
            self.log_offset_bytes = reader.cursor
        if batch:
            self._log_lines(batch)
        self._log_complete = not (skipped or stream.skipped_bytes)
        if skipped or stream.skipped_bytes:
            req = self.request
            what = [f"{skipped} lines not forwarded (over {req.max_lines_per_poll} per poll)"] if skipped else []
            if stream.skipped_bytes:
                what.append(f"{stream.skipped_bytes} bytes skipped (more than {req.max_read_bytes} new bytes)")
            self.log.warning("Ray job %s: %s; the full log: %s", self.job_id, ", ".join(what), self._where(info))

    def _log_lines(self, lines: list[str]) -> None:
        """One task-log record for a batch of the job's lines."""
        text = "\n".join(lines)
        if self._nodes is not None and not self._death_in_log and speaks_of_a_death(text):
            self._death_in_log = True
        self.log.info("[%s] %s", self.job_id, text)

    def _observe_console(self, lines: list[str]) -> None:
        """verl's console metric lines among ``lines``: each new step to the tracker."""
        assert self._tracker is not None
        for line in lines:
            if "step:" in line and (parsed := parse_console_line(line)) is not None:
                self._console_step = max(self._console_step or 0, parsed[0])
                self._tracker.observe(*parsed)

    def _where(self, info: Any) -> str:
        import shlex

        from verl_pipeline.jobs.client import JOB_LOG_FILE
        from verl_pipeline.jobs.ids import job_page_url

        dashboard = str(self.request.cluster.get("dashboard_url", ""))
        # Ray's CLI needs the cluster's auth mode and token file besides its address (`--address` alone is
        # refused by a token-auth cluster): `verl-pipeline cluster env` prints all three for the run.
        run = (f"--run-dir {shlex.quote(self.request.cursor_dir)}" if self.request.cursor_dir
               else "--run-name <dag_id>/<run_id> --profile <the run's profile>")
        return (f"{job_page_url(dashboard, self.job_id)}, "
                f"`eval \"$(verl-pipeline cluster env {run})\"; ray job logs {self.job_id}`, or "
                f"{JOB_LOG_FILE.format(submission_id=self.job_id)} in the Ray log directory of node "
                f"{info.driver_node_id or '(the driver node)'}")

    # -- progress -----------------------------------------------------------------------------------
    def _read_metrics(self) -> list[str]:
        """New whole lines of verl's metrics JSONL (blocking file I/O: run in a thread)."""
        assert self.request.metrics_path is not None
        try:
            with open(self.request.metrics_path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.metrics_offset_bytes:  # truncated: verl started the file again
                    self.metrics_offset_bytes = 0
                f.seek(self.metrics_offset_bytes)
                data = f.read(_METRICS_READ_BYTES)
        except OSError:
            return []  # not written yet, or not on storage the triggerer mounts: console lines serve
        end = data.rfind(b"\n") + 1
        self.metrics_offset_bytes += end
        return data[:end].decode("utf-8", errors="replace").splitlines()

    async def _observe_metrics_file(self, *, ended: bool) -> None:
        if self._tracker is None or not self.request.metrics_path:
            return
        if not metrics_file_due(ended=ended, console_step=self._console_step, file_step=self._file_step,
                                log_complete=self._log_complete):
            return
        for line in await asyncio.to_thread(self._read_metrics):
            parsed = parse_jsonl_row(line)
            if parsed is not None:
                self._file_step = max(self._file_step or 0, parsed[0])
                self._tracker.observe(*parsed)

    def _report_progress(self, *, final: bool = False) -> None:
        """Log the progress when a new step arrived and the interval passed, and always for the last
        step (``total_steps`` reached) and, ``final``ly, for the last step the ended job logged."""
        if self._tracker is None:
            return
        last = self._tracker.last
        if last is None or last.step == self._reported_step:
            return
        self.progress = last.to_dict()
        now = time.monotonic()
        if self._stall is not None:
            self._stall.step(last.step, now, self._tracker.slowest_s)
        if final or last.reached_total or now - self._reported_at >= self.request.progress_interval:
            self._reported_step, self._reported_at = last.step, now
            gpus = GpuSummary.of(self._gpus)
            line = last.line() + (f" · {gpus.line()}" if gpus is not None else "")
            self.log.info("Ray job %s progress: %s", self.job_id, line)

    async def _record_first_step(self) -> None:
        """Keep when the job's first step arrived, beside its metrics file, for the run report."""
        last = self._tracker.last if self._tracker is not None else None
        if self._first_step_recorded or last is None or not self.request.metrics_path:
            return
        self._first_step_recorded = True  # once per waiter, written or not
        try:
            await asyncio.to_thread(record_first_step, Path(self.request.metrics_path), last)
        except OSError as e:  # not writable from the triggerer: the report says the time is unknown
            self.log.warning("Could not record when Ray job %s logged its first step: %s", self.job_id, e)

    async def _poll_logs(self, hook: Any, info: Any) -> bool | None:
        """Forward new lines and update progress when this poll reads the log (None: it does not); a
        failed read (False) is retried next poll, never fatal."""
        ended = info.status.is_terminal()
        last = self._log_read_poll
        polls = 1 if last is None else self._poll - last  # the polls this read covers
        if not (ended or last is None or polls >= LOG_READ_EVERY_POLLS or not self._log_complete):
            return None
        self._log_read_poll = self._poll
        try:
            await self._observe_metrics_file(ended=ended)  # first, so verl's exact numbers win over its console's
            if self.request.forward_logs:
                await self._forward(hook, info, polls)
            # The read of an ended job is its last: its final progress is logged whatever the interval.
            self._report_progress(final=ended)
            await self._record_first_step()
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._log_complete = False
            self.log.warning("Could not read the log of Ray job %s (at byte %d): %s", self.job_id,
                             self.log_offset_bytes, e)
            return False

    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            req = self.request
            await self._resume_cursor()
            if req.total_steps or req.metrics_path or self.progress or req.watch:
                self._tracker = ProgressTracker(req.total_steps, Progress.from_dict(self.progress))
                self._reported_step = self._tracker.last.step if self._tracker.last else -1
            if req.watch is not None and (req.forward_logs or req.metrics_path):  # steps are visible
                assert self._tracker is not None
                last_step = self._tracker.last.step if self._tracker.last else None
                self._stall = StallWatch(WatchSettings.from_dict(req.watch), time.monotonic(), last_step)
            WAITERS.join(self._cluster)
            try:
                async with self._hook() as hook:
                    async for event in self._wait(hook):
                        yield event
                        return
            finally:
                WAITERS.leave(self._cluster)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield self._event(WaitEvent.UNREACHABLE, f"the waiter failed: {e}", stack_trace=traceback.format_exc())

    # -- the nodes and their GPUs -------------------------------------------------------------------
    async def _look_at_nodes(self, hook: Any, info: Any) -> TriggerEvent | None:
        """Count the nodes when due, and read the GPUs when a sample is due; the ``node_lost`` event, if so."""
        count = self._nodes is not None and self._nodes.due(reason=self._death_in_log)
        self._death_in_log = False
        # On a cluster the waiter counts, the counts read the GPUs; on another, a read for them alone.
        sample = (self._nodes is None and self._recording_gpus
                  and time.monotonic() - self._gpus_read_at >= self.request.gpu_sample_interval)
        if not (count or sample):
            return None
        nodes = await self._read_nodes(hook)
        if self._nodes is None or not count:
            return None
        expected = self._nodes.expected
        alive = expected if nodes is None else sum(1 for n in nodes if n.alive)  # unreadable: no verdict
        if self._nodes.counted(alive):
            return self._event(WaitEvent.NODE_LOST, f"Ray node died: {alive} of {expected} nodes alive while job "
                               f"{self.job_id} was {info.status.value}", job_status=info.status.value)
        return None

    async def _read_nodes(self, hook: Any) -> list[Any] | None:
        """Ray's node summary (None when it could not be read); keeps its GPU readings, and queues a
        sample of them for the run's GPU usage file when one is due."""
        now = self._gpus_read_at = time.monotonic()
        try:
            at, nodes = await NODE_READS.read(self._cluster, self.request.poll_interval * NODE_SUMMARY_SHARED_FOR_POLLS,
                                              hook.anodes)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("Could not read the Ray nodes of %s: %s", self.job_id, e)
            return None
        self._gpus = [NodeGpuSample(time=at, node_id=n.node_id, node_ip=n.ip, gpus=n.gpus)
                      for n in nodes if n.alive and n.gpus]
        if self._recording_gpus and self._gpus and now - self._gpus_written_at >= self.request.gpu_sample_interval:
            self._gpus_to_write, self._gpus_written_at = self._gpus, now
        return nodes

    # -- the cursor and the GPU samples on disk -----------------------------------------------------
    async def _resume_cursor(self) -> None:
        """Continue from the cursor a previous run of this trigger saved, when it got further."""
        if not self.cursor_dir:
            return
        saved = await asyncio.to_thread(WaitCursor.load, Path(self.cursor_dir), self.job_id)
        if saved.log_offset_bytes > self.log_offset_bytes or saved.metrics_offset_bytes > self.metrics_offset_bytes:
            self.log.info("Ray job %s: continuing from the saved cursor (log byte %d, was %d)", self.job_id,
                          saved.log_offset_bytes, self.log_offset_bytes)
            self.log_offset_bytes = max(self.log_offset_bytes, saved.log_offset_bytes)
            self.metrics_offset_bytes = max(self.metrics_offset_bytes, saved.metrics_offset_bytes)
            self.progress = saved.progress or self.progress
        self._saved_offsets = (self.log_offset_bytes, self.metrics_offset_bytes)

    def _cursor_to_save(self, moved: bool | None, *, final: bool = False) -> WaitCursor | None:
        """The cursor when it is to be saved: it moved since the last save, and the job went quiet,
        ``CURSOR_SAVE_INTERVAL_S`` passed (a chatty job does not cost a file write per poll), or the
        job ended (``final``).

        :param moved: whether this poll's read moved it (None: this poll did not read).
        """
        offsets = (self.log_offset_bytes, self.metrics_offset_bytes)
        if not self.cursor_dir or moved is None or offsets == self._saved_offsets:
            return None
        now = time.monotonic()
        if moved and not final and now - self._saved_at < CURSOR_SAVE_INTERVAL_S:
            return None
        self._saved_at = now
        return WaitCursor(self.job_id, self.log_offset_bytes, self.metrics_offset_bytes, self.progress)

    async def _write_run_files(self, moved: bool | None, *, final: bool = False) -> None:
        """Save the cursor and append the queued GPU samples, when either is due: one trip off the loop."""
        cursor = self._cursor_to_save(moved, final=final)
        samples, self._gpus_to_write = self._gpus_to_write, []
        if cursor is None and not samples:
            return
        cursor_error, gpus_error = await asyncio.to_thread(self._write_files, cursor, samples)
        if cursor is not None and cursor_error is None:
            self._saved_offsets = (cursor.log_offset_bytes, cursor.metrics_offset_bytes)
        if cursor_error is not None:  # not writable from the triggerer: the deferral's cursor still serves
            self.log.warning("Could not save the log cursor of Ray job %s: %s", self.job_id, cursor_error)
            self.cursor_dir = None
        if gpus_error is not None:
            self.log.warning("Could not record the GPU usage of Ray job %s (not recorded from now on): %s",
                             self.job_id, gpus_error)
            self._recording_gpus = False

    def _write_files(self, cursor: WaitCursor | None,
                     samples: list[NodeGpuSample]) -> tuple[OSError | None, OSError | None]:
        """The writes of :meth:`_write_run_files` (blocking file I/O: run in a thread); each one's error."""
        cursor_error = gpus_error = None
        if cursor is not None and self.cursor_dir:
            try:
                cursor.save(Path(self.cursor_dir))
            except OSError as e:
                cursor_error = e
        if samples and self.request.cursor_dir:
            try:
                append_samples(RunDir(Path(self.request.cursor_dir)).gpu_usage_file, samples)
            except OSError as e:
                gpus_error = e
        return cursor_error, gpus_error

    async def _job_info(self, hook: Any) -> JobInfo | None:
        """The job's status: from the cluster's shared job list when its waiters share one, else (and
        when the list failed, or does not hold the job yet) read for this job alone."""
        if WAITERS.share_job_list(self._cluster):
            try:
                _, jobs = await JOB_LIST_READS.read(
                    self._cluster, self.request.poll_interval * JOB_LIST_SHARED_FOR_POLLS, hook.ajob_details)
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the job's own read decides whether the cluster is unreachable
                self.log.debug("Ray job %s: the shared job list failed (%s); reading the job alone", self.job_id, e)
            else:
                WAITERS.job_list_read(self._cluster, len(jobs))
                raw = jobs.get(self.job_id)
                if raw is not None:
                    from verl_pipeline.jobs.client import JobInfo

                    return JobInfo.from_api(raw)
        info: JobInfo | None = await hook.aget_job(self.job_id)
        return info

    async def _wait(self, hook: Any) -> AsyncIterator[TriggerEvent]:
        req = self.request
        errors = 0
        while True:
            try:
                info = await self._job_info(hook)
                errors = 0
            except asyncio.CancelledError:
                raise
            except Exception as e:  # the cluster may be briefly unreachable: retry a few times
                errors += 1
                self.log.warning("Polling Ray job %s failed (%d/%d): %s", self.job_id, errors,
                                 req.max_poll_errors, e)
                if errors >= req.max_poll_errors:
                    yield self._event(WaitEvent.UNREACHABLE, f"Ray Jobs API unreachable: {e}")
                    return
                await asyncio.sleep(req.poll_interval)
                continue
            if info is None:
                yield self._event(WaitEvent.UNREACHABLE, f"Ray job {self.job_id} does not exist on the cluster")
                return
            self._poll += 1
            before = self.log_offset_bytes, self.metrics_offset_bytes
            read = await self._poll_logs(hook, info)
            moved = None if read is None else (self.log_offset_bytes, self.metrics_offset_bytes) != before
            if info.status.is_terminal():
                await self._write_run_files(moved, final=True)
                yield self._event(WaitEvent.of_state(info.status), info.message, job_status=info.status.value,
                                  driver_exit_code=info.driver_exit_code)
                return
            lost = await self._look_at_nodes(hook, info)
            await self._write_run_files(moved)
            if lost is not None:
                yield lost
                return
            # Steps are only seen through the log: a poll that did not read it says nothing of a hang.
            hang = self._stall.hang(time.monotonic()) if self._stall is not None and read else None
            if hang is not None:
                if self._nodes is not None or self._recording_gpus:
                    await self._read_nodes(hook)  # what the GPUs are doing now is the hang's evidence
                hang = replace(hang, gpu=GpuSummary.of(self._gpus))
                self.log.warning("Ray job %s: %s", self.job_id, hang.message)
                yield self._event(WaitEvent.HUNG, hang.message, job_status=info.status.value, hang=hang.to_dict())
                return
            await asyncio.sleep(poll_pause(self._poll, req.poll_interval, fresh=self._fresh))

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or success, or cleared it: stop the Ray job."""
        self.log.warning("Task killed by a user: stopping Ray job %s", self.job_id)
        try:
            stopped = await asyncio.to_thread(self._hook().stop, self.job_id)
            self.log.warning("Ray job %s: %s", self.job_id, "stopped" if stopped else "already ended")
        except Exception as e:  # never raise out of the triggerer
            self.log.error("Could not stop Ray job %s: %s", self.job_id, e)
