"""PublishRunOperator: records every run's manifest; only a succeeded job (whose trained model was
exported) moves ``latest``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowFailException

from tests.airflow.context import FakeDag, FakeTI, provisioned
from verl_pipeline import runs
from verl_pipeline.airflow.retrain import PublishRunOperator, promotion_blocker
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir


def _ctx(run_id: str, waited: dict[str, Any] | None, mode: str = "preflight",
         exported: dict[str, Any] | None = None) -> dict[str, Any]:
    xcoms = {
        "preprocess_data": {"key": f"data-{run_id}", "train_path": "/d/t.parquet", "val_path": "/d/v.parquet"},
        "prefetch_model": {"actor": {"source": "builtin:tiny-qwen2", "revision": None, "path": "/m/tiny"}},
        "submit_verl_job": {"submission_id": f"job-{run_id}", "mode": mode},
        "wait_for_verl_job": waited,
        "export_model": exported,
    }
    ctx = {"ti": FakeTI(xcoms), "params": {"profile": "smoke"}, "run_id": run_id, "dag": FakeDag("verl_retrain__smoke")}
    provisioned(ctx)
    return ctx


def _storage() -> Path:
    return Path(os.environ["VERL_PIPELINE_HOME"]).resolve()


def test_success_promotes_failure_records_and_keeps_latest() -> None:
    op = PublishRunOperator(task_id="publish_run")
    first = op.execute(_ctx("scheduled__pub-1", {"status": "SUCCEEDED", "job_id": "job-1"}))
    spec1 = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-1")
    assert first["run_dir"] == str(spec1.run_dir)
    assert first["manifest"]["data_hash"] == "data-scheduled__pub-1" and first["manifest"]["status"] == "succeeded"
    assert runs.latest_run(_storage(), "smoke") == spec1.run_dir.resolve()

    # The job failed (wait pushed nothing): a failed manifest, the task fails, latest stays put.
    with pytest.raises(AirflowFailException, match="its job did not succeed"):
        op.execute(_ctx("scheduled__pub-2", None))
    spec2 = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-2")
    assert runs.read_manifest(spec2.run_dir).status is runs.RunStatus.FAILED
    assert runs.latest_run(_storage(), "smoke") == spec1.run_dir.resolve()

    third = op.execute(_ctx("scheduled__pub-3", {"status": "SUCCEEDED", "job_id": "job-3"}))
    assert third["previous"] == str(spec1.run_dir.resolve())
    assert RunDir(spec1.run_dir).manifest_file.is_file()  # the previous good run is still there


def test_a_trained_run_moves_latest_only_once_its_model_was_exported() -> None:
    op = PublishRunOperator(task_id="publish_run")
    before = runs.latest_run(_storage(), "smoke")
    # The job trained and succeeded, but export_model failed (it pushed nothing): latest stays.
    with pytest.raises(AirflowFailException, match=r"not exported and verified .task export_model"):
        op.execute(_ctx("scheduled__pub-noexport", {"status": "SUCCEEDED"}, mode="train"))
    spec = build_run_spec({"profile": "smoke"}, run_name="verl_retrain__smoke/scheduled__pub-noexport")
    assert runs.read_manifest(spec.run_dir).status is runs.RunStatus.FAILED
    assert runs.latest_run(_storage(), "smoke") == before
    done = op.execute(_ctx("scheduled__pub-exported", {"status": "SUCCEEDED"}, mode="train",
                           exported={"model_dir": "/runs/x/model", "step": 2}))
    assert runs.latest_run(_storage(), "smoke") == Path(done["run_dir"]).resolve()



def test_promotion_waits_for_the_export_only_when_there_was_one_to_make() -> None:
    assert promotion_blocker(None, None, None) == "its job did not succeed"
    ok = {"status": "SUCCEEDED"}
    assert "not exported" in str(promotion_blocker(ok, None, None))
    assert promotion_blocker(ok, {"model_dir": "/r/model"}, None) is None
    assert promotion_blocker(ok, None, "the run profile says export: false") is None


def test_invalid_spec_is_not_published() -> None:
    op = PublishRunOperator(task_id="publish_run")
    ctx = {"ti": FakeTI({}), "params": {"profile": "smoke", "data_source": "builtin:nope"},
           "run_id": "scheduled__pub-bad", "dag": FakeDag("verl_retrain__smoke")}  # provision refused it
    with pytest.raises(AirflowFailException, match="has no frozen spec"):
        op.execute(ctx)
