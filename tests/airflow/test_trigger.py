from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.airflow import triggers
from verl_pipeline.airflow.triggers import CLASSPATH, RayJobTrigger
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.constants import JobState
from verl_pipeline.exceptions import ClusterError
from verl_pipeline.jobs.client import JobInfo, LogSource, LogStream, NodeInfo
from verl_pipeline.jobs.gpu_usage import read_samples, readings_from_summary
from verl_pipeline.jobs.logstream import WaitCursor
from verl_pipeline.jobs.outcome import Action, Observation, decide
from verl_pipeline.jobs.progress import ProgressWatch, first_step_seen_at
from verl_pipeline.jobs.restart_budget import AttemptProgress, RestartBudget
from verl_pipeline.jobs.wait_request import WaitRequest
from verl_pipeline.jobs.watchdog import Hang
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.rundir import RunDir

#: A restart budget with room left (the decision on a hang event needs one): one attempt that saved step 2.
RESTARTABLE = RestartBudget(RestartPolicy(), (AttemptProgress(1, "j-a1", 0, 2, 2),))

CLUSTER = ClusterHandle(backend="local", name="n", dashboard_url="http://127.0.0.1:1", owned=True).to_dict()


class Body:
    """An aiohttp response body that hands out its bytes in chunks of a chosen size."""

    def __init__(self, data: bytes, chunk: int) -> None:
        self.data, self.chunk = data, chunk

    async def iter_chunked(self, n: int) -> AsyncIterator[bytes]:
        for i in range(0, len(self.data), self.chunk):
            yield self.data[i:i + self.chunk]


@pytest.fixture(autouse=True)
def _fresh_shared_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """What one process's waiters share starts empty for each test."""
    monkeypatch.setattr(triggers, "WAITERS", triggers.ClusterWaiters())
    monkeypatch.setattr(triggers, "JOB_LIST_READS", triggers.SharedClusterReads())
    monkeypatch.setattr(triggers, "NODE_READS", triggers.SharedClusterReads())


class ScriptedHook:
    """Replays a sequence of job states / errors, and a growing log, like a real Jobs API would.

    ``logs[i]`` is the whole log as it is on poll ``i + 1`` (the last one from then on), whether
    that poll reads it or not. The log is bytes; a read serves the bytes from the cursor on (like
    Ray's agent with an HTTP Range request), in chunks of ``chunk`` bytes, so lines and characters
    split across reads.
    """

    def __init__(self, states: list[Any], logs: list[str | bytes], *, chunk: int = 7,
                 nodes: Callable[[int], list[NodeInfo]] | None = None) -> None:
        self.states = list(states)
        self.log_seq = [x.encode() if isinstance(x, str) else x for x in logs]
        self.status_calls = 0
        self.entered = 0
        self.bytes_read = 0
        self.chunk = chunk
        #: The cluster's nodes on each poll (``nodes(poll)``); a one-node CPU cluster by default.
        self.nodes = nodes or (lambda poll: cluster_nodes(1))
        #: The polls on which the node summary, and the log, were read.
        self.node_reads: list[int] = []
        self.log_reads: list[int] = []

    async def __aenter__(self) -> ScriptedHook:
        self.entered += 1
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    async def aget_job(self, job_id: str) -> JobInfo | None:
        self.status_calls += 1
        item = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(item, Exception):
            raise item
        if item is None:
            return None
        return JobInfo(submission_id=job_id, status=JobState(item), message=f"job is {item}", driver_exit_code=0)

    @asynccontextmanager
    async def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> AsyncIterator[LogStream]:
        self.log_reads.append(self.status_calls)
        log = self.log_seq[min(self.status_calls, len(self.log_seq)) - 1]
        new = log[start:]
        self.bytes_read += len(new)
        # size unknown (as from the state API): the stream is read in chunks, cut anywhere
        yield LogStream(start=start, size=None, skipped_bytes=0, source=LogSource.AGENT,
                        body=Body(new, self.chunk))

    async def anodes(self) -> list[NodeInfo]:
        self.node_reads.append(self.status_calls)
        return self.nodes(self.status_calls)


def cluster_nodes(alive: int, *, dead: int = 0, gpu_util: list[float | None] | None = None) -> list[NodeInfo]:
    """A head without GPUs, ``alive - 1`` workers each with GPUs at ``gpu_util`` (none when None), and
    ``dead`` dead workers, as the client parses Ray's node summary."""
    gpus = readings_from_summary([{"index": i, "utilizationGpu": u, "memoryUsed": 90000, "memoryTotal": 143771}
                                  for i, u in enumerate(gpu_util or [])])
    head = NodeInfo("h" * 56, True, True, "10.0.0.1", {"CPU": 8.0})
    workers = [NodeInfo(f"{k:056d}", True, False, f"10.0.1.{k}", {"CPU": 64.0, "GPU": float(len(gpus))}, gpus)
               for k in range(1, alive)]
    gone = [NodeInfo(f"d{k:055d}", False, False, f"10.0.2.{k}", {}, ()) for k in range(dead)]
    return [head, *workers, *gone]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def capture(trigger: RayJobTrigger) -> list[str]:
    """The lines the trigger logs (what Airflow shows in the task log), one per line."""
    logger = logging.getLogger(f"test.trigger.{id(trigger)}")
    logger.setLevel(logging.INFO)
    handler = Lines()
    logger.addHandler(handler)
    trigger._log = logger
    return handler.lines


def forwarded(messages: list[str], job_id: str = "job-1") -> list[str]:
    """The job's log lines among the messages (forwarded in batches: ``[job] line\\nline…``)."""
    prefix = f"[{job_id}] "
    return [line for m in messages if m.startswith(prefix) for line in m[len(prefix):].split("\n")]


async def _events(trigger: RayJobTrigger, hook: ScriptedHook) -> list[dict[str, Any]]:
    trigger._hook = lambda: hook  # type: ignore[method-assign]
    return [e.payload async for e in trigger.run()]


def _trigger(**kw: Any) -> RayJobTrigger:
    return RayJobTrigger(cluster=CLUSTER, job_id="job-1", poll_interval=0.01, **kw)


async def test_success_after_running_forwards_each_log_line_once() -> None:
    hook = ScriptedHook(["PENDING", "RUNNING", "RUNNING", "SUCCEEDED"],
                        ["", "line 1\npart", "line 1\npartial line\n", "line 1\npartial line\nlast\n"])
    trigger = _trigger()
    lines = capture(trigger)
    events = await _events(trigger, hook)
    assert len(events) == 1
    ev = events[0]
    assert ev["status"] == "succeeded" and ev["job_status"] == "SUCCEEDED" and ev["job_id"] == "job-1"
    assert ev["log_offset_bytes"] == len("line 1\npartial line\nlast\n")
    assert forwarded(lines) == ["line 1", "partial line", "last"]
    assert hook.entered == 1  # one session (and one token look-up) for the whole run


@pytest.mark.parametrize(("final", "status"), [("FAILED", "failed"), ("STOPPED", "stopped")])
async def test_terminal_failures_become_events(final: str, status: str) -> None:
    events = await _events(_trigger(), ScriptedHook(["RUNNING", final], ["x\n"]))
    assert [e["status"] for e in events] == [status]
    assert events[0]["message"] == f"job is {final}"


