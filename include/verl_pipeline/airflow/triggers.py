"""Deferrable wait on a Ray job: polls with async HTTP, forwards new log lines, yields one event.

The trigger is a loop over the parts of a wait, each with one concern and its own module:

- the log cursor: :class:`~verl_pipeline.jobs.logstream.LogFollower` reads the job's new output and
  forwards it; :class:`~verl_pipeline.jobs.logstream.CursorKeeper` saves the cursor in the run directory;
- progress: :class:`~verl_pipeline.jobs.progress.ProgressWatch` (verl's console lines and metrics file);
- nodes and GPUs: :class:`~verl_pipeline.jobs.cluster_watch.ClusterWatch` (node counts, GPU samples);
- the start, phase by phase up to the first step: :class:`~verl_pipeline.jobs.startup.phases.StartupWatch`;
- the watchdog: :class:`~verl_pipeline.jobs.watchdog.StallWatch`.

The parts' writes of a poll go to the run directory in one trip off the event loop
(:mod:`verl_pipeline.jobs.run_files`); the waiters of one cluster share its reads
(:mod:`verl_pipeline.jobs.shared_reads`, one set per process, here).

Each poll, in this order (polls come every ``poll_interval`` seconds, sooner at the start of a
wait that starts with its job: :func:`poll_pause`):

1. **status**: the job's own read, or its share of the cluster's job list where several waiters
   of one cluster share it (``JOB_LIST_*`` in :mod:`~verl_pipeline.jobs.shared_reads`); the job's
   end is seen on the first poll after it (half a poll later at most with a shared list);
2. **log**, every other poll and on the one that sees the job ended (:class:`LogFollower`): new
   lines forwarded, each handed to the progress part (verl's console lines), the start-up part
   (the lines that end each phase of the start, until the first step: :class:`StartupWatch`)
   and the nodes part (a line that says something died); verl's metrics file read when due
   (:class:`ProgressWatch`); a progress line logged when due (``step 120/500 (24%) · 3.1 min/step
   · ETA … · GPU 87% (2 nodes, min 80%)``), and at the first step the start's phases; then, at
   the first step (or the end of a job without one), Ray's records of how each actor of the start
   came up (:mod:`~verl_pipeline.jobs.startup.actors`, two reads of Ray's state API; again on the next
   polls while Ray has not recorded all of it, for ``startup.ACTOR_READ_WINDOW_S`` at most);
3. **ended** → the parts' files written, the terminal event;
4. **nodes and GPUs** (:class:`ClusterWatch`): ``node_lost`` when fewer nodes than the cluster
   was provisioned with (``expected_nodes``) stayed alive for ``node_grace_polls`` counts while
   the job still ran (a job can hang instead of failing when a node dies); GPU samples every
   ``gpu_sample_interval`` seconds into the run directory's ``gpu-usage.jsonl``;
5. **hang** (:class:`StallWatch`, ``watch`` a :class:`~verl_pipeline.jobs.watchdog.WatchSettings`
   dict; None for preflight jobs): ``hung`` when the job ran without a new training step for
   longer than the watchdog allows, judged only on polls that read the log. The event's ``hang``
   is the watchdog's :class:`~verl_pipeline.jobs.watchdog.Hang` as a dict, with what the GPUs
   were doing (read again when the hang is found): what the wait's decision reads;
6. **files**: the cursor (saved when it moved: on the first quiet read, every
   ``CURSOR_SAVE_INTERVAL_S`` while the job keeps printing, and when the wait ends), the GPU samples
   (once a minute, and when the wait ends) and the start's records, in one trip off the event loop;
   a restarted triggerer (which runs the trigger again from the kwargs it was deferred with)
   continues from the saved cursor. Then the ``node_lost`` or ``hung`` event, if any.
"""

from __future__ import annotations

