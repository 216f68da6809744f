"""bench/rollout_ceiling.py on the CPU: the benchmark's shape and engine settings come from verl's own
composition of the run's overrides, verl's figures from its metrics, and the comparison per token. The
benchmark itself needs the GPU (its figures: docs/benchmarks.md, "What bounds generation")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.bench import bench_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "rollout_ceiling.py"

#: The 0.5B GRPO job's overrides that shape its generation (as the 2026-12-05 render composed them).
OVERRIDES = ["actor_rollout_ref.model.path=/models/qwen2.5-0.5b-arch-random", "actor_rollout_ref.rollout.name=vllm",
             "actor_rollout_ref.rollout.n=5", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
             "actor_rollout_ref.rollout.gpu_memory_utilization=0.75", "data.train_batch_size=128",
             "data.max_prompt_length=512", "data.max_response_length=1024"]


def _bench() -> Any:
    return bench_script("rollout_ceiling")


def _flags(cmd: list[str]) -> dict[str, str]:
    """``--flag value`` pairs, and ``--flag``/``--no-flag`` as "true"/"false"."""
    flags: dict[str, str] = {}
    for i, word in enumerate(cmd):
        if not word.startswith("--"):
            continue
        value = cmd[i + 1] if i + 1 < len(cmd) and not cmd[i + 1].startswith("--") else None
        if value is not None:
            flags[word[2:]] = value
        elif word.startswith("--no-"):
            flags[word[5:]] = "false"
        else:
            flags[word[2:]] = "true"
    return flags


def test_the_benchmark_runs_the_steps_shape_with_the_engine_verl_composed(tmp_path: Path) -> None:
    bench = _bench()
    ruled = bench.step_shape([*OVERRIDES, "actor_rollout_ref.rollout.max_num_seqs=320"], 137.6)
    flags = _flags(bench.bench_command(ruled, tmp_path / "v.json"))
    assert flags["model"] == "/models/qwen2.5-0.5b-arch-random"
    assert (flags["num-prompts"], flags["n"]) == ("128", "5")
    assert (flags["random-input-len"], flags["random-output-len"], flags["random-range-ratio"]) == ("138", "1024", "0")
    assert flags["max-num-seqs"] == "320" and flags["gpu-memory-utilization"] == "0.75"
    assert flags["tensor-parallel-size"] == "1" and flags["dtype"] == "bfloat16"
    assert json.loads(flags["compilation-config"]) == {"cudagraph_mode": "FULL_AND_PIECEWISE"}
    # What the run left unset is verl's default, read from verl's config, not written here.
    assert flags["max-num-batched-tokens"] == "8192"
    assert (flags["enable-prefix-caching"], flags["enable-chunked-prefill"], flags["enforce-eager"]) == (
        "true", "true", "false")
    assert "max-model-len" not in flags  # verl leaves it to the model's length, as vLLM does
    assert _flags(bench.bench_command(bench.step_shape(OVERRIDES, 137.6), tmp_path / "v.json"))["max-num-seqs"] == "256"


def test_engine_kwargs_verl_passes_are_named_as_not_applied() -> None:
    uni = "+actor_rollout_ref.rollout.engine_kwargs.vllm.distributed_executor_backend=uni"
    assert _bench().step_shape([*OVERRIDES, uni], 100.0).not_applied == {"distributed_executor_backend": "uni"}


def _rows(gens: list[float], response: float = 1000.0) -> list[dict[str, float]]:
    return [{"step": i + 1, "timing_s/gen": g, "response_length/mean": response, "prompt_length/mean": 140.0 + i}
            for i, g in enumerate(gens)]


def test_verls_generation_is_the_median_after_the_first_step() -> None:
    bench = _bench()
    verl = bench.verl_generation(_rows([30.0, 10.0, 12.0, 11.0]), 128, 5)
    assert verl["steps"] == [2, 3, 4] and verl["gen_s"] == 11.0
    assert verl["output_tokens"] == 1000 * 128 * 5
    assert verl["output_tokens_per_s"] == pytest.approx(1000 * 128 * 5 / 11.0, abs=0.1)
    assert bench.verl_generation(_rows([30.0]), 128, 5)["gen_s"] == 30.0  # a one-step run: its only step
    assert bench.verl_generation([{"step": 1, "timing_s/step": 5.0}], 128, 5) == {}
    assert bench.prompt_length_mean(_rows([1.0, 1.0, 1.0])) == 141.0


def test_the_comparison_counts_each_benchmark_response_at_the_cap() -> None:
    bench = _bench()
    shape = bench.StepShape(model="m", prompts=128, n=5, input_len=140, output_len=1024)
    verl = bench.verl_generation(_rows([30.0, 40.0]), 128, 5)  # 640,000 tokens in 40 s
    out = bench.compare(verl, {"elapsed_time": 32.768, "num_requests": 128}, shape)
    assert out["vllm_output_tokens"] == 128 * 5 * 1024
    assert out["vllm_output_tokens_per_s"] == pytest.approx(20000.0)
    assert out["verl_over_vllm"] == pytest.approx(16000.0 / 20000.0, abs=1e-3)
    assert out["gen_s_at_vllm_speed"] == pytest.approx(32.0)


def _run_dir(tmp_path: Path) -> Path:
    rd = tmp_path / "run"
    rd.mkdir()
    (rd / "job.json").write_text(json.dumps({"overrides": OVERRIDES, "runtime_env": {"env_vars": {}}}))
    lines = [json.dumps({"step": 0, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.0}})]
    lines += [json.dumps({"step": r["step"], "data": r}) for r in _rows([30.0, 12.0])]
    (rd / "metrics-a1.jsonl").write_text("\n".join(lines) + "\n")
    return rd


def test_a_dry_run_prints_the_benchmark_for_a_run_directory_without_a_gpu(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(_run_dir(tmp_path)), "--out",
                          str(tmp_path / "ceiling.json"), "--dry-run"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "-m vllm.entrypoints.cli.main bench throughput" in out.stdout
    assert "--random-input-len 140 " in out.stdout  # the training steps' prompts (140, 141): validation's row skipped
    assert not (tmp_path / "ceiling.json").exists()


def test_a_run_without_training_steps_is_said_and_fails(tmp_path: Path) -> None:
    rd = tmp_path / "empty"
    rd.mkdir()
    out = subprocess.run([sys.executable, str(SCRIPT), "--run-dir", str(rd), "--out", str(tmp_path / "c.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and "nothing to compare" in out.stdout
