"""One name for verl's per-attempt metrics file, used by the submit, the manifest and the report."""

from __future__ import annotations

import json
from pathlib import Path

from verl_pipeline import runs
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir


def test_metrics_files_lists_every_attempt_in_order_and_nothing_else(tmp_path: Path) -> None:
    for n in (10, 2, 1):
        RunDir(tmp_path).metrics_file(n).write_text("")
    (tmp_path / "metrics-aX.jsonl").write_text("")  # not an attempt's
    (tmp_path / "metrics.jsonl").write_text("")
    assert RunDir(tmp_path).metrics_files() == {1: tmp_path / "metrics-a1.jsonl", 2: tmp_path / "metrics-a2.jsonl",
                                       10: tmp_path / "metrics-a10.jsonl"}


def test_run_spec_and_manifest_name_the_files_the_attempts_write(tmp_path: Path) -> None:
    spec = build_run_spec({}, run_name="verl_ppo/manual__1")
    assert spec.metrics_path(2) == RunDir(spec.run_dir).metrics_file(2)
    assert spec.report_dir == spec.run_dir / "report"
    run_dir = tmp_path / "runs" / "r1"
    run_dir.mkdir(parents=True)
    RunDir(run_dir).metrics_file(1).write_text("")
    RunDir(run_dir).metrics_file(2).write_text("")
    runs.record_run(run_dir=run_dir, run_key="r1", run_name="d/r1", profile="smoke", status=runs.RunStatus.FAILED,
                    checkpoint_dir=tmp_path / "ckpt")
    manifest = json.loads(RunDir(run_dir).manifest_file.read_text())
    assert manifest["metrics_files"] == [str(RunDir(run_dir).metrics_file(1)), str(RunDir(run_dir).metrics_file(2))]
    assert "metrics_file" not in manifest
