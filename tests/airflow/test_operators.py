from __future__ import annotations

import json
import time
from typing import Any

import pytest
from airflow.providers.standard.triggers.temporal import DateTimeTrigger
from airflow.sdk.exceptions import AirflowException, AirflowFailException, TaskDeferred

from tests.airflow.context import provisioned, task_context
from verl_pipeline.airflow.operators import (
    ProvisionRayClusterOperator,
    WaitForVerlJobOperator,
)
from verl_pipeline.airflow.triggers import RayJobTrigger
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.client import wait_job_ended
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import Attempt, RunDir


def _context(xcoms: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A run of its own (run directories, attempt records are per run), provisioned: its spec frozen."""
    ctx = task_context(xcoms, params)
    provisioned(ctx)
    return ctx


@pytest.mark.integration
def test_wait_defers_on_a_running_job_and_completes_from_the_event(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    job_id = f"op-defer-{int(time.time() * 1000)}"
    client.submit(entrypoint="sleep 120", submission_id=job_id, runtime_env={})
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
        spec = build_run_spec({}, run_name=f"verl_ppo/{ctx['run_id']}")
        metrics = spec.run_dir / "metrics-a1.jsonl"
        RunDir(spec.run_dir).record_attempt(Attempt(job_id, 1, 0.0, ray_cluster.dashboard_url, 0, str(metrics)))
        metrics.write_text("".join(json.dumps({"step": s, "data": {"training/global_step": s}}) + "\n"
                                   for s in range(1, spec.total_training_steps + 1)))
        out = fresh.execute_complete(ctx, {"status": "success", "job_id": job_id, "job_status": "SUCCEEDED"})
        assert out["job_id"] == job_id and out["status"] == "SUCCEEDED"
        assert out["training"]["last_step"] == spec.total_training_steps
        # SUCCEEDED short of total_training_steps is a failure, not a success.
        metrics.write_text(json.dumps({"step": 1, "data": {"training/global_step": 1}}) + "\n")
        with pytest.raises(AirflowFailException, match=r"reached step 1 of trainer\.total_training_steps=2"):
            fresh.execute_complete(ctx, {"status": "success", "job_id": job_id, "job_status": "SUCCEEDED"})
        # The user's failures fail without retry; infrastructure failures restart the run after a delay
        # (the task defers to a timer), within the budget: the attempt made no progress, 1 of 2 left.
        with pytest.raises(AirflowFailException, match=r"ended FAILED \[user failure"):
            fresh.execute_complete(ctx, {"status": "failed", "job_id": job_id, "job_status": "FAILED",
                                         "message": "boom"})
        with pytest.raises(TaskDeferred) as restart:
            fresh.execute_complete(ctx, {"status": "failed", "job_id": job_id, "job_status": "FAILED",
                                         "message": "ray.exceptions.NodeDiedError: the node died"})
        assert isinstance(restart.value.trigger, DateTimeTrigger)
        assert (restart.value.method_name, restart.value.kwargs) == ("restart_after_delay", {"reason": "node died"})
        row = ctx["ti"].xcoms["pushed:restart_budget"]
        assert (row["attempt"], row["outcome"], row["no_progress"], row["left"], row["delay_s"]) == \
            (1, "restart", 1, 1, 40.0)
        assert RunDir(spec.run_dir).restart_records()[-1] == row
        # A hang: the job is stopped, the stop noted as the pipeline's, and the run restarted ...
        hang = "hang: no training step for 42m, last step 1"
        with pytest.raises(TaskDeferred) as restart:
            fresh.execute_complete(ctx, {"status": "hung", "job_id": job_id, "job_status": "RUNNING",
                                         "message": f"{hang} (stall limit 30m)",
                                         "hang": {"last_step": 1, "waited_s": 42 * 60.0, "limit_s": 30 * 60.0}})
        assert restart.value.kwargs == {"reason": hang}
        assert RunDir(spec.run_dir).stop_reason(job_id) == hang
        assert wait_job_ended(client, job_id, 60)
        # ... once its delay is over, the next attempt is submitted (here without the upstream results it
        # needs); a try that starts meanwhile (a lost worker) looks at the STOPPED job and decides the same.
        with pytest.raises(AirflowException, match="cannot submit: data or model results"):
            WaitForVerlJobOperator(task_id="wait_for_verl_job").restart_after_delay(ctx, None, reason=hang)
        ctx["ti"].try_number = 2
        with pytest.raises(TaskDeferred) as restart:
            WaitForVerlJobOperator(task_id="wait_for_verl_job").execute(ctx)
        assert restart.value.method_name == "restart_after_delay"
    finally:
        client.stop(job_id)


@pytest.mark.integration
def test_the_log_cursor_and_progress_travel_through_a_retry_that_reattaches(ray_cluster: ClusterHandle) -> None:
    client = ray_cluster.client()
    job_id = f"op-cursor-{int(time.time() * 1000)}"
    client.submit(entrypoint="sleep 30", submission_id=job_id, runtime_env={})
    ctx = _context({"provision_ray_cluster": ray_cluster.to_dict(),
                    "submit_verl_job": {"submission_id": job_id, "mode": "train", "run_dir": "/x"}})
    spec = build_run_spec({}, run_name=f"verl_ppo/{ctx['run_id']}")
    metrics = spec.run_dir / "metrics-a1.jsonl"
    RunDir(spec.run_dir).record_attempt(Attempt(job_id, 1, 0.0, ray_cluster.dashboard_url, 0, str(metrics)))
    op = WaitForVerlJobOperator(task_id="wait_for_verl_job", progress_interval=5.0)
    try:
        with pytest.raises(TaskDeferred) as deferred:
            op.execute(ctx)
        first = deferred.value.trigger
        assert isinstance(first, RayJobTrigger)
        assert first.log_offset_bytes == 0 and first.request.metrics_path == str(metrics)
        assert first.request.total_steps == spec.total_training_steps and first.request.progress_interval == 5.0
        progress = {"step": 1, "total": 2, "seconds_per_step": 3.0, "metrics": {}, "line": "step 1/2 (50%)"}
        # The waiter gave up (API unreachable): the run is to restart after a delay ...
        with pytest.raises(TaskDeferred) as restart:
            op.execute_complete(ctx, {"status": "error", "job_id": job_id, "message": "Ray Jobs API unreachable",
                                      "log_offset_bytes": 4321, "metrics_offset_bytes": 99, "progress": progress})
        assert restart.value.method_name == "restart_after_delay"
        assert ctx["ti"].xcoms["pushed:progress"] == progress
        # ... and when the delay is over, the job is alive after all: reattached from where the last waiter stopped.
        with pytest.raises(TaskDeferred) as deferred:
            WaitForVerlJobOperator(task_id="wait_for_verl_job").restart_after_delay(ctx, None, reason="unreachable")
        again = deferred.value.trigger
        assert isinstance(again, RayJobTrigger)
        assert (again.log_offset_bytes, again.metrics_offset_bytes, again.progress) == (4321, 99, progress)
        assert again.serialize()[1]["log_offset_bytes"] == 4321
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


def test_the_wait_operators_poll_defaults_are_the_wait_requests() -> None:
    import inspect

    from verl_pipeline.jobs.wait_request import WaitRequest

    params = inspect.signature(WaitForVerlJobOperator.__init__).parameters
    shared = [name for name in params if name in WaitRequest.__dataclass_fields__]
    assert shared == ["poll_interval", "max_poll_errors", "progress_interval", "max_lines_per_poll"]
    for name in shared:
        assert params[name].default == WaitRequest.__dataclass_fields__[name].default, name
    op = WaitForVerlJobOperator(task_id="w")
    assert op.poll_interval == WaitRequest(cluster={}, job_id="j").poll_interval


def test_wait_without_a_submitted_job_fails_clearly() -> None:
    with pytest.raises(AirflowException, match="no submitted job"):
        WaitForVerlJobOperator(task_id="w").execute(_context({}))


def test_provision_rejects_bad_params_without_retry_and_without_starting_anything() -> None:
    op = ProvisionRayClusterOperator(task_id="provision_ray_cluster")
    with pytest.raises(AirflowFailException, match=r"n_gpus_per_node"):
        op.execute(task_context({}, {"n_gpus_per_node": 17}))
    with pytest.raises(AirflowFailException, match="no such profile"):
        op.execute(task_context({}, {"profile": "missing"}))
