"""The rollout's generation speed against vLLM's own benchmark of the same work on the same GPU.

Issue 35 asks of the 0.5B run: where a speed goal is out of reach, show what bounds it. Generation is
the largest part of a GRPO step (40-44 s of the 12-03 0.5B step). This takes a finished run's
directory and runs ``vllm bench throughput`` (vLLM's offline benchmark: one ``LLM``, no verl, no Ray)
on the run's model with the step's shape: as many prompts as ``data.train_batch_size``, ``rollout.n``
samples each, prompts as long as the run's mean and responses as long as verl's cap. It also uses
the run's engine settings as verl composed them: ``max_num_seqs``, ``max_num_batched_tokens``,
prefix caching, chunked prefill, ``gpu_memory_utilization``, TP, dtype, verl's CUDA-graph mode. Then it
compares the output tokens per second of the two, verl's from the run's metrics (median
``timing_s/gen`` after the first step, ``response_length/mean``). A ratio near 1 says the rollout
already runs at vLLM's speed on this GPU, and only a faster engine setting or a smaller step makes
generation shorter. A ratio well below 1 says the time goes to verl's agent loop around the engine.

What differs, and why it is small: vLLM's benchmark ignores EOS, so every response is the cap long.
A random-weight model rarely samples EOS, so verl's are near it too; the comparison is per token. verl
asks for each sampled token's log-prob (``calculate_log_probs``) and runs vLLM in sleep mode (the
cumem allocator); the benchmark does neither. The benchmark reads the run's warm compile caches
(its ``runtime_env``), so its start is quick; only generation is timed.

Usage: python bench/rollout_ceiling.py --run-dir RUN_DIR --out FILE.json [--dry-run]
``--dry-run`` prints the benchmark's command and exits (no GPU needed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_acceptance as acceptance  # the machine's GPUs, a run's training rows

#: verl passes this CUDA-graph mode to vLLM unless the rollout's engine_kwargs set one (verl 0.9.1).
VERL_CUDAGRAPH_MODE = "FULL_AND_PIECEWISE"
#: A few prompts through the engine before the timed batch (CUDA graphs, kernels, the first allocations).
WARMUP_PROMPTS = 16


@dataclass(frozen=True)
class StepShape:
    """One training step's generation, and the engine that ran it, as verl composed the run's config."""

    model: str
    prompts: int
    n: int
    input_len: int
    output_len: int
    #: vLLM engine arguments (flag name without ``--`` -> value), as verl 0.9.1 passes them to its server.
    engine: dict[str, Any] = field(default_factory=dict)
    #: The rollout's ``engine_kwargs.vllm``: passed to vLLM by verl, not by this benchmark.
    not_applied: dict[str, Any] = field(default_factory=dict)


def step_shape(overrides: list[str], prompt_len_mean: float) -> StepShape:
    """The step's shape and engine settings from verl's own composition of the run's overrides (verl's
    defaults included: a setting the run left unset is verl's, not this script's)."""
    from omegaconf import OmegaConf

    from verl_pipeline.trainer.validate import compose

    cfg = compose(overrides)
    rollout = cfg.actor_rollout_ref.rollout
    passed = rollout.engine_kwargs.get("vllm")  # an empty DictConfig when the run set none
    not_applied = dict(OmegaConf.to_container(passed, resolve=True)) if passed else {}
    compilation = {"cudagraph_mode": VERL_CUDAGRAPH_MODE}
    if rollout.get("cudagraph_capture_sizes"):
        compilation["cudagraph_capture_sizes"] = list(rollout.cudagraph_capture_sizes)
    engine: dict[str, Any] = {
        "dtype": rollout.dtype,
        "max-num-seqs": int(rollout.max_num_seqs),
        "max-num-batched-tokens": int(rollout.max_num_batched_tokens),
        "enable-chunked-prefill": bool(rollout.enable_chunked_prefill),
        "enable-prefix-caching": bool(rollout.enable_prefix_caching),
        "enforce-eager": bool(rollout.enforce_eager),
        "gpu-memory-utilization": float(rollout.gpu_memory_utilization),
        "tensor-parallel-size": int(rollout.tensor_model_parallel_size),
        "seed": int(rollout.seed),
        "compilation-config": json.dumps(compilation),
    }
    if rollout.get("max_model_len"):
        engine["max-model-len"] = int(rollout.max_model_len)
    return StepShape(model=str(cfg.actor_rollout_ref.model.path), prompts=int(cfg.data.train_batch_size),
                     n=int(rollout.n), input_len=max(1, round(prompt_len_mean)),
                     output_len=int(rollout.response_length), engine=engine, not_applied=not_applied)


def bench_command(shape: StepShape, out_json: Path, python: str = sys.executable) -> list[str]:
    """``vllm bench throughput`` for the step: random prompts of the run's mean length, ``n`` samples each.
    The lengths go in as ``--random-*-len``: vLLM 0.24 prefers those, and their defaults (1024 and 128)
    would win over ``--input-len``/``--output-len``."""
    cmd = [python, "-m", "vllm.entrypoints.cli.main", "bench", "throughput", "--model", shape.model,
           "--dataset-name", "random", "--random-input-len", str(shape.input_len),
           "--random-output-len", str(shape.output_len), "--random-range-ratio", "0",
           "--num-prompts", str(shape.prompts), "--n", str(shape.n), "--num-warmups", str(WARMUP_PROMPTS),
           "--output-json", str(out_json)]
    for flag, value in shape.engine.items():
        if isinstance(value, bool):
            cmd.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            cmd += [f"--{flag}", str(value)]
    return cmd


def verl_generation(rows: list[dict[str, float]], prompts: int, n: int) -> dict[str, Any]:
    """The run's generation per step: median ``timing_s/gen`` after the first step (the only one when
    there is one), the responses' tokens per step, and their rate."""
    from verl_pipeline.trainer import metrics as m

    steady = [r for r in (rows[1:] or rows) if r.get(m.TIMING_GEN) and m.RESPONSE_LENGTH in r]
    if not steady:
        return {}
    gen_s = statistics.median(r[m.TIMING_GEN] for r in steady)
    response = statistics.median(r[m.RESPONSE_LENGTH] for r in steady)
    tokens = response * prompts * n
    return {"steps": [int(r["step"]) for r in steady], "gen_s": round(gen_s, 2),
            "response_length_mean": round(response, 1), "output_tokens": round(tokens),
            "output_tokens_per_s": round(tokens / gen_s, 1)}


