"""The scaling check and the run's flags: is this setup scalable, did the run learn, and if not, what to change.

A scalable RL setup keeps throughput near-linear in nodes (tokens per second **per GPU** stays flat
as nodes are added), keeps its GPUs busy, and spends a small share of each step on anything but
compute. The rules here are pure functions of what verl reported:

- **Scaling efficiency** against linear: this run's per-GPU throughput against the profile's most
  recent earlier successful run at each other node count (``perf/throughput`` is per GPU, so linear
  scaling means the ratio of the larger run's to the smaller run's is 1.0).
- **Flags**, each with its remedy: generation dominating the step; checkpoint saves taking a large
  share of the training time; GPU memory near its limit; per-GPU throughput falling as nodes grow; a
  GPU that stays under 70% busy while the run trains; a gradient norm that stayed 0 (the run learned
  nothing).

Earlier runs are read from their ``report.json`` (every report stores its :class:`ScalingPoint`),
so the check needs nothing but the storage root.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline.report.gpu import GpuUsage
from verl_pipeline.trainer.nodes.fastpath import ACTOR_TOKENS_KEY, DYNAMIC_BSZ_KEY, REMOVE_PADDING_KEYS
from verl_pipeline.trainer.overrides import spelled
from verl_pipeline.trainer.scaling import PARAM_OFFLOAD_KEY, ROLLOUT_TP_KEY

log = logging.getLogger(__name__)

#: Below this efficiency (per-GPU throughput at more nodes / at fewer nodes) scaling is not near-linear.
MIN_EFFICIENCY = 0.9
#: Generation "dominates" the step above this share of ``timing_s/step``.
MAX_GEN_SHARE = 0.5
#: Checkpoint saves take "too much" above this share of the training steps' time: the 0.5B PPO run, saving
#: every step, spent 44% of it saving (docs/benchmarks.md, 2026-12-05).
MAX_SAVE_SHARE = 0.25
#: The share of a step's time the save flag's suggested ``trainer.save_freq`` keeps saves under.
TARGET_SAVE_SHARE = 0.1
#: Peak allocated memory above this share of the GPU's memory is "near the limit".
MAX_MEMORY_SHARE = 0.9
#: A GPU busy less than this (mean over the training window, %) is under-used: the health indicator
#: to watch is GPU utilisation above 70%.
MIN_GPU_UTILIZATION_PCT = 70.0
#: A GPU's utilisation is judged on at least this many samples in the training window: each is an
#: instant that may fall on a checkpoint save or a validation pass (one sample at 3% flagged the 6-step
#: GPU resume run, sampled once a minute then). At the waiter's one sample every 10 s, 30 s of training.
MIN_SAMPLES_JUDGED = 3
#: The under-used GPUs the flag's evidence names one by one (a 64-GPU run's evidence stays readable).
GPUS_NAMED = 8
#: A trainer whose peak allocated memory stayed under this share of the GPU's has room for larger micro
#: batches: the 0.5B GRPO job on one H100 peaked at 13.5 of 79.2 GB with budgets the rules then bound by
#: memory; the budgets they give now, from the measured bytes per token, peaked at 22.5 (docs/benchmarks.md,
#: "Token budgets", 2026-12-05).
MEMORY_ROOM_SHARE = 0.5
#: verl frees the rollout's KV cache and weights while the actor trains unless this is false.
FREE_CACHE_KEY = "actor_rollout_ref.rollout.free_cache_engine"
#: A gradient norm at or below this is 0 (what a float sum of zeros leaves).
MAX_ZERO_GRAD_NORM = 1e-9


class FlagKind(str, Enum):
    GENERATION_DOMINATES = "generation_dominates"
    SAVES_DOMINATE = "checkpoint_saves_dominate"
    MEMORY_NEAR_LIMIT = "memory_near_limit"
    SCALING_FALLS = "per_gpu_throughput_falls"
    GPU_UTILIZATION_LOW = "gpu_utilization_low"
    GRAD_NORM_ZERO = "grad_norm_zero"


REMEDIES = {
    FlagKind.GENERATION_DOMINATES: (
        "speed up rollout: let each vLLM replica decode its share of the step at once "
        "(actor_rollout_ref.rollout.max_num_seqs, which the scaling rules size where the KV cache holds it: "
        "`verl-pipeline render` shows it), give it more KV cache (actor_rollout_ref.rollout.gpu_memory_utilization) "
        "or, for a large model, raise actor_rollout_ref.rollout.tensor_model_parallel_size"
    ),
    FlagKind.SAVES_DOMINATE: (
        "save less often: a larger trainer.save_freq (the evidence gives one that keeps saves under "
        f"{TARGET_SAVE_SHARE:.0%} of the time); a restart then redoes at most that many steps, so choose it by "
        "how often the cluster loses a node or a job, and by what a step costs"
    ),
    FlagKind.MEMORY_NEAR_LIMIT: (
        "offload: actor_rollout_ref.actor.fsdp_config.param_offload / optimizer_offload=true "
        "(and actor_rollout_ref.ref.fsdp_config.param_offload=true), or lower "
        "actor_rollout_ref.rollout.gpu_memory_utilization"
    ),
    FlagKind.SCALING_FALLS: (
        "check the inter-node network: NCCL over InfiniBand (the cluster profile's network.infiniband and "
        "ib_hcas → NCCL_IB_HCA, NCCL_IB_DISABLE unset, NCCL_SOCKET_IFNAME), and run once with "
        "nccl_debug to see which transport NCCL chose"
    ),
    FlagKind.GRAD_NORM_ZERO: (
        "give the run a learning signal: an entropy bonus (actor_rollout_ref.actor.entropy_coeff, e.g. 0.001), a "
        "larger learning rate (actor_rollout_ref.actor.optim.lr), an easier reward or data the model solves some of "
        "the time, or more responses per prompt (actor_rollout_ref.rollout.n) so a group is likelier to hold "
        "different rewards"
    ),
}


@dataclass(frozen=True)
class ScalingPoint:
    """One run's place on the scaling curve (stored in its report.json)."""

    run_key: str
    nnodes: int
    n_gpus: int
    #: Median ``perf/throughput`` over the run's steps: tokens/s per GPU.
    throughput_per_gpu: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Comparison:
    """This run against an earlier successful run of the profile at another node count."""

    other_run_key: str
    other_nnodes: int
    other_throughput_per_gpu: float
    nnodes: int
    throughput_per_gpu: float
    #: Per-GPU throughput of the run with more nodes / of the run with fewer (1.0 = linear).
    efficiency: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Flag:
    kind: FlagKind
    evidence: str
    remedy: str

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "evidence": self.evidence, "remedy": self.remedy}