async def test_missing_job_is_an_error_event() -> None:
    events = await _events(_trigger(), ScriptedHook([None], [""]))
    assert events[0]["status"] == "unreachable" and "does not exist" in events[0]["message"]


async def test_transient_errors_are_retried_then_reported() -> None:
    hook = ScriptedHook([ConnectionError("boom"), ConnectionError("boom"), "SUCCEEDED"], [""])
    events = await _events(_trigger(max_poll_errors=3), hook)
    assert events[0]["status"] == "succeeded"
    hook = ScriptedHook([ConnectionError("down")], [""])
    events = await _events(_trigger(max_poll_errors=3), hook)
    assert events[0]["status"] == "unreachable" and "unreachable" in events[0]["message"]
    assert hook.status_calls == 3


async def test_unexpected_exception_never_escapes() -> None:
    class Broken(ScriptedHook):
        async def aget_job(self, job_id: str) -> JobInfo | None:
            raise KeyError("anything")

    events = await _events(_trigger(max_poll_errors=1), Broken(["RUNNING"], [""]))
    assert len(events) == 1 and events[0]["status"] == "unreachable"


async def test_resumed_trigger_does_not_repeat_logs() -> None:
    logs = "old 1\nold 2\nnew\n"
    trigger = _trigger(log_offset_bytes=len("old 1\nold 2\n"))
    lines = capture(trigger)
    hook = ScriptedHook(["SUCCEEDED"], [logs])
    events = await _events(trigger, hook)
    assert forwarded(lines) == ["new"]
    assert events[0]["log_offset_bytes"] == len(logs)
    assert hook.bytes_read == len("new\n")  # only the new output is read


def test_a_trigger_serialized_before_the_byte_cursor_still_resumes() -> None:
    t = RayJobTrigger(cluster=CLUSTER, job_id="j", log_offset=12)  # kwargs of a row in the metadata DB
    assert t.serialize()[1]["log_offset_bytes"] == 12


async def test_cursor_travels_through_deferrals_no_line_twice_none_lost(tmp_path: Path) -> None:
    """A growing log with multi-byte characters, read by three waiters in turn: each ends (the API
    went away, the job ended), its event's cursor is saved as the operator does, and the next
    waiter is built from the serialized kwargs of the deferral plus that cursor."""
    full = "".join(f"{i} ✓ naïve 🚀 {'x' * (i % 13)}\n" for i in range(60)).encode()
    cuts = [0, 101, 333, 334, 700, len(full) - 5, len(full)]  # mid-line and mid-character
    growing = [full[:c] for c in cuts]
    got: list[str] = []
    rounds = [(["RUNNING", "RUNNING", ConnectionError("gone")], growing[:3]),
              (["RUNNING", ConnectionError("gone")], growing[3:5]),
              (["RUNNING", "SUCCEEDED"], growing[5:])]
    kwargs = _trigger(max_poll_errors=1).serialize()[1]
    for states, logs in rounds:
        kwargs["log_offset_bytes"] = WaitCursor.load(tmp_path, "job-1").log_offset_bytes
        trigger = RayJobTrigger(**kwargs)
        lines = capture(trigger)
        events = await _events(trigger, ScriptedHook(states, logs, chunk=5))
        WaitCursor.from_event(events[0]).save(tmp_path)
        got += forwarded(lines)
    assert events[0]["status"] == "succeeded"
    assert got == full.decode().splitlines()


async def test_a_chatty_job_is_capped_per_poll_and_the_task_log_says_where_the_rest_is() -> None:
    log = "".join(f"line {i}\n" for i in range(2500))
    trigger = _trigger(max_lines_per_poll=300)
    lines = capture(trigger)
    events = await _events(trigger, ScriptedHook(["RUNNING", "SUCCEEDED"], [log], chunk=4096))
    assert forwarded(lines) == [f"line {i}" for i in range(300)]
    notes = [m for m in lines if "not forwarded" in m]
    assert len(notes) == 1 and "2200 lines not forwarded" in notes[0]
    assert "ray job logs job-1" in notes[0] and "job-driver-job-1.log" in notes[0]
    assert events[0]["log_offset_bytes"] == len(log)  # skipped lines are behind the cursor too


async def test_a_waiter_far_behind_jumps_ahead_and_says_how_much_it_skipped() -> None:
    class Behind(ScriptedHook):
        @asynccontextmanager
        async def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> AsyncIterator[LogStream]:
            log = self.log_seq[0]
            jump = len(log) - 10
            yield LogStream(start=jump, size=None, skipped_bytes=jump - start, source=LogSource.AGENT,
                            body=Body(log[jump:], 3))

    log = b"a" * 100 + b"\ntail 1\nt2\n"  # the last 10 bytes start inside "tail 1"
    trigger = _trigger()
    lines = capture(trigger)
    events = await _events(trigger, Behind(["SUCCEEDED"], [log]))
    assert forwarded(lines) == ["t2"]  # no fragment of the line the jump landed in
    assert any("101 bytes skipped" in m for m in lines)
    assert events[0]["log_offset_bytes"] == len(log)


async def test_a_failed_log_read_does_not_end_the_wait() -> None:
    class Flaky(ScriptedHook):
        reads = 0

        @asynccontextmanager
        async def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> AsyncIterator[LogStream]:
            self.reads += 1
            if self.reads == 1:
                raise ConnectionResetError("agent restarted")
            async with super().alog_stream(info, start, max_bytes=max_bytes) as s:
                yield s

    trigger = _trigger(max_poll_errors=1)
    lines = capture(trigger)
    events = await _events(trigger, Flaky(["RUNNING", "SUCCEEDED"], ["one\n"]))
    assert events[0]["status"] == "succeeded" and forwarded(lines) == ["one"]


def _step_line(step: int, seconds: float) -> str:
    return (f"(TaskRunnerV1 pid=7) step:{step} - training/global_step:{step} - critic/score/mean:{0.1 * step:.4g} - "
            f"perf/throughput:{1000 + step} - perf/time_per_step:{seconds}\n")


async def test_progress_from_console_lines_at_each_step_when_steps_are_slower_than_the_interval() -> None:
    one = len(_step_line(1, 30.0))
    log = "".join(_step_line(s, 30.0) for s in (1, 2, 3))
    trigger = _trigger(total_steps=10, progress_interval=0)
    lines = capture(trigger)
    # One new step by each read of the log (the log is read every other poll).
    events = await _events(trigger, ScriptedHook(["RUNNING"] * 4 + ["SUCCEEDED"],
                                                 [log[:one], log[:one], log[:2 * one], log[:2 * one], log]))
    progress = [m for m in lines if " progress: " in m]
    assert progress == [f"Ray job job-1 progress: step {s}/10 ({10 * s}%) · 30 s/step · ETA {eta} m · "
                        f"critic/score/mean {0.1 * s:.4g} · perf/throughput {1000 + s}"
                        for s, eta in ((1, 5), (2, 4), (3, 4))]  # 4.5, 4 and 3.5 minutes left
    assert events[0]["progress"]["step"] == 3 and events[0]["progress"]["line"].startswith("step 3/10")