def prompt_length_mean(rows: list[dict[str, float]]) -> float | None:
    from verl_pipeline.trainer import metrics as m

    values = [r[m.PROMPT_LENGTH] for r in rows if m.PROMPT_LENGTH in r]
    return statistics.median(values) if values else None


def compare(verl: dict[str, Any], vllm: dict[str, Any], shape: StepShape) -> dict[str, Any]:
    """vLLM's output tokens per second for the step's batch against verl's (every response of the
    benchmark is ``output_len`` long: it ignores EOS)."""
    elapsed = float(vllm["elapsed_time"])
    tokens = shape.prompts * shape.n * shape.output_len
    rate = tokens / elapsed
    out: dict[str, Any] = {"vllm_elapsed_s": round(elapsed, 2), "vllm_output_tokens": tokens,
                           "vllm_output_tokens_per_s": round(rate, 1)}
    if verl.get("output_tokens_per_s"):
        out["verl_over_vllm"] = round(verl["output_tokens_per_s"] / rate, 3)
        out["gen_s_at_vllm_speed"] = round(verl["output_tokens"] / rate, 2)
    return out


def run_bench(cmd: list[str], env: dict[str, str], log: Path, timeout_s: float) -> int:
    with log.open("w") as out:
        try:
            return subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return 124


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run-dir", type=Path, required=True, help="a finished run's directory (job.json, metrics)")
    p.add_argument("--attempt", type=int, default=1, help="whose metrics give verl's figures")
    p.add_argument("--out", type=Path, required=True, help="write the figures (JSON) here; vLLM's own beside it")
    p.add_argument("--timeout", type=float, default=540.0, help="seconds the benchmark may take")
    p.add_argument("--dry-run", action="store_true", help="print the benchmark's command and exit")
    args = p.parse_args(argv)
    from verl_pipeline.rundir import RunDir

    rd = RunDir(args.run_dir)
    job = rd.job()
    rows = acceptance.training_rows(rd.metrics_file(args.attempt))
    prompt_len = prompt_length_mean(rows)
    if job is None or not rows or prompt_len is None:
        print(f"rollout_ceiling: {args.run_dir} has no job.json or no training steps with a prompt length "
              f"(attempt {args.attempt}): nothing to compare")
        return 1
    shape = step_shape(job["overrides"], prompt_len)
    out_json = args.out.with_suffix(".vllm.json")
    cmd = bench_command(shape, out_json)
    if args.dry_run:
        print(" ".join(cmd))
        return 0
    if not acceptance.gpu_memory_mib():
        print("rollout_ceiling: no NVIDIA GPU on this machine (nvidia-smi found none): nothing to run")
        return 0
    env = {**os.environ, **job.get("runtime_env", {}).get("env_vars", {})}
    code = run_bench(cmd, env, out_json.with_suffix(".log"), args.timeout)
    verl = verl_generation(rows, shape.prompts, shape.n)
    figures: dict[str, Any] = {"shape": asdict(shape), "command": cmd, "rc": code, "verl": verl}
    if code == 0 and out_json.exists():
        figures["vllm"] = json.loads(out_json.read_text())
        figures.update(compare(verl, figures["vllm"], shape))
    print(json.dumps(figures, default=str), flush=True)
    args.out.write_text(json.dumps(figures, indent=2, default=str))
    return 0 if "vllm" in figures else 1


if __name__ == "__main__":
    sys.exit(main())
