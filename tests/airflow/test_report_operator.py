"""The report task: its outcome from the wait's result, its XCom, and a run that never had a spec."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException

from tests.airflow.context import provisioned, task_context
from verl_pipeline.airflow.operators import ReportRunOperator
from verl_pipeline.airflow.task_ids import REPORT_TASK
from verl_pipeline.rundir import Attempt, RunDir


def _two_steps(ctx: dict[str, Any]) -> Path:
    spec = provisioned(ctx)
    RunDir(spec.run_dir).record_attempt(Attempt("job-a1", 1, time.time(), "http://d", 0, str(spec.metrics_path(1))))
    rows = [{"step": s, "data": {"training/global_step": s, "critic/score/mean": 0.1 * s}} for s in (1, 2)]
    RunDir(spec.run_dir).metrics_file(1).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spec.run_dir


@pytest.mark.parametrize(("waited", "status"), [
    (None, "failed"),  # the wait failed: it returned nothing
    ({"status": "SUCCEEDED", "job_id": "job-a1"}, "succeeded"),
])
def test_the_report_says_how_the_wait_ended_and_where_it_is(waited: dict[str, Any] | None, status: str) -> None:
    ctx = task_context({"wait_for_verl_job": waited})
    run_dir = _two_steps(ctx)
    out = ReportRunOperator(task_id=REPORT_TASK).execute(ctx)
    assert out["report_dir"] == str(run_dir / "report") and out["html"] == str(run_dir / "report" / "report.html")
    assert out["status"] == status and out["steps_done"] == 2
    assert json.loads((run_dir / "report" / "report.json").read_text())["status"] == status
    assert Path(out["html"]).is_file() and out["plots"] == ["reward.png"]


def test_a_run_with_invalid_params_has_nothing_to_report() -> None:
    ctx = task_context({}, params={"nnodes": 0})  # provision refused it: no frozen spec
    with pytest.raises(AirflowSkipException, match="the run has no frozen spec"):
        ReportRunOperator(task_id=REPORT_TASK).execute(ctx)
