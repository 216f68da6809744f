"""bench/report_png.py: a run directory's report, rebuilt and drawn in real Chromium, the run directory untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench import bench_script
from tests.report.rows import verl_row
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import Attempt, RunDir

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "report_png.py"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _resumed_run(root: Path) -> Path:
    """Two attempts, the second a resume whose decision turned validation off."""
    run_dir = root / "runs" / "resumed"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "run_spec.json", {"run_name": "verl_ppo/resumed", "profile": "gsm8k", "nnodes": 1,
                                                  "n_gpus_per_node": 1, "total_training_steps": 4,
                                                  "storage_root": str(root)})
    write_json_atomic(run_dir / "job.json", {"mode": "train"})
    run = RunDir(run_dir)
    for attempt, steps, resume in ((1, range(1, 3), 0), (2, range(3, 5), 2)):
        run.record_attempt(Attempt(f"job-a{attempt}", attempt, 1000.0 * attempt, "http://d", resume,
                                   str(run.metrics_file(attempt))))
        run.metrics_file(attempt).write_text("".join(json.dumps({"step": s, "data": verl_row(s, attempt).metrics})
                                                     + "\n" for s in steps))
    run.record_decision({"attempt": 2, "settings": {"trainer.val_before_train": False}})
    return run_dir


def test_the_report_of_a_run_directory_is_drawn_above_a_section_without_changing_it(tmp_path: Path) -> None:
    report_png = bench_script("report_png")

    try:
        report_png.chromium()
    except SystemExit as e:  # the script's own lookup, and its words
        if os.environ.get("CI"):
            pytest.fail(f"CI: {e}")
        pytest.skip(str(e))
    pytest.importorskip("playwright.sync_api")
    run_dir = _resumed_run(tmp_path)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    out = tmp_path / "report.png"
    done = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), str(out), "--width", "900", "--until", "Plots"],
                          capture_output=True, text=True, timeout=180, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    assert width == 900 and 300 < height < 20000
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before  # a copy was reported
    missing = subprocess.run([sys.executable, str(SCRIPT), str(run_dir), str(tmp_path / "x.png"), "--until", "Nope"],
                             capture_output=True, text=True, timeout=180, cwd=REPO)
    assert missing.returncode != 0 and "no section headed 'Nope'" in missing.stderr
