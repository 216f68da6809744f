"""``verl-pipeline report <run_dir>``: the report task's function, from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.report.test_write import _log, _run_dir
from verl_pipeline import cli


def test_report_rebuilds_a_run_and_keeps_its_recorded_outcome(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = _run_dir(tmp_path, "r1")
    _log(run_dir, 1, range(1, 4), resume_from=0)  # 3 of 6 steps
    assert cli.main(["report", str(run_dir), "--status", "failed", "--no-plots"]) == 0
    assert "failed, 3/6 steps" in capsys.readouterr().out
    # A rebuild without --status keeps what the report said (not what the steps alone would suggest).
    assert cli.main(["report", str(run_dir), "--no-plots", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["status"] == "failed" and out["html"] == str(run_dir / "report" / "report.html")
    assert Path(out["html"]).is_file() and out["plots"] == []


def test_report_refuses_a_directory_that_is_not_a_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "is not a run directory" in err and "<storage>/runs/<run_key>" in err