import asyncio
import time
import traceback
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from verl_pipeline.jobs.cluster_watch import ClusterWatch
from verl_pipeline.jobs.logstream import CursorKeeper, LogFollower, WaitCursor, where_the_log_is
from verl_pipeline.jobs.outcome import WaitEvent
from verl_pipeline.jobs.progress import ProgressWatch
from verl_pipeline.jobs.run_files import FileWrite, write_all
from verl_pipeline.jobs.shared_reads import (  # noqa: F401  (the trigger's module names what its waiters share)
    JOB_LIST_MAX_PER_WAITER,
    JOB_LIST_SHARED_FOR_POLLS,
    Cluster,
    ClusterWaiters,
    SharedClusterReads,
)
from verl_pipeline.jobs.startup.actors import from_ray
from verl_pipeline.jobs.startup.markers import Phase
from verl_pipeline.jobs.startup.phases import StartupWatch
from verl_pipeline.jobs.wait_request import WaitRequest
from verl_pipeline.jobs.watchdog import StallWatch, WatchSettings
from verl_pipeline.rundir import RunDir

if TYPE_CHECKING:
    from verl_pipeline.jobs.client import JobInfo

#: Where Airflow finds the trigger again (kept as it is: deferred tasks of a running deployment resume by it).
CLASSPATH = "verl_pipeline.airflow.triggers.RayJobTrigger"

#: A wait that starts with its job polls again after this many seconds, then after twice as long each
#: time, until ``poll_interval``: a short job (a preflight, a probe) is seen to end within about its
#: own duration, not a whole interval later, and a week-long one pays 3 or 4 extra polls at its start.
FIRST_POLL_S = 0.5
#: The longest one read of Ray's records of a start's actors may take (two state API lists).
ACTOR_STARTS_READ_S = 30.0


