"""A run is frozen at provision: a restart days later resubmits what the run started with, on whatever
cluster it has by then, probed again.

The provision, submit and wait operators run for real against real local Ray heads: attempt 1 is
submitted, the pipeline stops it (as after a lost node) and its cluster goes away; someone edits the
run profile under ``configs/`` for the next experiment; the wait task's restart re-provisions a
cluster, probes it and submits attempt 2 — the same job.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from airflow.sdk.exceptions import TaskDeferred

from tests.airflow.context import task_context
from tests.trainer.test_cluster_checks import _inputs
from verl_pipeline import steps
from verl_pipeline.airflow.operators import ProvisionRayClusterOperator, SubmitVerlJobOperator, WaitForVerlJobOperator
from verl_pipeline.airflow.task_ids import PROVISION_TASK, SUBMIT_TASK, WAIT_TASK
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.registry import get_backend
from verl_pipeline.jobs.client import wait_job_ended
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir

pytestmark = pytest.mark.integration


def test_a_restart_resubmits_the_frozen_run_on_a_reprovisioned_cluster_it_probed_again(
    own_configs: Path, tiny_model_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    ctx = task_context({}, {"profile": "smoke"})
    ctx["ti"].task_id = PROVISION_TASK  # its pushes (the run directory) are read back by task id
    first = ClusterHandle.from_dict(
        ProvisionRayClusterOperator(task_id=PROVISION_TASK, validate_with_verl=False).execute(ctx))
    ctx["ti"].task_id = None
    handles = [first]
    try:
        spec = build_run_spec({"profile": "smoke"}, run_name=f"verl_ppo/{ctx['run_id']}")
        run_dir = RunDir(spec.run_dir)
        data, models = _inputs(spec, tiny_model_path)
        ctx["ti"].xcoms.update({PROVISION_TASK: first.to_dict(), "preprocess_data": data, "prefetch_model": models})
        sub = SubmitVerlJobOperator(task_id=SUBMIT_TASK).execute(ctx)
        ctx["ti"].xcoms[SUBMIT_TASK] = sub
        job_1, probe_1 = run_dir.job(), sub["environment"]["probe_job_id"]
        assert job_1 is not None and "trainer.total_training_steps=2" in job_1["overrides"]

        # The pipeline stops attempt 1 (as after a lost node) and the cluster goes away with it ...
        client_1 = first.client()
        run_dir.record_stop(sub["submission_id"], "node died")
        client_1.stop(sub["submission_id"])
        assert wait_job_ended(client_1, sub["submission_id"], 60)
        get_backend({"backend": first.backend}).teardown(first)
        # ... while someone edits the run profile for their next experiment.
        profile = own_configs / "profiles" / "smoke.yaml"
        edited = yaml.safe_load(profile.read_text())
        edited["trainer"]["total_training_steps"] = 7
        profile.write_text(yaml.safe_dump(edited))
        assert build_run_spec({"profile": "smoke"}, run_name="x/y").total_training_steps == 7

        # The wait task restarts the run: after the restart's delay (a timer) the cluster is gone, so it
        # provisions one, probes it and resubmits.
        caplog.clear()
        ctx["ti"].try_number = 2
        with pytest.raises(TaskDeferred) as timer:
            WaitForVerlJobOperator(task_id=WAIT_TASK).execute(ctx)
        assert timer.value.method_name == "restart_after_delay"
        with pytest.raises(TaskDeferred):
            WaitForVerlJobOperator(task_id=WAIT_TASK).restart_after_delay(ctx, None, **(timer.value.kwargs or {}))
        second = steps.find_handle(spec)
        assert second is not None and second.dashboard_url != first.dashboard_url
        handles.append(second)
        attempts = run_dir.attempts()
        assert [a.attempt for a in attempts] == [1, 2] and attempts[1].dashboard_url == second.dashboard_url

        # The same job as attempt 1 (the edited profile is not read) ...
        job_2 = run_dir.job()
        assert job_2 is not None
        assert (job_2["entrypoint"], job_2["overrides"]) == (job_1["entrypoint"], job_1["overrides"])
        client_2 = second.client()
        info = client_2.get_job(attempts[1].submission_id)
        assert info is not None and info.entrypoint == job_1["entrypoint"]
        assert any("frozen spec" in r.getMessage() and str(run_dir.spec_file) in r.getMessage()
                   for r in caplog.records)
        # ... and the cluster it runs on was probed before the submission: a probe job of its own.
        env = json.loads(run_dir.environment_file.read_text())
        assert env["probe_job_id"] != probe_1
        probe_2 = client_2.get_job(env["probe_job_id"])
        assert probe_2 is not None and probe_2.metadata.get("purpose") == "environment-probe"
        assert {n["node_id"] for n in env["nodes"]} == {n.node_id for n in client_2.nodes() if n.alive}
        # Each attempt decided for the nodes it got, and the record keeps both; the retry said whether it
        # decided differently (CPU nodes here: nothing to decide, so the same).
        assert [(d["attempt"], d["submission_id"]) for d in run_dir.decisions()] == [
            (a.attempt, a.submission_id) for a in attempts]
        assert all(d["nodes"]["probed"] and d["nodes"]["source"].startswith("probe job ") for d in run_dir.decisions())
        assert any("the same nodes and decision as attempt 1" in r.getMessage() for r in caplog.records)
    finally:
        for handle in handles:  # their jobs end with them
            get_backend({"backend": handle.backend}).teardown(handle)


def test_a_run_provisioned_by_an_earlier_release_keeps_working_and_is_frozen_when_provisioned_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An upgrade while a run trains: its provision recorded no frozen spec (no XCom ``run_dir``), and the
    run_spec.json that release wrote at submit has no ``sources`` (it was never read back)."""
    from verl_pipeline.airflow.operators.base import spec_from_context
    from verl_pipeline.spec import RunSpec

    caplog.set_level(logging.WARNING)
    ctx = task_context({}, {"profile": "smoke"})
    spec = spec_from_context(ctx)
    assert "recorded no frozen spec (provisioned by an earlier release)" in caplog.text
    run_dir = RunDir(spec.run_dir)
    run_dir.save_spec({k: v for k, v in spec.to_dict().items() if k != "sources"})
    assert steps.frozen_or(spec) is spec  # that copy is not a frozen spec ...
    steps.freeze(spec)  # ... so provisioning again freezes the run over it
    assert "sources" in run_dir.spec_dict() and RunSpec.load(run_dir) == spec
