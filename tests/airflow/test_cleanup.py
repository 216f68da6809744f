from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import ray_processes
from verl_pipeline import steps
from verl_pipeline.airflow.operators import cleanup_failed_run
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import Attempt, RunDir

pytestmark = pytest.mark.integration


class _Run:
    dag_id = "verl_ppo"
    run_id = "manual__marked_failed"


class _CallbackTi:
    """The task instance a DAG-level callback gets: outside a task, Airflow 3 cannot read XCom (under
    `airflow dags test` this ImportError, seen on the GPU machine when a run failed)."""

    def xcom_pull(self, **_: object) -> object:
        raise ImportError("cannot import name 'SUPERVISOR_COMMS' from 'airflow.sdk.execution_time.task_runner'")


def test_failure_callback_stops_the_job_and_the_cluster(airflow_db: Path) -> None:
    """A run marked failed (teardown task never ran): the DAG's failure callback leaves nothing running."""
    spec = build_run_spec({}, run_name="verl_ppo/manual__marked_failed")
    handle = steps.provision(spec)
    client = handle.client()
    job_id = f"cleanup-{int(time.time())}"
    client.submit(entrypoint="sleep 120", submission_id=job_id, runtime_env={})
    RunDir(spec.run_dir).record_attempt(Attempt(job_id, 1, 0.0, handle.dashboard_url, 0, None))
    deadline = time.monotonic() + 60
    while client.get_job(job_id).status.value != "RUNNING" and time.monotonic() < deadline:  # type: ignore[union-attr]
        time.sleep(0.5)
    steps.freeze(spec)
    cleanup_failed_run({"dag_run": _Run(), "params": {}, "ti": _CallbackTi()})
    assert ray_processes(handle.extra["temp_dir"]) == []
    assert (spec.run_dir / "cluster.stopped.json").exists()
    cleanup_failed_run({"dag_run": _Run(), "params": {}})  # twice is harmless
