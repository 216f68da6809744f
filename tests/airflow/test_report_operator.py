"""The report task: its outcome from the wait's result, its XCom, and a run that never had a spec."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
from airflow.sdk.exceptions import AirflowSkipException

from tests.airflow.context import FakeDag, FakeTI
from verl_pipeline.airflow.operators import REPORT_TASK, ReportRunOperator
from verl_pipeline.airflow.operators.base import run_name
from verl_pipeline.config import build_run_spec
from verl_pipeline.jobs.attempts import Attempt, metrics_file, record_attempt


def _context(xcoms: dict[str, Any], params: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"ti": FakeTI(xcoms), "params": params or {}, "run_id": f"manual__report_{time.time_ns()}", "dag": FakeDag()}


def _two_steps(ctx: dict[str, Any]) -> Path:
    spec = build_run_spec({}, run_name=run_name(ctx))
    record_attempt(spec.run_dir, Attempt("job-a1", 1, time.time(), "http://d", 0, str(spec.metrics_path(1))))
    rows = [{"step": s, "data": {"training/global_step": s, "critic/score/mean": 0.1 * s}} for s in (1, 2)]
    metrics_file(spec.run_dir, 1).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return spec.run_dir


@pytest.mark.parametrize(("waited", "status"), [
    (None, "failed"),  # the wait failed: it returned nothing
    ({"status": "SUCCEEDED", "job_id": "job-a1"}, "succeeded"),
])
def test_the_report_says_how_the_wait_ended_and_where_it_is(waited: dict[str, Any] | None, status: str) -> None:
    ctx = _context({"wait_for_verl_job": waited})
    run_dir = _two_steps(ctx)
    out = ReportRunOperator(task_id=REPORT_TASK).execute(ctx)
    assert out["report_dir"] == str(run_dir / "report") and out["html"] == str(run_dir / "report" / "report.html")
    assert out["status"] == status and out["steps_done"] == 2
    assert json.loads((run_dir / "report" / "report.json").read_text())["status"] == status
    assert Path(out["html"]).is_file() and out["plots"] == ["reward.png"]


def test_a_run_with_invalid_params_has_nothing_to_report() -> None:
    ctx = _context({}, params={"nnodes": 0})
    with pytest.raises(AirflowSkipException, match="the run's spec is invalid"):
        ReportRunOperator(task_id=REPORT_TASK).execute(ctx)