def efficiency(small: ScalingPoint, large: ScalingPoint) -> float:
    """Per-GPU throughput at more nodes over that at fewer: 1.0 is linear scaling."""
    return large.throughput_per_gpu / small.throughput_per_gpu


def compare(current: ScalingPoint, earlier: list[ScalingPoint]) -> list[Comparison]:
    """``current`` against the latest of ``earlier`` (oldest first) at each other node count."""
    latest: dict[int, ScalingPoint] = {}
    for point in earlier:
        if point.nnodes != current.nnodes and point.throughput_per_gpu > 0 and point.run_key != current.run_key:
            latest[point.nnodes] = point
    out = []
    for nnodes in sorted(latest):
        other = latest[nnodes]
        small, large = (other, current) if other.nnodes < current.nnodes else (current, other)
        out.append(Comparison(other.run_key, other.nnodes, other.throughput_per_gpu, current.nnodes,
                              current.throughput_per_gpu, round(efficiency(small, large), 3)))
    return out


def generation_flag(timing_s: dict[str, float]) -> Flag | None:
    """Generation (``timing_s/gen``) takes more than :data:`MAX_GEN_SHARE` of the step."""
    step, gen = timing_s.get("step"), timing_s.get("gen")
    if not step or gen is None or gen / step <= MAX_GEN_SHARE:
        return None
    return Flag(FlagKind.GENERATION_DOMINATES,
                f"generation takes {gen / step:.0%} of a step ({gen:.3g} s of {step:.3g} s, median)",
                REMEDIES[FlagKind.GENERATION_DOMINATES])


