"""submit-or-reattach against a real local Ray cluster."""

from __future__ import annotations

import time

import pytest

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.constants import Mode
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.jobs.submit import preflight_summary, submit_or_reattach
from verl_pipeline.trainer.render import RenderedJob

pytestmark = pytest.mark.integration


def _job(command: str) -> RenderedJob:
    return RenderedJob(mode=Mode.PREFLIGHT, entrypoint=command, overrides=[], runtime_env={"env_vars": {"X": "1"}},
                       settings={}, derived={})


def _wait(client: RayJobsClient, job_id: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = client.get_job(job_id)
        assert info is not None
        if info.status.is_terminal():
            return info.status.value
        time.sleep(0.5)
    raise AssertionError(f"{job_id} not terminal after {timeout}s")


def test_reattach_then_next_attempt_after_failure(ray_cluster: ClusterHandle, request: pytest.FixtureRequest) -> None:
    client = ray_cluster.client()
    run_id = request.node.name
    first = submit_or_reattach(client, _job("sleep 30"), dag_id="d", run_id=run_id, task_id="t")
    assert (first.action, first.attempt) == ("submitted", 1)
    # A retried submit task finds the live job instead of submitting a second one.
    again = submit_or_reattach(client, _job("sleep 30"), dag_id="d", run_id=run_id, task_id="t")
    assert (again.action, again.submission_id) == ("reattached", first.submission_id)
    assert client.stop(first.submission_id)
    assert _wait(client, first.submission_id) == "STOPPED"
    # The previous attempt is over: the next submission is attempt 2.
    second = submit_or_reattach(client, _job("exit 3"), dag_id="d", run_id=run_id, task_id="t")
    assert (second.action, second.attempt) == ("submitted", 2)
    assert _wait(client, second.submission_id) == "FAILED"
    info = client.get_job(second.submission_id)
    assert info is not None and info.driver_exit_code == 3
    assert info.metadata["run_id"] == run_id and info.metadata["mode"] == "preflight"
    mine = [j for j in client.list_jobs() if j.metadata.get("run_id") == run_id]
    assert len(mine) == 2


def test_succeeded_job_is_not_resubmitted(ray_cluster: ClusterHandle, request: pytest.FixtureRequest) -> None:
    client = ray_cluster.client()
    run_id = request.node.name
    first = submit_or_reattach(client, _job("echo done"), dag_id="d", run_id=run_id, task_id="t")
    assert _wait(client, first.submission_id) == "SUCCEEDED"
    again = submit_or_reattach(client, _job("echo done"), dag_id="d", run_id=run_id, task_id="t")
    assert (again.action, again.submission_id) == ("already_succeeded", first.submission_id)
    assert "done" in client.logs(first.submission_id)


def test_preflight_summary_parsing() -> None:
    logs = 'noise\nVERL_PIPELINE_PREFLIGHT_SUMMARY {"ok": true, "checks": {}}\nmore noise\n'
    assert preflight_summary(logs) == {"ok": True, "checks": {}}
    assert preflight_summary("nothing here") is None
