"""Recovery time per fault scenario (kill → the resumed attempt logging its first training step).

Usage: .venv/bin/python bench/fault_recovery.py

Runs the fault-injection tests (tests/faults: real 2-node local Ray cluster, real DAG, real kills;
saves killed mid-write and an allocation deadline on the local Ray head with the stand-in trainer;
and a Slurm allocation whose time limit ends it mid-training on the throwaway Slurm), which write their
measurements to .work/fault-recovery.json, and prints them as a table: per scenario the time from
the fault to the resumed attempt's first step and the steps lost (trained again after the resume).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / ".work" / "fault-recovery.json"


def main() -> None:
    RESULTS.unlink(missing_ok=True)
    slurm = ("tests/integration/test_slurm_dag.py::"
             "test_allocation_time_limit_ends_mid_training_verl_saves_ahead_and_the_retry_resumes")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/faults", slurm],
                       cwd=REPO)
    data = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    print("| scenario | time to first resumed step (s) | killed after step | resumed from step | steps lost |")
    print("|---|---|---|---|---|")
    for name, row in data.items():
        recovery = row.get("recovery_s", row.get("dags_test_rerun_s", "-"))
        print(f"| {name} | {recovery} | {row.get('killed_after_step', '-')} "
              f"| {row.get('resumed_from_step', '-')} | {row.get('steps_redone', 0)} |")
    notes = {name: row["note"] for name, row in data.items() if row.get("note")}
    for name, note in notes.items():
        print(f"- {name}: {note}")
    raise SystemExit(r.returncode)


if __name__ == "__main__":
    main()