def saves_flag(steps: list[tuple[float, float]]) -> Flag | None:
    """Checkpoint saves took more than :data:`MAX_SAVE_SHARE` of the training steps' time. ``steps``: each
    step's seconds and the seconds of its save (0 in a step that did not save). The evidence suggests the
    ``trainer.save_freq`` that would keep saves under :data:`TARGET_SAVE_SHARE`: the median save against a
    step's own work (the steps' time without saving, on average)."""
    total, saving = sum(t for t, _ in steps), sum(s for _, s in steps)
    saves = [s for _, s in steps if s > 0]
    if not total or saving / total <= MAX_SAVE_SHARE:
        return None
    save, rest = statistics.median(saves), (total - saving) / len(steps)
    every = max(2, math.ceil(save / (TARGET_SAVE_SHARE * rest))) if rest > 0 else None
    suggestion = (f"; saving every {every} steps (trainer.save_freq={every}) would keep saves under "
                  f"{TARGET_SAVE_SHARE:.0%}" if every else "")
    return Flag(FlagKind.SAVES_DOMINATE,
                f"checkpoint saves took {saving / total:.0%} of the training steps' time ({len(saves)} save(s) of "
                f"{save:.3g} s (median) in {len(steps)} step(s) of {rest:.3g} s without saving){suggestion}",
                REMEDIES[FlagKind.SAVES_DOMINATE])


def memory_flag(peak_gb: float | None, gpu_memory_gb: float | None) -> Flag | None:
    """Peak allocated GPU memory above :data:`MAX_MEMORY_SHARE` of the GPU's (the cluster profile's)."""
    if peak_gb is None or not gpu_memory_gb or peak_gb / gpu_memory_gb <= MAX_MEMORY_SHARE:
        return None
    return Flag(FlagKind.MEMORY_NEAR_LIMIT,
                f"peak allocated GPU memory {peak_gb:.1f} GB of {gpu_memory_gb:g} GB ({peak_gb / gpu_memory_gb:.0%})",
                REMEDIES[FlagKind.MEMORY_NEAR_LIMIT])


def scaling_flag(comparisons: list[Comparison]) -> Flag | None:
    """The worst comparison when its efficiency is below :data:`MIN_EFFICIENCY`."""
    low = [c for c in comparisons if c.efficiency < MIN_EFFICIENCY]
    if not low:
        return None
    worst = min(low, key=lambda c: c.efficiency)
    fewer, more = sorted((worst.nnodes, worst.other_nnodes))
    return Flag(FlagKind.SCALING_FALLS,
                f"per-GPU throughput at {more} nodes is {worst.efficiency:.0%} of that at {fewer} "
                f"(run {worst.other_run_key}): below {MIN_EFFICIENCY:.0%} of linear",
                REMEDIES[FlagKind.SCALING_FALLS])


@dataclass(frozen=True)
class GpuWork:
    """One way to give a GPU more work at a time, and when it fits a job: a job whose settings have
    ``key`` = ``value`` already has it (unless ``when_set``: then the advice fits only such a job).
    Without a key it fits every job; ``if_unknown``: whether it fits a job whose settings are not known."""

    advice: str
    key: str | None = None
    value: Any = None
    when_set: bool = False
    if_unknown: bool = True

    def has(self, settings: Mapping[str, Any]) -> bool:
        found = spelled(settings, self.key) if self.key else None
        return found is not None and found.value == self.value

    def fits(self, settings: Mapping[str, Any] | None) -> bool:
        if settings is None:
            return self.if_unknown
        if self.key is None:
            return True
        return self.has(settings) if self.when_set else not self.has(settings)


