"""The log-prob kernel benchmark's CPU path: verl's fused kernels, which the scaling rules turn on
where flash-attn is absent, give the update the same log-probs and gradients as verl's default path."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "logprob_kernels.py"


def test_fused_and_default_log_probs_agree_and_the_figures_are_written(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tokens", "32", "--repeats", "1",
                          "--dtype", "float32", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads(out.read_text())
    assert figures["device"] == "cpu" and figures["tokens"] == 32 and figures["vocab"] == 151_936
    # No flash-attn here: verl's default path is the row-by-row one the rule replaces.
    assert figures["default_path"] == "row-by-row log-softmax"
    assert figures["max_abs_diff"] < 1e-4 and figures["max_grad_rel_diff"] < 1e-4
    # The GPU acceptance profile trains with an entropy bonus: the fused kernels' entropy gradient counts too.
    assert figures["entropy_grad_rel_diff"] < 1e-4
    for key in ("default_forward_s", "fused_forward_s", "default_forward_backward_s", "fused_forward_backward_s"):
        assert figures[key] > 0
    assert figures["fused_step_s"] > 0 and "forward+backward" in run.stdout


def test_asking_for_a_gpu_that_is_not_there_exits_2() -> None:
    run = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda"], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 2 and "torch sees no GPU" in run.stdout
