from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from verl_pipeline.airflow.triggers import CLASSPATH, RayJobTrigger
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.constants import JobState
from verl_pipeline.jobs.client import JobInfo

CLUSTER = ClusterHandle(backend="local", name="n", dashboard_url="http://127.0.0.1:1", owned=True).to_dict()


class ScriptedHook:
    """Replays a sequence of job states / errors, and a growing log, like a real Jobs API would."""

    def __init__(self, states: list[Any], logs: list[str]) -> None:
        self.states = list(states)
        self.log_seq = list(logs)
        self.status_calls = 0

    async def aget_job(self, job_id: str) -> JobInfo | None:
        self.status_calls += 1
        item = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        if isinstance(item, Exception):
            raise item
        if item is None:
            return None
        return JobInfo(submission_id=job_id, status=JobState(item), message=f"job is {item}", driver_exit_code=0)

    async def alogs(self, job_id: str) -> str:
        return self.log_seq.pop(0) if len(self.log_seq) > 1 else self.log_seq[0]


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def capture(trigger: RayJobTrigger) -> list[str]:
    """The messages the trigger logs (what Airflow shows in the task log)."""
    logger = logging.getLogger(f"test.trigger.{id(trigger)}")
    logger.setLevel(logging.INFO)
    handler = Lines()
    logger.addHandler(handler)
    trigger._log = logger
    return handler.lines


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
    assert ev["status"] == "success" and ev["job_status"] == "SUCCEEDED" and ev["job_id"] == "job-1"
    assert ev["log_offset"] == len("line 1\npartial line\nlast\n")
    forwarded = [line for line in lines if line.startswith("[job-1]")]
    assert forwarded == ["[job-1] line 1", "[job-1] partial line", "[job-1] last"]


@pytest.mark.parametrize(("final", "status"), [("FAILED", "failed"), ("STOPPED", "stopped")])
async def test_terminal_failures_become_events(final: str, status: str) -> None:
    events = await _events(_trigger(), ScriptedHook(["RUNNING", final], ["x\n"]))
    assert [e["status"] for e in events] == [status]
    assert events[0]["message"] == f"job is {final}"


async def test_missing_job_is_an_error_event() -> None:
    events = await _events(_trigger(), ScriptedHook([None], [""]))
    assert events[0]["status"] == "error" and "does not exist" in events[0]["message"]


async def test_transient_errors_are_retried_then_reported() -> None:
    hook = ScriptedHook([ConnectionError("boom"), ConnectionError("boom"), "SUCCEEDED"], [""])
    events = await _events(_trigger(max_poll_errors=3), hook)
    assert events[0]["status"] == "success"
    hook = ScriptedHook([ConnectionError("down")], [""])
    events = await _events(_trigger(max_poll_errors=3), hook)
    assert events[0]["status"] == "error" and "unreachable" in events[0]["message"]
    assert hook.status_calls == 3


async def test_unexpected_exception_never_escapes() -> None:
    class Broken(ScriptedHook):
        async def aget_job(self, job_id: str) -> JobInfo | None:
            raise KeyError("anything")

    events = await _events(_trigger(max_poll_errors=1), Broken(["RUNNING"], [""]))
    assert len(events) == 1 and events[0]["status"] == "error"


async def test_resumed_trigger_does_not_repeat_logs() -> None:
    logs = "old 1\nold 2\nnew\n"
    trigger = _trigger(log_offset=len("old 1\nold 2\n"))
    lines = capture(trigger)
    events = await _events(trigger, ScriptedHook(["SUCCEEDED"], [logs]))
    forwarded = [line for line in lines if line.startswith("[job-1]")]
    assert forwarded == ["[job-1] new"]
    assert events[0]["log_offset"] == len(logs)


def test_serialize_round_trip() -> None:
    t = RayJobTrigger(cluster=CLUSTER, job_id="j", conn_id="ray_default", poll_interval=7.0, log_offset=42)
    path, kwargs = t.serialize()
    assert path == CLASSPATH
    module, _, name = path.rpartition(".")
    cls = getattr(__import__(module, fromlist=[name]), name)
    again = cls(**kwargs)
    assert again.serialize() == (path, kwargs)
    assert kwargs["log_offset"] == 42 and kwargs["poll_interval"] == 7.0


@pytest.mark.integration
async def test_against_a_real_ray_job(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    job_id = f"trigger-real-{int(time.time() * 1000)}"
    client.submit(entrypoint="echo hello-from-ray; sleep 2; echo bye; exit 4", submission_id=job_id,
                  runtime_env={})
    trigger = RayJobTrigger(cluster=ray_cluster.to_dict(), job_id=job_id, poll_interval=0.5)
    lines = capture(trigger)
    events = [e.payload async for e in trigger.run()]
    assert events[0]["status"] == "failed" and events[0]["driver_exit_code"] == 4
    assert "exit code 4" in events[0]["message"]
    forwarded = " ".join(lines)
    assert "hello-from-ray" in forwarded and "bye" in forwarded
    await asyncio.sleep(0)


async def test_a_lost_node_ends_the_wait_even_if_the_job_hangs() -> None:
    class Shrinking(ScriptedHook):
        def __init__(self) -> None:
            super().__init__(["RUNNING"], [""])
            self.alive = [2, 1, 2, 1, 1, 1]

        async def anodes_alive(self) -> int:
            return self.alive.pop(0) if len(self.alive) > 1 else self.alive[0]

    hook = Shrinking()
    events = await _events(_trigger(expected_nodes=2, node_grace_polls=3), hook)
    assert events[0]["status"] == "node_lost"
    assert "1 of 2 nodes alive" in events[0]["message"] and events[0]["job_status"] == "RUNNING"
    # A blip shorter than the grace does not end the wait.
    assert hook.status_calls == 6
