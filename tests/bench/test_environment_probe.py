"""The environment probe benchmark runs: on the embedded default here (it times the probe a GPU run's
submit task pays when given ``--profile gpu-acceptance --mode train`` on a GPU machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "environment_probe.py"

pytestmark = pytest.mark.integration


def test_one_probe_of_the_embedded_default_is_timed_by_phase(tmp_path: Path) -> None:
    env = {**os.environ, "VERL_PIPELINE_HOME": str(tmp_path / "home")}
    run = subprocess.run([sys.executable, str(SCRIPT), "--runs", "1"], capture_output=True, text=True, timeout=300,
                         env=env, cwd=REPO)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (row,) = [json.loads(line) for line in run.stdout.splitlines() if line.startswith('{"run"')]
    assert row["run"] == 1 and row["wall_s"] > 0 and row["tasks_s"] > 0 and row["node_facts_s"] >= 0
    # The embedded default trains PPO through vLLM with a critic: vllm and flash-attn are checked, verl too.
    assert set(row["imports_s"]) == {"verl", "vllm", "flash_attn"}
    assert "probe of the embedded default (preflight, 1 node)" in run.stdout