#: The ways to a busier GPU, in the remedy's order. A run reported with its job's settings gets those
#: that fit it: the 0.5B fast-path runs (2026-12-05) were told to pack by tokens and without padding,
#: which they did.
GPU_WORK = (
    GpuWork("larger micro batches (the model profile's scaling.max_micro_batch_size_per_gpu and "
            "scaling.log_prob_micro_batch_size_per_gpu)", DYNAMIC_BSZ_KEY, True),
    GpuWork(f"{DYNAMIC_BSZ_KEY}=true with a larger {ACTOR_TOKENS_KEY} (micro batches packed by tokens)",
            DYNAMIC_BSZ_KEY, True),
    GpuWork(f"a larger {ACTOR_TOKENS_KEY} and log_prob_max_token_len_per_gpu (the tokens each packed micro "
            "batch holds; render shows the budgets the rules sized from the GPU's memory)",
            DYNAMIC_BSZ_KEY, True, when_set=True, if_unknown=False),
    GpuWork(f"{REMOVE_PADDING_KEYS[0]}=true", REMOVE_PADDING_KEYS[0], True),
    GpuWork("a higher actor_rollout_ref.rollout.gpu_memory_utilization (more KV cache, larger generation batches)"),
    GpuWork(f"FSDP offload off when memory allows ({PARAM_OFFLOAD_KEY} / optimizer_offload and "
            "actor_rollout_ref.ref.fsdp_config.param_offload=false)", PARAM_OFFLOAD_KEY, True, when_set=True),
    GpuWork(f"a smaller {ROLLOUT_TP_KEY} for a small model", ROLLOUT_TP_KEY, 1),
    GpuWork("a data loader that keeps up (data.dataloader_num_workers)"),
)


def gpu_work_remedy(settings: Mapping[str, Any] | None) -> str:
    """The under-used GPU's remedy: the ways that fit the job (every way when its settings are not
    known), and what it already has, so the report does not ask for it."""
    ways = [w.advice for w in GPU_WORK if w.fits(settings)]
    had = [] if settings is None else list(dict.fromkeys(
        f"{w.key}={json.dumps(w.value)}" for w in GPU_WORK if not w.when_set and w.key and w.has(settings)))
    already = f" This job already has {', '.join(had)}." if had else ""
    return (f"give each GPU more work at a time: {'; '.join(ways)}.{already} Set them in a profile's verl: section, "
            "with --set or the verl_overrides param; render shows what the scaling rules chose")


def under_used(gpu: GpuUsage) -> bool:
    """The GPU was busy less than :data:`MIN_GPU_UTILIZATION_PCT` on average over the training window
    (a GPU with fewer than :data:`MIN_SAMPLES_JUDGED` samples in it is not judged)."""
    return (gpu.samples_in_window >= MIN_SAMPLES_JUDGED and gpu.mean_utilization_pct is not None
            and gpu.mean_utilization_pct < MIN_GPU_UTILIZATION_PCT)


def memory_room(peak_gb: float | None, gpu_memory_gb: float | None, settings: Mapping[str, Any] | None) -> str:
    """What the trainer's peak memory says of room for larger micro batches: a sentence when it stayed under
    :data:`MEMORY_ROOM_SHARE` of the GPU's and verl freed the rollout's memory while the actor trained (its
    default), else nothing."""
    if peak_gb is None or not gpu_memory_gb or peak_gb / gpu_memory_gb >= MEMORY_ROOM_SHARE:
        return ""
    freed = spelled(settings or {}, FREE_CACHE_KEY)
    if freed is not None and freed.value is False:
        return ""
    return (f". The trainer's peak allocated memory was {peak_gb:.1f} GB of the GPU's {gpu_memory_gb:g} GB "
            f"({peak_gb / gpu_memory_gb:.0%}; the rollout's memory is freed while the actor trains): larger micro "
            "batches fit")