async def test_progress_is_reported_at_most_every_interval_and_once_more_when_the_job_ends() -> None:
    log = "".join(_step_line(s, 1.0) for s in range(1, 6))
    first = len(_step_line(1, 1.0))
    trigger = _trigger(total_steps=10, progress_interval=3600)
    lines = capture(trigger)
    events = await _events(trigger, ScriptedHook(["RUNNING", "RUNNING", "FAILED"], [log[:first], log, log]))
    progress = [m for m in lines if " progress: " in m]
    # Steps 2-5 came within the interval; the ended job's last step is logged, once.
    assert [p.split(" · ")[0] for p in progress] == ["Ray job job-1 progress: step 1/10 (10%)",
                                                    "Ray job job-1 progress: step 5/10 (50%)"]
    assert events[0]["progress"]["step"] == 5  # the event still carries the latest


async def test_the_last_step_is_reported_whatever_the_interval() -> None:
    """On the H200, four steps fell inside one 60 s interval: the task log said "step 0/4 (0%)" (the
    validation row before training) and nothing after. A row of validation alone is no step, and
    the step that reaches total_training_steps is reported at once, while the job still runs."""

    class Watched(ScriptedHook):
        """Notes the progress lines logged before each status poll."""

        def __init__(self, *args: Any, lines: list[str]) -> None:
            super().__init__(*args)
            self.lines = lines
            self.before_poll: list[list[str]] = []

        async def aget_job(self, job_id: str) -> JobInfo | None:
            self.before_poll.append([m.split(" · ")[0] for m in self.lines if " progress: " in m])
            return await super().aget_job(job_id)

    validation = "(TaskRunner pid=7) step:0 - val-core/openai/gsm8k/reward/mean@1:0.02\n"
    first = validation + _step_line(1, 6.0)
    log = first + "".join(_step_line(s, 6.0) for s in (2, 3, 4))
    trigger = _trigger(total_steps=4, progress_interval=60)
    hook = Watched(["RUNNING", "RUNNING", "RUNNING", "SUCCEEDED"], [first, first, log], lines=capture(trigger))
    events = await _events(trigger, hook)
    # Polls 1 and 3 read the log, and the job still runs on poll 3.
    assert hook.before_poll[3] == ["Ray job job-1 progress: step 1/4 (25%)", "Ray job job-1 progress: step 4/4 (100%)"]
    assert events[0]["progress"]["step"] == 4


async def test_the_waiter_keeps_when_the_jobs_first_step_arrived(tmp_path: Path) -> None:
    """For the run report's "submit to first step": the first training step's arrival, beside the
    attempt's metrics file, written once (a reattached waiter does not move it)."""
    metrics = tmp_path / "metrics-a1.jsonl"
    rows = [{"step": 0, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.0}},
            {"step": 1, "data": {"training/global_step": 1, "perf/time_per_step": 6.0}}]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows[:1]))
    trigger = _trigger(total_steps=4, metrics_path=str(metrics), forward_logs=False)
    await _events(trigger, ScriptedHook(["SUCCEEDED"], [""]))
    assert first_step_seen_at(metrics) is None  # validation alone: no step yet
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = time.time()
    events = await _events(_trigger(total_steps=4, metrics_path=str(metrics), forward_logs=False),
                           ScriptedHook(["SUCCEEDED"], [""]))
    seen = first_step_seen_at(metrics)
    assert seen is not None and before <= seen <= time.time()
    assert events[0]["progress"]["first_step_seen_at"] == seen
    later = dict(events[0]["progress"], first_step_seen_at=seen + 1000)
    await _events(_trigger(total_steps=4, metrics_path=str(metrics), forward_logs=False, progress=later),
                  ScriptedHook(["SUCCEEDED"], [""]))
    assert first_step_seen_at(metrics) == seen


