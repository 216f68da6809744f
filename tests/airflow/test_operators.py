from __future__ import annotations

import time
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from verl_pipeline.airflow.operators import (
    ProvisionRayClusterOperator,
    WaitForVerlJobOperator,
)
from verl_pipeline.airflow.triggers import RayJobTrigger
from verl_pipeline.cluster.base import ClusterHandle


class FakeTI:
    """Only what the operators use of a task instance: XCom by task id."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[f"pushed:{key}"] = value


class FakeDag:
    dag_id = "verl_ppo"


def _context(xcoms: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"ti": FakeTI(xcoms), "params": params or {}, "run_id": "manual__test", "dag": FakeDag()}


@pytest.mark.integration
def test_wait_defers_on_a_running_job_and_completes_from_the_event(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    job_id = f"op-defer-{int(time.time() * 1000)}"
    client.submit(entrypoint="sleep 20", submission_id=job_id, runtime_env={})
    ctx = _context({"provision_ray_cluster": ray_cluster.to_dict(),
                    "submit_verl_job": {"submission_id": job_id, "mode": "train", "run_dir": "/x"}})
    op = WaitForVerlJobOperator(task_id="wait_for_verl_job")
    try:
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(ctx)
        assert isinstance(deferred.value.trigger, RayJobTrigger)
        assert deferred.value.method_name == "execute_complete"
        assert deferred.value.timeout is None  # no cut-off for multi-day runs
        assert deferred.value.trigger.job_id == job_id
        assert ctx["ti"].xcoms["pushed:_link_RayJobLink"].endswith(f"/#/jobs/{job_id}")
        # Completion reads everything from the event (instance state is gone after deferral).
        fresh = WaitForVerlJobOperator(task_id="wait_for_verl_job")
        out = fresh.execute_complete(ctx, {"status": "success", "job_id": job_id, "job_status": "SUCCEEDED"})
        assert out["job_id"] == job_id and out["status"] == "SUCCEEDED"
        with pytest.raises(AirflowException, match="ended FAILED: boom"):
            fresh.execute_complete(ctx, {"status": "failed", "job_id": job_id, "job_status": "FAILED",
                                         "message": "boom"})
    finally:
        client.stop(job_id)


@pytest.mark.integration
def test_on_kill_stops_the_ray_job(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    job_id = f"op-kill-{int(time.time() * 1000)}"
    client.submit(entrypoint="sleep 60", submission_id=job_id, runtime_env={})
    ctx = _context({"provision_ray_cluster": ray_cluster.to_dict(), "submit_verl_job": {"submission_id": job_id}})
    op = WaitForVerlJobOperator(task_id="wait_for_verl_job")
    with pytest.raises(TaskDeferred):
        op.execute(ctx)
    op.on_kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        info = client.get_job(job_id)
        if info is not None and info.status.is_terminal():
            break
        time.sleep(0.5)
    assert info is not None and info.status.value == "STOPPED"


def test_wait_without_a_submitted_job_fails_clearly() -> None:
    with pytest.raises(AirflowException, match="no submitted job"):
        WaitForVerlJobOperator(task_id="w").execute(_context({}))


def test_provision_rejects_bad_params_without_retry_and_without_starting_anything() -> None:
    op = ProvisionRayClusterOperator(task_id="provision_ray_cluster")
    with pytest.raises(AirflowFailException, match=r"n_gpus_per_node"):
        op.execute(_context({}, {"n_gpus_per_node": 17}))
    with pytest.raises(AirflowFailException, match="no such profile"):
        op.execute(_context({}, {"profile": "missing"}))