def gpu_utilization_flag(gpus: list[GpuUsage], settings: Mapping[str, Any] | None = None,
                         peak_gb: float | None = None, gpu_memory_gb: float | None = None) -> Flag | None:
    """Every GPU :func:`under_used` while the run trained (the first :data:`GPUS_NAMED` named), with the
    ways to more work that fit the job's ``settings`` (:func:`gpu_work_remedy`) and, where the trainer's
    peak memory left room, that it did (:func:`memory_room`)."""
    low = [g for g in gpus if under_used(g)]
    if not low:
        return None
    each = "; ".join(f"{g.label}: {g.mean_utilization_pct:.0f}% on average (median "
                     f"{g.median_utilization_pct:.0f}%, lowest {g.min_utilization_pct:.0f}%, {g.samples_in_window} "
                     f"sample(s))" for g in low[:GPUS_NAMED])
    more = f"; and {len(low) - GPUS_NAMED} more" if len(low) > GPUS_NAMED else ""
    return Flag(FlagKind.GPU_UTILIZATION_LOW,
                f"GPU utilisation under {MIN_GPU_UTILIZATION_PCT:.0f}% while the run trained on {len(low)} of "
                f"{len(gpus)} GPU(s): {each}{more}",
                gpu_work_remedy(settings) + memory_room(peak_gb, gpu_memory_gb, settings))


def grad_norm_flag(grad_norms: list[float], advantage_ranges: list[tuple[float, float]]) -> Flag | None:
    """The actor's gradient norm was 0 at every training step that logged one: no weight changed.

    ``advantage_ranges``: each step's smallest and largest advantage, where verl logged them (evidence).
    """
    if not grad_norms or any(abs(g) > MAX_ZERO_GRAD_NORM for g in grad_norms):
        return None
    advantages = (" and every advantage was 0 (critic/advantages/min and max)"
                  if advantage_ranges and all(lo == hi == 0 for lo, hi in advantage_ranges) else "")
    return Flag(FlagKind.GRAD_NORM_ZERO,
                f"actor/grad_norm was 0 at all {len(grad_norms)} training step(s){advantages}: no update changed "
                "a weight, so the trained model equals the one the run started from. A zero advantage gives a zero "
                "gradient: with group-relative advantages (GRPO, RLOO) every response to a prompt got the same "
                "reward, typically an untrained or random model that never earns a hard reward (all 0), with no "
                "entropy bonus to move it",
                REMEDIES[FlagKind.GRAD_NORM_ZERO])


def flags(*, timing_s: dict[str, float], peak_memory_gb: float | None, gpu_memory_gb: float | None,
          comparisons: list[Comparison], gpus: list[GpuUsage] | None = None,
          grad_norms: list[float] | None = None,
          advantage_ranges: list[tuple[float, float]] | None = None,
          saves: list[tuple[float, float]] | None = None,
          settings: Mapping[str, Any] | None = None) -> list[Flag]:
    """Every flag the metrics raise, in a fixed order (``saves``: :func:`saves_flag`'s steps;
    ``settings``: the job's verl settings, when known, for the remedies that depend on them)."""
    found = [generation_flag(timing_s), saves_flag(saves or []),
             memory_flag(peak_memory_gb, gpu_memory_gb), scaling_flag(comparisons),
             gpu_utilization_flag(gpus or [], settings, peak_memory_gb, gpu_memory_gb),
             grad_norm_flag(grad_norms or [], advantage_ranges or [])]
    return [f for f in found if f is not None]


def point_from_report(data: dict[str, Any]) -> ScalingPoint | None:
    """The scaling point an earlier ``report.json`` recorded, if it was a successful training run."""
    point = data.get("scaling_point")
    if data.get("status") != "succeeded" or data.get("mode") != "train" or not isinstance(point, dict):
        return None
    try:
        return ScalingPoint(str(point["run_key"]), int(point["nnodes"]), int(point["n_gpus"]),
                            float(point["throughput_per_gpu"]))
    except (KeyError, TypeError, ValueError):
        return None


def earlier_points(storage_root: Path, profile: str, *, report_file: str, exclude_run_key: str) -> list[ScalingPoint]:
    """Scaling points of the profile's earlier successful runs under ``storage_root``, oldest first.

    ``report_file``: where a run directory keeps its report.json, relative to it.
    """
    found: list[tuple[float, ScalingPoint]] = []
    for path in (storage_root / "runs").glob(f"*/{report_file}"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            log.warning("Skipping unreadable run report %s: %s", path, e)
            continue
        point = point_from_report(data) if data.get("profile") == profile else None
        if point is not None and point.run_key != exclude_run_key:
            found.append((float(data.get("generated_at") or 0), point))
    return [p for _, p in sorted(found, key=lambda item: item[0])]
