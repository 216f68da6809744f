"""verl-shaped metric rows for the report tests (the names verl 0.9.1's trainers log)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from verl_pipeline.jobs.gpu_usage import GpuReading, NodeGpuSample
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
        "actor/grad_norm": 0.5,
        **extra,
    }
    return StepRow(step, attempt, metrics)


def node_samples(node_id: str, node_ip: str, times: Iterable[float], utilization: Callable[[float], float], *,
                 n_gpus: int = 2, used_mib: float = 60_000.0, total_mib: float = 81_920.0,
                 uuids: bool = True) -> list[NodeGpuSample]:
    """One node's readings at ``times``, every GPU at ``utilization(time)`` %, GPU ``i`` using ``used_mib + i``;
    ``uuids``: each GPU's UUID recorded (``GPU-<address>-<i>``), as the waiter does since it records them."""
    return [NodeGpuSample(t, node_id, node_ip, tuple(
        GpuReading(i, utilization(t), used_mib + i, total_mib, f"GPU-{node_ip}-{i}" if uuids else None)
        for i in range(n_gpus)))
            for t in times]
