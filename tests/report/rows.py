"""verl-shaped metric rows for the report tests (the names verl 0.9.1's trainers log)."""

from __future__ import annotations

from verl_pipeline.report.build import StepRow


def verl_row(step: int, attempt: int = 1, *, gen: float = 3.0, step_s: float = 6.0, tokens: float = 64000.0,
             n_gpus: int = 8, **extra: float) -> StepRow:
    metrics = {
        "training/global_step": float(step),
        "critic/score/mean": 0.1 * step,
        "response_length/mean": 100.0 + step,
        "response_length/max": 200.0 + step,
        "perf/total_num_tokens": tokens,
        "perf/time_per_step": step_s,
        "perf/throughput": tokens / (step_s * n_gpus),
        "timing_s/step": step_s,
        "timing_s/gen": gen,
        "timing_s/old_log_prob": 0.5,
        "timing_s/update_actor": step_s - gen - 0.5,
        **extra,
    }
    return StepRow(step, attempt, metrics)