async def test_progress_prefers_verls_metrics_file_and_resumes_from_its_cursor(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-a1.jsonl"
    rows = [json.dumps({"step": s, "data": {"training/global_step": s, "perf/throughput": 500.5 + s,
                                              "perf/time_per_step": 120.0}}) for s in (1, 2, 3)]
    metrics.write_text("\n".join(rows[:2]) + "\n" + rows[2][:10])  # the third row is still being written
    trigger = _trigger(total_steps=4, metrics_path=str(metrics), progress_interval=0)
    lines = capture(trigger)
    # The console line for step 2 rounds differently: the file's numbers win.
    events = await _events(trigger, ScriptedHook(["SUCCEEDED"], ["step:2 - perf/throughput:999\n"]))
    assert [m for m in lines if " progress: " in m][-1] == (
        "Ray job job-1 progress: step 2/4 (50%) · 2 min/step · ETA 4 m · perf/throughput 502.5")
    assert events[0]["metrics_offset_bytes"] == len("\n".join(rows[:2])) + 1
    metrics.write_text("\n".join(rows) + "\n")
    again = _trigger(total_steps=4, metrics_path=str(metrics), progress_interval=0,
                     metrics_offset_bytes=events[0]["metrics_offset_bytes"], progress=events[0]["progress"])
    lines = capture(again)
    events = await _events(again, ScriptedHook(["SUCCEEDED"], [""]))
    assert [m for m in lines if " progress: " in m] == [
        "Ray job job-1 progress: step 3/4 (75%) · 2 min/step · ETA 2 m · perf/throughput 503.5"]


async def test_once_the_log_shows_steps_the_metrics_file_is_read_only_for_steps_it_has_not_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """verl prints each step's metrics to the log too: the file is read on the reads where the log
    has shown a step the file has not given yet (and on every read before the log shows any)."""
    metrics = tmp_path / "metrics-a1.jsonl"
    metrics.write_text("")
    reads: list[int] = []

    class Counted(ProgressWatch):
        def read_metrics(self) -> list[str]:
            reads.append(hook.status_calls)
            return super().read_metrics()

    def row(step: int) -> str:
        return json.dumps({"step": step, "data": {"training/global_step": step, "perf/throughput": 100.0 + step}})

    start = "starting\n"
    hook = ScriptedHook(["RUNNING"] * 8 + ["SUCCEEDED"],
                        [start] * 2 + [start + _step(1)] * 4 + [start + _step(1) + _step(2)])
    monkeypatch.setattr(triggers, "ProgressWatch", Counted)
    trigger = RayJobTrigger(cluster=CLUSTER, job_id="job-1", poll_interval=0.01, total_steps=4, progress_interval=0,
                            metrics_path=str(metrics))
    lines = capture(trigger)
    original = hook.alog_stream

    @asynccontextmanager
    async def log_then_file(info: JobInfo, start: int, *, max_bytes: int) -> AsyncIterator[LogStream]:
        async with original(info, start, max_bytes=max_bytes) as stream:
            yield stream
        # verl writes a step's row as it prints its console line; here the file lags the log a little.
        shown = 1 if hook.status_calls >= 3 else 0
        metrics.write_text("".join(row(s) + "\n" for s in range(1, shown + 1 + (hook.status_calls >= 7))))

    hook.alog_stream = log_then_file  # type: ignore[method-assign]
    events = await _events(trigger, hook)
    assert hook.log_reads == [1, 3, 5, 7, 9] and events[0]["progress"]["step"] == 2
    # Reads 1 and 3: no step in the log yet; 5: the log showed step 1 on poll 3, the file had not
    # given it; 7: the file gave step 1, the log showed no newer one; 9: the job's last look.
    assert reads == [1, 3, 5, 9]
    assert [m.split(" · ")[0] for m in lines if " progress: " in m] == ["Ray job job-1 progress: step 1/4 (25%)",
                                                                       "Ray job job-1 progress: step 2/4 (50%)"]


def test_serialize_round_trip() -> None:
    t = RayJobTrigger(cluster=CLUSTER, job_id="j", conn_id="ray_default", poll_interval=7.0, log_offset_bytes=42,
                      metrics_path="/runs/r/metrics-a1.jsonl", metrics_offset_bytes=9, total_steps=500,
                      progress={"step": 3, "total": 500, "seconds_per_step": 6.0, "metrics": {}},
                      watch={"stall_timeout_s": 60.0, "startup_timeout_s": 600.0})
    path, kwargs = t.serialize()
    assert path == CLASSPATH
    module, _, name = path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    again = cls(**kwargs)
    assert again.serialize() == (path, kwargs)
    assert kwargs["log_offset_bytes"] == 42 and kwargs["poll_interval"] == 7.0
    assert kwargs["metrics_offset_bytes"] == 9 and kwargs["progress"]["step"] == 3
    assert kwargs["watch"]["stall_timeout_s"] == 60.0
    json.dumps(kwargs)  # the kwargs go to the metadata DB as JSON


def _every_field_set() -> WaitRequest:
    """A request whose every field differs from its default (so a field the trigger dropped shows)."""
    return WaitRequest(cluster=CLUSTER, job_id="job-7", conn_id="ray_default", poll_interval=7.0, max_poll_errors=3,
                       expected_nodes=2, node_grace_polls=5, forward_logs=False, max_lines_per_poll=10,
                       max_read_bytes=4096, metrics_path="/runs/r/metrics-a1.jsonl", total_steps=500,
                       progress_interval=1.5, watch={"stall_timeout_s": 60.0}, cursor_dir="/runs/r",
                       gpu_sample_interval=120.0,
                       log_offset_bytes=42, metrics_offset_bytes=9,
                       progress={"step": 3, "total": 500, "seconds_per_step": 6.0, "metrics": {}},
                       startup_skipped=["validation"])


def test_a_trigger_built_from_its_serialized_kwargs_equals_the_original() -> None:
    request = _every_field_set()
    defaults = WaitRequest(cluster={}, job_id="")
    unset = [k for k, v in request.to_dict().items() if k not in ("cluster", "job_id") and v == defaults.to_dict()[k]]
    assert unset == []
    original = RayJobTrigger(**request.to_dict())
    assert original.request == request
    path, kwargs = original.serialize()
    assert (path, kwargs) == (CLASSPATH, request.to_dict())
    again = RayJobTrigger(**json.loads(json.dumps(kwargs)))  # as the triggerer builds it from the metadata DB
    assert again.request == original.request and again.serialize() == original.serialize()


def test_the_trigger_takes_exactly_the_requests_fields() -> None:
    with pytest.raises(TypeError, match="poll_intervall"):
        RayJobTrigger(cluster=CLUSTER, job_id="j", poll_intervall=5.0)
    assert RayJobTrigger(cluster=CLUSTER, job_id="j").request == WaitRequest(cluster=CLUSTER, job_id="j")


async def test_serialize_carries_the_cursor_as_far_as_the_waiter_got() -> None:
    trigger = _trigger(total_steps=10)
    await _events(trigger, ScriptedHook(["RUNNING", "SUCCEEDED"], ["a\n", "a\n" + _step(1)]))
    kwargs = trigger.serialize()[1]
    assert kwargs["log_offset_bytes"] == len("a\n" + _step(1)) and kwargs["progress"]["step"] == 1
    assert {k: v for k, v in kwargs.items() if k not in ("log_offset_bytes", "progress")} == {
        k: v for k, v in _trigger(total_steps=10).serialize()[1].items() if k not in ("log_offset_bytes", "progress")}


@pytest.mark.integration
async def test_against_a_real_ray_job(ray_cluster: ClusterHandle, monkeypatch: pytest.MonkeyPatch) -> None:
    import aiohttp

    from verl_pipeline.airflow.hooks import RayJobsHook

    sessions: list[object] = []
    lookups: list[str] = []

    class CountedSession(aiohttp.ClientSession):
        def __init__(self, *a: Any, **kw: Any) -> None:
            sessions.append(self)
            super().__init__(*a, **kw)

    class Conn:
        extra_dejson: dict[str, Any] = {}
        password = None  # the cluster's own token (its token file) is used
        schema = host = port = None

    def get_connection(self: RayJobsHook, conn_id: str) -> Conn:
        lookups.append(conn_id)
        return Conn()

    monkeypatch.setattr(aiohttp, "ClientSession", CountedSession)
    monkeypatch.setattr(RayJobsHook, "get_connection", get_connection)
    client = ray_cluster.client()
    job_id = f"trigger-real-{int(time.time() * 1000)}"
    client.submit(entrypoint="echo hello-from-ray; echo 'naïve ✓'; sleep 2; echo 'step:1 - perf/throughput:7.5'; "
                             "echo bye; exit 4", submission_id=job_id, runtime_env={})
    trigger = RayJobTrigger(cluster=ray_cluster.to_dict(), job_id=job_id, conn_id="ray_test", poll_interval=0.5,
                            total_steps=2, progress_interval=0)
    lines = capture(trigger)
    events = [e.payload async for e in trigger.run()]
    assert events[0]["status"] == "failed" and events[0]["driver_exit_code"] == 4
    assert "exit code 4" in events[0]["message"]
    got = forwarded(lines, job_id)
    for line in ("hello-from-ray", "naïve ✓", "step:1 - perf/throughput:7.5", "bye"):
        assert got.count(line) == 1, (line, got)
    assert events[0]["progress"]["step"] == 1 and events[0]["progress"]["metrics"] == {"perf/throughput": 7.5}
    assert events[0]["log_offset_bytes"] == len(client.logs(job_id).encode())
    assert (len(sessions), lookups) == (1, ["ray_test"])  # one session, one token look-up, many polls
    assert not any("state API" in m for m in lines)  # read from the driver's agent, by range


async def test_a_lost_node_ends_the_wait_even_if_the_job_hangs() -> None:
    alive_on_poll = [2, 1, 2, 1, 1, 1, 1, 1, 1]

    def nodes(poll: int) -> list[NodeInfo]:
        alive = alive_on_poll[poll - 1]
        return cluster_nodes(alive, dead=2 - alive)

    hook = ScriptedHook(["RUNNING"], [""], nodes=nodes)
    events = await _events(_trigger(expected_nodes=2, node_grace_polls=3), hook)
    assert events[0]["status"] == "node_lost"
    assert "1 of 2 nodes alive" in events[0]["message"] and events[0]["job_status"] == "RUNNING"
    # Counted every poll, the loss (from poll 4 on) would end the wait on poll 6; counted every other
    # poll while all are alive (every poll once one is missing), on poll 7. The blip on poll 2 does not.
    assert hook.node_reads == [2, 3, 5, 6, 7] and hook.status_calls == 7


async def test_on_a_cluster_it_owns_each_poll_reads_the_status_and_either_the_log_or_the_nodes(
        tmp_path: Path) -> None:
    """The arguments the wait operator gives a training job on a cluster the pipeline owns: the job's
    end is seen on the first poll that finds it ended (and its log read to the end); the log and the
    nodes are read on alternate polls."""
    hook = ScriptedHook(["RUNNING"] * 9 + ["SUCCEEDED"], ["a\n"], nodes=lambda poll: cluster_nodes(2, gpu_util=[50]))
    events = await _events(_trigger(expected_nodes=2, total_steps=10, watch={}, cursor_dir=str(tmp_path),
                                    metrics_path=str(tmp_path / "metrics-a1.jsonl")), hook)
    assert events[0]["status"] == "succeeded" and hook.status_calls == 10
    assert hook.log_reads == [1, 3, 5, 7, 9, 10] and hook.node_reads == [2, 4, 6, 8]


async def test_a_log_line_that_says_something_died_counts_the_nodes_on_that_poll() -> None:
    died = "ray.exceptions.ActorDiedError: The actor died because its node has died.\n"
    hook = ScriptedHook(["RUNNING"] * 5 + ["SUCCEEDED"], ["a\n"], nodes=lambda p: cluster_nodes(2))
    await _events(_trigger(expected_nodes=2), hook)
    assert hook.node_reads == [2, 4]
    hook = ScriptedHook(["RUNNING"] * 5 + ["SUCCEEDED"], ["a\n", "a\n", "a\n" + died], nodes=lambda p: cluster_nodes(2))
    await _events(_trigger(expected_nodes=2), hook)
    assert hook.node_reads == [2, 3, 5]  # poll 3 read the line, then every other poll again


# -- GPUs ---------------------------------------------------------------------------------------------
async def test_each_gpu_node_is_sampled_at_most_once_per_interval(tmp_path: Path) -> None:
    usage = RunDir(tmp_path).gpu_usage_file
    hook = ScriptedHook(["RUNNING"] * 7 + ["SUCCEEDED"], [""], nodes=lambda poll: cluster_nodes(3, gpu_util=[90, 70]))
    await _events(_trigger(expected_nodes=3, cursor_dir=str(tmp_path), gpu_sample_interval=3600), hook)
    samples = list(read_samples(usage))
    assert hook.node_reads == [2, 4, 6] and len(samples) == 2  # one reading within the hour: both GPU nodes
    assert {s.node_ip for s in samples} == {"10.0.1.1", "10.0.1.2"}  # the CPU-only head is not written
    assert [g.utilization_pct for g in samples[0].gpus] == [90.0, 70.0]
    usage.unlink()
    hook = ScriptedHook(["RUNNING"] * 7 + ["SUCCEEDED"], [""], nodes=lambda poll: cluster_nodes(3, gpu_util=[90, 70]))
    await _events(_trigger(expected_nodes=3, cursor_dir=str(tmp_path), gpu_sample_interval=1e-9), hook)
    assert len(list(read_samples(usage))) == 2 * len(hook.node_reads)  # each reading, when the interval allows


async def test_on_a_cluster_it_does_not_own_the_waiter_reads_the_nodes_only_for_gpu_samples(tmp_path: Path) -> None:
    def hook() -> ScriptedHook:
        return ScriptedHook(["RUNNING"] * 5 + ["SUCCEEDED"], [""], nodes=lambda poll: cluster_nodes(2, gpu_util=[3]))

    recording = hook()
    await _events(_trigger(cursor_dir=str(tmp_path), gpu_sample_interval=3600), recording)
    assert recording.node_reads == [1] and len(list(read_samples(RunDir(tmp_path).gpu_usage_file))) == 1
    for kwargs in ({}, {"cursor_dir": str(tmp_path / "off"), "gpu_sample_interval": 0}):
        quiet = hook()
        await _events(_trigger(**kwargs), quiet)
        assert quiet.node_reads == []
    assert not (tmp_path / "off").exists()


async def test_a_cpu_cluster_leaves_no_gpu_file(tmp_path: Path) -> None:
    hook = ScriptedHook(["RUNNING"] * 3 + ["SUCCEEDED"], [""], nodes=lambda poll: cluster_nodes(2))
    await _events(_trigger(expected_nodes=2, cursor_dir=str(tmp_path), gpu_sample_interval=1e-9), hook)
    assert hook.node_reads and not RunDir(tmp_path).gpu_usage_file.exists()


async def test_the_progress_line_shows_the_gpus_as_last_read() -> None:
    logs = ["", *("".join(_step(n) for n in range(1, k + 1)) for k in range(1, 4))]
    hook = ScriptedHook(["RUNNING"] * 4 + ["SUCCEEDED"], logs,
                        nodes=lambda poll: [*cluster_nodes(2, gpu_util=[80, 90, 95, 83]),
                                            *cluster_nodes(2, gpu_util=[85, 86, None, 90])[1:]])
    trigger = _trigger(total_steps=10, progress_interval=0, expected_nodes=3)
    lines = capture(trigger)
    await _events(trigger, hook)
    progress = [m for m in lines if " progress: " in m]
    assert progress[-1].startswith("Ray job job-1 progress: step 3/10 (30%)")
    assert progress[-1].endswith(" · GPU 87% (2 nodes, min 80%)")


@pytest.mark.parametrize(("util", "said"), [(0, "GPUs idle (0% to 0%, mean 0% on 2 GPUs of 1 node)"),
                                            (100, "GPUs busy (100% to 100%, mean 100% on 2 GPUs of 1 node)")])
async def test_a_hang_says_what_the_gpus_were_doing_when_it_was_found(util: int, said: str) -> None:
    hook = ScriptedHook(["RUNNING"], [_step(1)], nodes=lambda poll: cluster_nodes(2, gpu_util=[util, util]))
    trigger = _trigger(total_steps=10, watch={"stall_timeout_s": 0.3}, expected_nodes=2)
    lines = capture(trigger)
    events = await _events(trigger, hook)
    assert events[0]["status"] == "hung" and said in events[0]["message"]
    assert any(said in m for m in lines)  # the task log says it when the hang is found
    hang = Hang.from_dict(json.loads(json.dumps(events[0]["hang"])))
    assert hang is not None and hang.gpu is not None and hang.gpu.mean_pct == util and hang.message == events[0][
        "message"]
    assert hook.node_reads[-1] == hook.status_calls  # read again on the poll that found the hang
    assert said in decide(Observation.from_event(events[0]), budget=RESTARTABLE).message


def _step(n: int) -> str:
    return f"(TaskRunner pid=9) step:{n} - training/global_step:{n} - perf/time_per_step:0.001\n"


async def test_a_job_running_without_a_new_step_is_reported_hung() -> None:
    log = _step(1) + _step(2)
    hook = ScriptedHook(["RUNNING"], [_step(1), log])
    watch = {"stall_timeout_s": 0.3}
    events = await _events(_trigger(total_steps=10, watch=watch), hook)
    assert events[0]["status"] == "hung" and events[0]["job_status"] == "RUNNING"
    assert events[0]["message"].startswith("hang: no training step for ") and "last step 2" in events[0]["message"]
    assert events[0]["progress"]["step"] == 2
    # The event carries the watchdog's fields; the decision reads them, the message says them.
    hang = Hang.from_dict(json.loads(json.dumps(events[0]["hang"])))
    assert hang is not None and hang.last_step == 2 and hang.limit_s == 0.3 and hang.waited_s > 0.3
    assert events[0]["message"] == hang.message
    d = decide(Observation.from_event(events[0]), budget=RESTARTABLE)
    assert d.action is Action.RESTART and d.stop_job and d.reason == hang.reason


async def test_steps_that_keep_coming_are_no_hang_and_a_startup_window_applies_before_the_first() -> None:
    logs = ["".join(_step(n) for n in range(1, k + 1)) for k in range(1, 40)]
    hook = ScriptedHook(["RUNNING"] * 39 + ["SUCCEEDED"], logs)
    events = await _events(_trigger(total_steps=39, watch={"stall_timeout_s": 5.0}), hook)
    assert events[0]["status"] == "succeeded"
    silent = ScriptedHook(["PENDING"], ["starting the rollout engine\n"])
    events = await _events(_trigger(total_steps=10, watch={"startup_timeout_s": 0.2}), silent)
    assert events[0]["status"] == "hung" and "of the start (watch.startup_timeout" in events[0]["message"]


async def test_no_watchdog_without_watch_settings_or_while_the_log_cannot_be_read() -> None:
    class Unreadable(ScriptedHook):
        def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> Any:
            raise ConnectionError("agent down")

    hook = Unreadable(["RUNNING"] * 30 + ["SUCCEEDED"], [""])
    events = await _events(_trigger(total_steps=10, watch={"startup_timeout_s": 0.01}), hook)
    assert events[0]["status"] == "succeeded"  # never judged hung on a log it could not read
    hook = ScriptedHook(["RUNNING"] * 30 + ["SUCCEEDED"], [""])
    assert (await _events(_trigger(total_steps=10), hook))[0]["status"] == "succeeded"


async def test_on_kill_stops_the_job_and_never_raises() -> None:
    stopped: list[str] = []

    class Stoppable(ScriptedHook):
        def stop(self, job_id: str) -> bool:
            stopped.append(job_id)
            if len(stopped) > 1:
                raise ConnectionError("dashboard gone")
            return True

    trigger = _trigger()
    hook = Stoppable(["RUNNING"], [""])
    trigger._hook = lambda: hook  # type: ignore[method-assign]
    lines = capture(trigger)
    await trigger.on_kill()
    await trigger.on_kill()
    assert stopped == ["job-1", "job-1"]
    assert "Ray job job-1: stopped" in lines and any("Could not stop Ray job job-1" in m for m in lines)
    await trigger.cleanup()  # a triggerer restart: nothing stopped
    assert len(stopped) == 2


async def test_a_restarted_triggerer_continues_from_the_saved_cursor_not_the_deferral_kwargs(tmp_path: Path) -> None:
    """A triggerer SIGKILLed mid-wait: the next one runs the trigger again from the kwargs it was
    deferred with (cursor 0); the cursor saved in the run directory says how far the dead one got."""
    kwargs = RayJobTrigger(cluster=CLUSTER, job_id="job-1", poll_interval=0.01, cursor_dir=str(tmp_path)).serialize()[1]
    first = RayJobTrigger(**kwargs)
    lines = capture(first)
    hook = ScriptedHook(["RUNNING", "RUNNING", "FAILED"], ["a\n", "a\nb\n"])
    await _events(first, hook)  # stands in for the run the kill cut short: it got to "b"
    assert forwarded(lines) == ["a", "b"]
    assert WaitCursor.load(tmp_path, "job-1").log_offset_bytes == len(b"a\nb\n")
    again = RayJobTrigger(**kwargs)
    assert again.log_offset_bytes == 0
    lines = capture(again)
    events = await _events(again, ScriptedHook(["RUNNING", "SUCCEEDED"], ["a\nb\nc\n"]))
    assert forwarded(lines) == ["c"] and events[0]["log_offset_bytes"] == len(b"a\nb\nc\n")
    # Another job's cursor in the directory is not adopted.
    other = RayJobTrigger(**{**kwargs, "job_id": "job-2"})
    lines = capture(other)
    await _events(other, ScriptedHook(["SUCCEEDED"], ["x\n"]))
    assert forwarded(lines, "job-2") == ["x"]


def test_waiters_of_one_cluster_share_its_node_summary_read() -> None:
    """One read serves every waiter of a cluster within ``max_age``; another cluster, an older read,
    a failed read or another event loop reads again."""
    import asyncio

    from verl_pipeline.airflow.triggers import SharedClusterReads

    reads: list[str] = []

    def reader(name: str, fail: bool = False) -> Callable[[], Any]:
        async def read() -> list[str]:
            reads.append(name)
            await asyncio.sleep(0.01)  # in flight while the other waiters ask
            if fail:
                raise ConnectionError("dashboard unreachable")
            return [name]
        return read

    async def scenario(shared: SharedClusterReads) -> None:
        a = ("http://a:8265", "")
        got = await asyncio.gather(*(shared.read(a, 3600.0, reader(f"a{i}")) for i in range(50)))
        assert reads == ["a0"] and {tuple(n) for _, n in got} == {("a0",)}
        assert (await shared.read(a, 3600.0, reader("a-later")))[1] == ["a0"]  # finished, still fresh
        assert (await shared.read(("http://b:8265", ""), 3600.0, reader("b")))[1] == ["b"]
        await asyncio.sleep(0.05)
        assert (await shared.read(a, 0.02, reader("a-old")))[1] == ["a-old"]  # older than max_age
        c = ("http://c:8265", "")
        with pytest.raises(ConnectionError):
            await shared.read(c, 3600.0, reader("c-fails", fail=True))
        assert (await shared.read(c, 3600.0, reader("c-again")))[1] == ["c-again"]  # a failure is not shared
        assert reads == ["a0", "b", "a-old", "c-fails", "c-again"]

    shared = SharedClusterReads()
    asyncio.run(scenario(shared))
    reads.clear()

    async def other_loop() -> list[str]:
        return (await shared.read(("http://a:8265", ""), 3600.0, reader("a-new-loop")))[1]

    assert asyncio.run(other_loop()) == ["a-new-loop"] and reads == ["a-new-loop"]


class JobListHook:
    """A cluster's Jobs API for several waiters: Ray's job list and single-job reads, counted. Every job
    runs until the API has been read ``running_for`` times (lists and single reads), then has
    succeeded; ``extra`` more (finished) jobs stand in the list, as a cluster's history does."""

    def __init__(self, jobs: list[str], *, running_for: int = 4, extra: int = 0, list_fails: bool = False) -> None:
        self.jobs, self.running_for, self.extra, self.list_fails = jobs, running_for, extra, list_fails
        self.list_calls = 0
        self.get_calls: list[str] = []

    async def __aenter__(self) -> JobListHook:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None

    def _state(self) -> str:
        return "RUNNING" if self.list_calls + len(self.get_calls) < self.running_for else "SUCCEEDED"

    async def ajob_details(self) -> dict[str, dict[str, Any]]:
        import asyncio

        self.list_calls += 1
        await asyncio.sleep(0.001)  # in flight while other waiters ask
        if self.list_fails:
            raise ConnectionError("dashboard unreachable")
        state = self._state()
        jobs = {j: {"submission_id": j, "status": state, "message": f"job is {state}", "driver_exit_code": 0}
                for j in self.jobs}
        jobs.update({f"old-{k}": {"submission_id": f"old-{k}", "status": "SUCCEEDED"} for k in range(self.extra)})
        return jobs

    async def aget_job(self, job_id: str) -> JobInfo | None:
        self.get_calls.append(job_id)
        if job_id not in self.jobs:
            return None
        state = self._state()
        return JobInfo(submission_id=job_id, status=JobState(state), message=f"job is {state}", driver_exit_code=0)


async def _waiters(hook: JobListHook, job_ids: list[str], poll: float = 0.01) -> list[list[dict[str, Any]]]:
    import asyncio

    triggers = [RayJobTrigger(cluster=CLUSTER, job_id=j, poll_interval=poll, forward_logs=False) for j in job_ids]
    return list(await asyncio.gather(*(_events(t, hook) for t in triggers)))  # type: ignore[arg-type]


async def test_waiters_of_one_cluster_share_its_job_list() -> None:
    """Ten waiters of one cluster read their jobs' statuses from one list per half poll, not a request
    each per poll; each still sees its own job end."""
    jobs = [f"job-{i}" for i in range(10)]
    hook = JobListHook(jobs, running_for=6)
    # Polls 0.2 s apart (a list serves for 0.1 s): a busy machine's scheduling delays stay well inside.
    events = await _waiters(hook, jobs, poll=0.2)
    assert [e[-1]["status"] for e in events] == ["succeeded"] * 10
    assert [e[-1]["job_id"] for e in events] == jobs
    # At least 5 lists read means each waiter polled about 5 times; one list served them all, bar the
    # first waiter's first poll (before the others joined) and a last one left alone.
    assert len(hook.get_calls) <= 2 and hook.list_calls >= 5, (hook.list_calls, hook.get_calls)
    assert hook.list_calls + len(hook.get_calls) < len(jobs)


async def test_a_job_missing_from_the_list_or_a_failed_list_is_read_alone() -> None:
    hook = JobListHook(["job-1"], running_for=3)
    events = await _waiters(hook, ["job-1", "job-gone"])
    assert events[0][-1]["status"] == "succeeded"
    assert events[1][-1]["status"] == "unreachable" and "does not exist" in events[1][-1]["message"]
    assert "job-gone" in hook.get_calls
    failing = JobListHook(["job-1", "job-2"], list_fails=True)
    events = await _waiters(failing, ["job-1", "job-2"])
    assert [e[-1]["status"] for e in events] == ["succeeded", "succeeded"]
    assert set(failing.get_calls) == {"job-1", "job-2"}


async def test_a_cluster_whose_job_list_is_long_is_not_read_by_list_again() -> None:
    """A long-lived cluster's list holds every job it ran: past 8 per waiter, each waiter reads its own
    until enough waiters joined."""
    from verl_pipeline.airflow.triggers import JOB_LIST_MAX_PER_WAITER

    hook = JobListHook(["job-1", "job-2"], running_for=6, extra=2 * JOB_LIST_MAX_PER_WAITER)
    events = await _waiters(hook, ["job-1", "job-2"])
    assert [e[-1]["status"] for e in events] == ["succeeded", "succeeded"]
    assert hook.list_calls == 1 and set(hook.get_calls) == {"job-1", "job-2"}
    # Once enough waiters joined for the length last read, they share the list again.
    more = JobListHook(["job-1", "job-2", "job-3"], running_for=8, extra=2 * JOB_LIST_MAX_PER_WAITER)
    events = await _waiters(more, ["job-1", "job-2", "job-3"])
    assert [e[-1]["status"] for e in events] == ["succeeded"] * 3
    assert more.list_calls >= 1, more.get_calls  # (with 2 of them left, 19 jobs are too many again: reads alone)


def test_a_wait_that_starts_with_its_job_polls_sooner_at_first() -> None:
    """0.5, 1, 2, 4 s, then the interval: a 6 s preflight job is seen to end ~1 s after, not ~4 s."""
    from verl_pipeline.airflow.triggers import poll_pause

    assert [poll_pause(n, 5.0, fresh=True) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert poll_pause(10_000, 60.0, fresh=True) == 60.0
    # A wait picked up again (a restarted triggerer, a re-deferral) polls at the interval from the start.
    assert [poll_pause(n, 5.0, fresh=False) for n in range(1, 4)] == [5.0, 5.0, 5.0]
    assert RayJobTrigger(cluster=CLUSTER, job_id="j")._fresh
    assert not RayJobTrigger(cluster=CLUSTER, job_id="j", log_offset_bytes=10)._fresh


async def test_the_start_is_timed_phase_by_phase_up_to_the_first_step(tmp_path: Path) -> None:
    """verl's and vLLM's start-up lines (as the stand-in trainer prints them) end the phases as they
    arrive; the task log says each and, at the first step, all of them; the attempt's record has them."""
    from tests.fakes.fake_verl_trainer import startup_lines
    from verl_pipeline.jobs.startup.markers import PHASES
    from verl_pipeline.jobs.startup.phases import StartupPhases

    class Started(ScriptedHook):
        async def aget_job(self, job_id: str) -> JobInfo | None:
            info = await super().aget_job(job_id)
            return info and replace(info, start_time=int(1000 * (printed - 60)))  # submitted a minute before

    printed = time.time()  # the stand-in stamps its lines now (to the second), however late the polls come
    start = [line + "\n" for line in startup_lines("Training from scratch", validate=True)]
    early, ready = "".join(start[:2]), "".join(start)
    metrics = tmp_path / "metrics-a1.jsonl"
    hook = Started(["RUNNING"] * 4 + ["SUCCEEDED"], [early, early, ready, ready, ready + _step(1)])
    trigger = _trigger(total_steps=4, metrics_path=str(metrics), progress_interval=0)
    lines = capture(trigger)
    await _events(trigger, hook)
    said = [m.split(" start-up: ")[1] for m in lines if " start-up: " in m]
    assert [s.split(" done")[0] for s in said[:-1]] == [p.words for p in PHASES[:-1]]
    # The stand-in stamps its lines when it prints them (to the second), a minute after the submission; the
    # phases whose lines carry a stamp end then, not at the later poll that brought them.
    ends = [int(re.search(r" done (\d+) s after submission", s)[1]) for s in said[:-1]]  # type: ignore[index]
    assert 59 <= ends[0] <= 61 and ends[:5] == [ends[0]] * 5
    # The first step has no stamp: it ends when its poll came, however busy the machine made that.
    assert int(re.match(r"first step (\d+) s after submission", said[-1])[1]) >= ends[0]  # type: ignore[index]
    assert list(StartupPhases.load(metrics).ended) == list(PHASES)
    assert first_step_seen_at(metrics) == StartupPhases.load(metrics).ended[PHASES[-1]]


class ActorRecords(ScriptedHook):
    """A job Ray knows by id ``02000000``, submitted ``SUBMITTED`` (epoch ms), whose state API holds
    ``tasks`` and ``workers`` (or fails with ``error``); each read is kept with its ``alive_only``."""

    def __init__(self, *args: Any, tasks: list[dict[str, Any]], workers: list[dict[str, Any]],
                 error: Exception | None = None, earlier: list[list[dict[str, Any]]] | None = None, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.tasks, self.workers, self.error = tasks, workers, error
        #: What the first reads see of the tasks, one list a read, before ``tasks`` (Ray sends its records late).
        self.earlier = list(earlier or [])
        self.actor_reads: list[bool] = []

    async def aget_job(self, job_id: str) -> JobInfo | None:
        from tests.jobs.startup.test_actors import SUBMITTED

        info = await super().aget_job(job_id)
        return info and replace(info, ray_job_id="02000000", start_time=int(SUBMITTED))

    async def aactor_starts(self, ray_job_id: str, *, alive_only: bool) -> tuple[list[Any], list[Any]]:
        assert ray_job_id == "02000000"
        self.actor_reads.append(alive_only)
        if self.error is not None:
            raise self.error
        return (self.earlier.pop(0) if self.earlier else self.tasks), self.workers


async def test_at_the_first_step_the_waiter_reads_once_how_each_actor_started_says_it_and_records_it(
        tmp_path: Path) -> None:
    from tests.jobs.startup.test_actors import SUBMITTED, _task, _worker
    from verl_pipeline.jobs.startup import actors
    from verl_pipeline.jobs.startup.markers import Phase
    from verl_pipeline.jobs.startup.phases import StartupPhases
    from verl_pipeline.rundir import actor_starts_file

    tasks = [_task("WorkerDict", f"w{i}", asked=57, running=60, loaded=85 + i, finished=90 + i) for i in range(2)]
    workers = [_worker(f"w{i}", launch=57.5, ready=59.5) for i in range(2)]
    metrics = tmp_path / "metrics-a1.jsonl"
    hook = ActorRecords(["RUNNING"] * 5 + ["SUCCEEDED"], ["", "", _step(1), _step(1), _step(1) + _step(2)],
                        tasks=tasks, workers=workers)
    trigger = _trigger(total_steps=2, metrics_path=str(metrics), progress_interval=0)
    lines = capture(trigger)
    await _events(trigger, hook)
    assert hook.actor_reads == [True]  # once, while the job ran: its actors' workers were alive
    assert [m for m in lines if "by actor" in m] == [
        "Ray job job-1 start-up by actor: WorkerDict x 2: asked 57 s after submission, ready at 91 s (waiting 1 s · "
        "process 2 s · class load 26 s · __init__ 5 s)"]
    assert actors.load(actor_starts_file(metrics)) == actors.from_ray(tasks, workers, SUBMITTED)
    # Written in the same trip as the start's phases, each to its own file.
    assert list(StartupPhases.load(metrics).ended) == [Phase.FIRST_STEP]


async def test_a_job_that_ends_before_its_first_step_is_read_at_its_end_and_a_failed_read_is_said_once(
        tmp_path: Path) -> None:
    from tests.jobs.startup.test_actors import _task
    from verl_pipeline.rundir import actor_starts_file

    tasks = [_task("TaskRunner", "w0", asked=24, running=26, loaded=50, finished=50.1)]
    hook = ActorRecords(["RUNNING", "RUNNING", "FAILED"], ["", "", "Traceback\n"], tasks=tasks, workers=[])
    metrics = tmp_path / "metrics-a1.jsonl"
    trigger = _trigger(total_steps=2, metrics_path=str(metrics))
    lines = capture(trigger)
    await _events(trigger, hook)
    assert hook.actor_reads == [False]  # the job had ended: its workers are among the dead ones
    assert [m for m in lines if "by actor" in m] == [
        "Ray job job-1 start-up by actor: TaskRunner x 1: asked 24 s after submission, ready at 50 s (waiting unknown "
        "· process unknown · class load 24 s · __init__ 0 s)"]
    assert actor_starts_file(metrics).is_file()

    failing = ActorRecords(["RUNNING"] * 5 + ["SUCCEEDED"], ["", "", _step(1), _step(1), _step(1) + _step(2)],
                           tasks=[], workers=[], error=ClusterError("GET /api/v0/tasks failed (500)"))
    metrics = tmp_path / "metrics-a2.jsonl"
    trigger = _trigger(total_steps=2, metrics_path=str(metrics))
    lines = capture(trigger)
    events = await _events(trigger, failing)
    assert events[0]["status"] == "succeeded" and failing.actor_reads == [True]  # said, never retried
    assert [m for m in lines if "how its actors started" in m] == [
        "Ray job job-1: no record of how its actors started (Ray's state API: GET /api/v0/tasks failed (500))"]
    assert not actor_starts_file(metrics).exists()


async def test_a_job_whose_driver_never_started_is_not_read() -> None:
    hook = ScriptedHook(["PENDING", "FAILED"], [""])  # Ray gave no job id: no driver, no actors
    hook.aactor_starts = None  # type: ignore[attr-defined]  # a read would fail the test
    trigger = _trigger(total_steps=2, metrics_path=None)
    lines = capture(trigger)
    events = await _events(trigger, hook)
    assert events[0]["status"] == "failed"
    assert "Ray job job-1: no record of how its actors started (its driver never started)" in lines


async def test_records_not_yet_whole_at_the_first_step_are_read_again_the_next_polls_for_a_while_at_most(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray sends an actor's record about once a second: one made just before the first step is read
    without its start or its end, and the next poll reads it whole; records that stay part-whole are kept
    as they are once the window after the first read closed (here 1 s, at 0.01 s polls)."""
    from tests.jobs.startup.test_actors import SUBMITTED, _task, _worker
    from verl_pipeline.jobs.startup import actors, phases
    from verl_pipeline.rundir import actor_starts_file

    monkeypatch.setattr(phases, "ACTOR_READ_WINDOW_S", 1.0)

    whole = [_task("WorkerDict", "w0", asked=57, running=60, loaded=85, finished=90),
             _task("TrackingRunner", "w1", asked=91, running=92, loaded=92.5, finished=92.6)]
    late = [whole[0], _task("TrackingRunner", "w1", asked=91, running=None, loaded=None, finished=None)]
    workers = [_worker("w0", launch=57.5, ready=59.5), _worker("w1", launch=91.2, ready=91.9)]
    log = ["", "", _step(1), _step(1), _step(1)]
    for attempt, earlier in ((1, [late]), (2, [late] * 10_000)):
        metrics = tmp_path / f"metrics-a{attempt}.jsonl"
        # The job runs on past the window (200 polls of at least 0.01 s) and succeeds.
        polls = [*(["RUNNING"] * 4), *(["RUNNING"] * 200 if attempt == 2 else []), "SUCCEEDED"]
        hook = ActorRecords(polls, log, tasks=whole, workers=workers, earlier=earlier)
        trigger = _trigger(total_steps=2, metrics_path=str(metrics))
        lines = capture(trigger)
        await _events(trigger, hook)
        kept = actors.load(actor_starts_file(metrics))
        if attempt == 1:  # whole at the second read
            assert hook.actor_reads == [True, True]
            assert kept == actors.from_ray(whole, workers, SUBMITTED)
        else:  # never whole: read again on the polls of the window (however slow they are), then kept as it was
            assert 2 <= len(hook.actor_reads) < 200 and all(hook.actor_reads)
            assert kept == actors.from_ray(late, workers, SUBMITTED)
        assert len([m for m in lines if "by actor: TrackingRunner" in m]) == 1  # said once, when kept