def poll_pause(polls: int, poll_interval: float, *, fresh: bool) -> float:
    """Seconds to sleep after a wait's ``polls``-th poll. Only a fresh wait (nothing of its job read
    yet) starts fast: a triggerer restarting with many long-running waits polls them at the interval."""
    if not fresh or polls < 1:
        return poll_interval
    return min(poll_interval, FIRST_POLL_S * 2 ** min(polls - 1, 30))


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

    Each poll reads the job's status, then (when due) its log and verl's metrics, its nodes and GPUs,
    writes what the parts have to write, and asks the watchdog: the order and each part's concern are
    in this module's docstring.

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
        self.request = req = request
        self._poll = 0
        #: A wait that starts with the job (nothing read of it yet) polls sooner at first: see poll_pause.
        self._fresh = not (req.log_offset_bytes or req.metrics_offset_bytes or req.progress)
        #: The key its waiters share reads by.
        self._cluster: Cluster = (str(req.cluster.get("dashboard_url")), req.conn_id or "")
        # The parts; the cursor moves as the job is read, and every event carries it.
        self._follower = LogFollower(job_id=req.job_id, offset=req.log_offset_bytes,
                                     max_lines_per_poll=req.max_lines_per_poll, max_read_bytes=req.max_read_bytes,
                                     log=self.log, where=self._where)
        self._keeper = CursorKeeper(req.cursor_dir, req.job_id)
        self._progress = ProgressWatch(total=req.total_steps, metrics_path=req.metrics_path, progress=req.progress,
                                       metrics_offset=req.metrics_offset_bytes, interval=req.progress_interval)
        #: Steps are followed for training waits (anything that says so); a preflight's are not.
        self._tracking = bool(req.total_steps or req.metrics_path or req.progress or req.watch)
        self._nodes = ClusterWatch(
            job_id=req.job_id, expected_nodes=req.expected_nodes, grace_polls=req.node_grace_polls,
            usage_file=RunDir(Path(req.cursor_dir)).gpu_usage_file if req.cursor_dir else None,
            sample_interval=req.gpu_sample_interval, poll_interval=req.poll_interval, reads=NODE_READS,
            cluster=self._cluster, log=self.log)
        self._startup = StartupWatch(job_id=req.job_id, metrics_path=req.metrics_path, log=self.log,
                                     skipped=frozenset(Phase(p) for p in req.startup_skipped))
        self._stall: StallWatch | None = None  # started with the wait (its windows are the waiter's clock)

    # -- the cursor, as far as this waiter got ------------------------------------------------------
    @property
    def job_id(self) -> str:
        return self.request.job_id

    @property
    def log_offset_bytes(self) -> int:
        return self._follower.offset

    @property
    def metrics_offset_bytes(self) -> int:
        return self._progress.metrics_offset_bytes

    @property
    def progress(self) -> dict[str, Any] | None:
        return self._progress.progress

    @property
    def cursor_dir(self) -> str | None:
        """The run directory while the cursor can be saved there (None once a save failed)."""
        return self._keeper.run_dir

    def _cursor(self) -> WaitCursor:
        return WaitCursor(self.job_id, self.log_offset_bytes, self.metrics_offset_bytes, self.progress)

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

    def _where(self, info: Any) -> str:
        return where_the_log_is(dashboard_url=str(self.request.cluster.get("dashboard_url", "")), job_id=self.job_id,
                                run_dir=self.request.cursor_dir, driver_node_id=info.driver_node_id)

    # -- the wait -----------------------------------------------------------------------------------
    async def run(self) -> AsyncIterator[TriggerEvent]:
        try:
            # The parts log to the trigger's logger as it is when the wait starts (the triggerer sets it up
            # after building the trigger).
            self._follower.log = self._nodes.log = self._startup.log = self.log
            await self._resume()
            req = self.request
            if req.watch is not None and (req.forward_logs or req.metrics_path):  # steps are visible
                last = self._progress.tracker.last
                self._stall = StallWatch(WatchSettings.from_dict(req.watch), time.monotonic(),
                                         last.step if last else None)
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
            read = await self._read_log(hook, info)
            moved = None if read is None else (self.log_offset_bytes, self.metrics_offset_bytes) != before
            if self._tracking and self._startup.actors_due(ended=info.status.is_terminal()):
                await self._read_actor_starts(hook, info)
            if info.status.is_terminal():
                await self._write_run_files(moved, final=True)
                yield self._event(WaitEvent.of_state(info.status), info.message, job_status=info.status.value,
                                  driver_exit_code=info.driver_exit_code)
                return
            alive = await self._nodes.look(hook)
            hang = await self._hang(hook, read) if alive is None else None
            await self._write_run_files(moved, final=alive is not None or hang is not None)  # the last, if it ends
            if alive is not None:
                assert self._nodes.nodes is not None
                yield self._event(WaitEvent.NODE_LOST, f"Ray node died: {alive} of {self._nodes.nodes.expected} nodes "
                                  f"alive while job {self.job_id} was {info.status.value}",
                                  job_status=info.status.value)
                return
            if hang is not None:
                yield self._event(WaitEvent.HUNG, hang.message, job_status=info.status.value, hang=hang.to_dict())
                return
            await asyncio.sleep(poll_pause(self._poll, req.poll_interval, fresh=self._fresh))

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

    async def _read_log(self, hook: Any, info: Any) -> bool | None:
        """Read the log and verl's metrics when this poll does (None: it does not), and report the
        steps they brought; a failed read (False) is retried next poll, never fatal."""
        ended = info.status.is_terminal()
        polls = self._follower.due(self._poll, ended=ended)
        if polls is None:
            return None
        try:
            # The file first, so verl's exact numbers win over its console's.
            if self._tracking and self._progress.metrics_file_due(ended=ended, log_complete=self._follower.complete):
                self._progress.observe_rows(await asyncio.to_thread(self._progress.read_metrics))
            if self.request.forward_logs:
                watchers: list[Callable[[list[str]], None]] = [self._progress.observe_lines] if self._tracking else []
                if self._tracking and not self._startup.done:
                    if info.start_time:
                        self._startup.started_at = info.start_time / 1000  # Ray's, in milliseconds
                    watchers.append(lambda lines: self._startup.observe_lines(lines, time.time()))
                await self._follower.read(hook, info, polls, lines_to=watchers, records_to=[self._nodes.observe_record])
            # The read of an ended job is its last: its final progress is logged whatever the interval.
            self._steps_seen(final=ended)
            return True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._follower.complete = False
            self.log.warning("Could not read the log of Ray job %s (at byte %d): %s", self.job_id,
                             self.log_offset_bytes, e)
            return False

    async def _read_actor_starts(self, hook: Any, info: JobInfo) -> None:
        """Ray's records of how each actor of the start came up, read at the first step (the start's actors
        are alive then; again the next polls while Ray has not recorded all of it, for
        ``startup.ACTOR_READ_WINDOW_S`` at most) or at the end of a job that had none. A failed read is said,
        never retried."""
        if not info.ray_job_id or not info.start_time:
            self._startup.actors_unread("its driver never started")
            return
        ended = info.status.is_terminal()
        try:
            tasks, workers = await asyncio.wait_for(hook.aactor_starts(info.ray_job_id, alive_only=not ended),
                                                    ACTOR_STARTS_READ_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._startup.actors_unread(f"Ray's state API: {e or type(e).__name__}")
            return
        starts = await asyncio.to_thread(from_ray, tasks, workers, info.start_time)
        self._startup.observe_actors(starts, ended=ended, now=time.monotonic())

    def _steps_seen(self, *, final: bool) -> None:
        """Hand the newest step to the first-step record and the watchdog; log the progress when due."""
        if not self._tracking or (seen := self._progress.tracker.last) is None:
            return
        self._startup.first_step(seen)
        last = self._progress.unreported()
        if last is None:
            return
        now = time.monotonic()
        if self._stall is not None:
            self._stall.step(last.step, now, self._progress.tracker.slowest_s)
        if self._progress.line_due(last, now, final=final):
            gpus = self._nodes.summary()
            self.log.info("Ray job %s progress: %s", self.job_id, last.line() + (f" · {gpus.line()}" if gpus else ""))

    async def _hang(self, hook: Any, read: bool | None) -> Any:
        """The watchdog's :class:`~verl_pipeline.jobs.watchdog.Hang`, with what the GPUs do now, or None.
        Steps are only seen through the log: a poll that did not read it says nothing of a hang."""
        hang = self._stall.hang(time.monotonic()) if self._stall is not None and read else None
        if hang is None:
            return None
        if self._nodes.reads_nodes:
            await self._nodes.read(hook)  # what the GPUs are doing now is the hang's evidence
        hang = replace(hang, gpu=self._nodes.summary())
        self.log.warning("Ray job %s: %s", self.job_id, hang.message)
        return hang

    # -- the run directory --------------------------------------------------------------------------
    async def _resume(self) -> None:
        """Continue from what a previous run of this trigger saved: the cursor, when it got further, and
        the phases of the start it saw."""
        saved = await asyncio.to_thread(self._keeper.load) if self._keeper.run_dir else None
        if saved is not None and (saved.log_offset_bytes > self.log_offset_bytes
                                  or saved.metrics_offset_bytes > self.metrics_offset_bytes):
            self.log.info("Ray job %s: continuing from the saved cursor (log byte %d, was %d)", self.job_id,
                          saved.log_offset_bytes, self.log_offset_bytes)
            self._follower.offset = max(self.log_offset_bytes, saved.log_offset_bytes)
            self._progress.resume(saved.progress or self.progress,
                                  max(self.metrics_offset_bytes, saved.metrics_offset_bytes))
        self._keeper.started_at(self._cursor())
        if self._tracking:
            await asyncio.to_thread(self._startup.resume, started=self._progress.tracker.last is not None)

    async def _write_run_files(self, moved: bool | None, *, final: bool) -> None:
        """The parts' writes of this poll (the cursor, GPU samples, the start's records), in one trip off the loop."""
        cursor = self._keeper.write(self._cursor(), moved=moved, final=final)
        writes: list[FileWrite] = [*([cursor] if cursor else []), *self._nodes.writes(final=final),
                                   *self._startup.writes()]
        if not writes:
            return
        for write, error in await asyncio.to_thread(write_all, writes):
            write.failed(error)
            self.log.warning("Ray job %s: could not %s: %s", self.job_id, write.what, error)

    async def on_kill(self) -> None:
        """The user marked the deferred task failed or success, or cleared it: stop the Ray job."""
        self.log.warning("Task killed by a user: stopping Ray job %s", self.job_id)
        try:
            stopped = await asyncio.to_thread(self._hook().stop, self.job_id)
            self.log.warning("Ray job %s: %s", self.job_id, "stopped" if stopped else "already ended")
        except Exception as e:  # never raise out of the triggerer
            self.log.error("Could not stop Ray job %s: %s", self.job_id, e)
