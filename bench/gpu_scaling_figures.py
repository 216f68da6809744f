"""The scaling runs' figures and table, from what each run left (pure functions: CPU-tested).

Per configuration (``bench/gpu_scaling.py`` runs them): seconds per step and tokens per second per GPU
over the steady steps (after the first, the checkpoint save taken out), time in weight synchronisation
(verl 0.9.1's ``timing_s/update_weights``, and the separate placement's hand-overs between the pools),
what NCCL said about itself (``NCCL_DEBUG=INFO``: version, communicators, their set-up time, the
transport of every channel), each of the run's own GPUs' utilisation and peak memory (the report's
``gpus`` rows), time to the first step (the report's per-attempt start-up). Against the same model
profile on one GPU: the weak-scaling efficiency (per-GPU throughput, ``report.scaling_check.efficiency``) and
the share of the step the one-GPU run at the same work per GPU does not need (communication,
synchronisation and imbalance together: NCCL reports no time spent in collectives).
"""

from __future__ import annotations

import re
import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_pipeline.report import scaling_check
from verl_pipeline.trainer import metrics as m

#: The seed's health indicator for communication: NCCL collectives under 10% of the step.
MAX_COMM_SHARE = 0.10
#: verl 0.9.1's timers of weight synchronisation: the actor's weights into the rollout engines (every
#: trainer), and the separate placement's hand-overs of the hybrid engine between the pools.
SYNC_TIMINGS = ("update_weights", "switch_to_rollout", "switch_to_trainer", "switch_wait")
SAVE_TIMING = "save_checkpoint"

_NCCL_VERSION = re.compile(r"NCCL INFO NCCL version (\S+)")
_NCCL_CHANNEL = re.compile(r"NCCL INFO Channel \d+(?:/\d+)? : .*? via (\S+)")
_NCCL_INIT = re.compile(r"NCCL INFO Init timings.*? nranks (\d+) total ([\d.]+)")
_NCCL_NETWORK = re.compile(r"NCCL INFO Using network (\S+)")


def _median(values: Iterable[float]) -> float | None:
    values = list(values)
    return round(statistics.median(values), 3) if values else None


def steady_rows(rows: Sequence[Mapping[str, float]]) -> list[Mapping[str, float]]:
    """The training rows after the first (which pays the warm-up: CUDA graphs, allocator, caches); the
    only row when the run trained one step."""
    return list(rows[1:]) or list(rows[:1])


def step_seconds(row: Mapping[str, float]) -> float | None:
    """``timing_s/step`` without the checkpoint save inside it (verl saves inside the step's timer)."""
    step = row.get(m.TIMING_STEP)
    if step is None:
        return None
    return step - row.get(m.TIMING_PREFIX + SAVE_TIMING, 0.0)


def step_figures(rows: Sequence[Mapping[str, float]], n_gpus: int) -> dict[str, Any]:
    """Seconds per step, tokens per second per GPU (every GPU of the run, both pools of a separate
    placement), weight synchronisation and each phase (medians over the steady steps)."""
    steady = steady_rows(rows)
    per_step = [(s, r.get(m.TOTAL_TOKENS)) for r in steady if (s := step_seconds(r))]
    tokens = [t / (s * n_gpus) for s, t in per_step if t is not None and n_gpus]
    phases: dict[str, float | None] = {}
    for key in sorted({k for r in steady for k in r if k.startswith(m.TIMING_PREFIX)}):
        phases[key.removeprefix(m.TIMING_PREFIX)] = _median(r[key] for r in steady if key in r)
    sync = [sum(r.get(m.TIMING_PREFIX + t, 0.0) for t in SYNC_TIMINGS) for r in steady]
    step = _median(s for s, _ in per_step)
    sync_s = _median(sync) if any(sync) else 0.0
    return {"steps": len(rows), "steady_steps": len(steady), "step_s": step,
            "tokens_per_s_per_gpu": _median(tokens),
            "verl_throughput_per_gpu": _median(r[m.THROUGHPUT_PER_GPU] for r in steady if m.THROUGHPUT_PER_GPU in r),
            "sync_s": sync_s, "sync_share": round(sync_s / step, 4) if step and sync_s is not None else None,
            "phases_s": phases}


def nccl_summary(lines: Iterable[str]) -> dict[str, Any]:
    """What NCCL printed at ``NCCL_DEBUG=INFO``: its version, the network it chose, how many communicator
    ranks it set up and their longest set-up (seconds), and how many channels went over each transport
    (``P2P`` and ``SHM`` stay in the host; ``NET/Socket`` and ``NET/IB`` leave it)."""
    versions: set[str] = set()
    networks: set[str] = set()
    transports: Counter[str] = Counter()
    inits: list[float] = []
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        if found := _NCCL_CHANNEL.search(line):
            parts = found.group(1).split("/")
            transports["/".join(parts[:2]) if parts[0] == "NET" else parts[0]] += 1
        elif found := _NCCL_INIT.search(line):
            inits.append(float(found.group(2)))
        elif found := _NCCL_VERSION.search(line):
            versions.add(found.group(1))
        elif found := _NCCL_NETWORK.search(line):
            networks.add(found.group(1))
    return {"versions": sorted(versions), "networks": sorted(networks), "communicator_ranks": len(inits),
            "init_s_max": max(inits, default=None), "transports": dict(sorted(transports.items()))}


def own_gpus(rows: Iterable[Mapping[str, Any]], devices: Sequence[int]) -> list[dict[str, Any]]:
    """The report's GPU rows of the GPUs the run was given. Ray reads every GPU of the host (NVML), so a run
    on some of a host's GPUs finds the others, idle or another run's, in its report too."""
    wanted = set(devices)
    return [{"index": r.get("index"), "mean_utilization_pct": r.get("mean_utilization_pct"),
             "min_utilization_pct": r.get("min_utilization_pct"), "samples_in_window": r.get("samples_in_window"),
             "peak_memory_gib": None if r.get("peak_memory_used_mib") is None
             else round(r["peak_memory_used_mib"] / 1024, 1)}
            for r in rows if r.get("index") in wanted]


def table_rows(results: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per configuration, each against its model profile's one-GPU colocated run (the weak-scaling
    baseline): efficiency, the step's share beyond the baseline's, and the health indicators that fail."""
    base = {str(r["model"]): r for r in results
            if r.get("gpus") == 1 and r.get("placement") == "colocated" and r.get("ok")}
    rows = []
    for r in results:
        f = r.get("figures") or {}
        row: dict[str, Any] = {k: r.get(k) for k in ("config", "model", "gpus", "nodes", "tp", "placement", "weak",
                                                     "ok")}
        row.update({k: f.get(k) for k in ("train_batch_size", "step_s", "tokens_per_s_per_gpu", "sync_share",
                                          "time_to_first_step_s")})
        gpus = f.get("own_gpus") or []
        utils = [g["mean_utilization_pct"] for g in gpus if g.get("mean_utilization_pct") is not None]
        row["gpu_util_min_pct"] = round(min(utils), 1) if utils else None
        row["gpu_util_mean_pct"] = round(statistics.fmean(utils), 1) if utils else None
        row["peak_memory_gib_max"] = max((g["peak_memory_gib"] for g in gpus if g.get("peak_memory_gib")),
                                         default=None)
        row["nccl_transports"] = (f.get("nccl") or {}).get("transports")
        b = base.get(str(r["model"]))
        bf = (b or {}).get("figures") or {}
        row["efficiency"] = row["overhead_vs_1gpu"] = None
        if b is not None and r.get("ok") and f.get("tokens_per_s_per_gpu") and bf.get("tokens_per_s_per_gpu"):
            one = scaling_check.ScalingPoint(str(b["config"]), 1, 1, float(bf["tokens_per_s_per_gpu"]))
            this = scaling_check.ScalingPoint(str(r["config"]), int(r["nodes"]), int(r["gpus"]),
                                        float(f["tokens_per_s_per_gpu"]))
            row["efficiency"] = round(scaling_check.efficiency(one, this), 3)
            if r.get("weak") and f.get("step_s") and bf.get("step_s"):
                row["overhead_vs_1gpu"] = round(max(0.0, 1 - float(bf["step_s"]) / float(f["step_s"])), 3)
        row["failing"] = failing(row)
        rows.append(row)
    return rows


def failing(row: Mapping[str, Any]) -> list[str]:
    """The health indicators this row fails (only those it has a figure for)."""
    out = []
    efficiency = row.get("efficiency")
    if row.get("gpus", 1) > 1 and efficiency is not None and efficiency < scaling_check.MIN_EFFICIENCY:
        out.append(f"efficiency {row['efficiency']:.0%} < {scaling_check.MIN_EFFICIENCY:.0%}")
    if row.get("overhead_vs_1gpu") is not None and row["overhead_vs_1gpu"] > MAX_COMM_SHARE:
        out.append(f"beyond the 1-GPU step {row['overhead_vs_1gpu']:.0%} > {MAX_COMM_SHARE:.0%}")
    if row.get("gpu_util_min_pct") is not None and row["gpu_util_min_pct"] < scaling_check.MIN_GPU_UTILIZATION_PCT:
        out.append(f"a GPU at {row['gpu_util_min_pct']:.0f}% < {scaling_check.MIN_GPU_UTILIZATION_PCT:.0f}%")
    return out


def _cell(value: Any, fmt: str = "{}") -> str:
    return "—" if value is None else fmt.format(value)


def render_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table (docs/benchmarks.md's scaling table)."""
    head = ("| configuration | GPUs | batch | s/step | tokens/s/GPU | efficiency | weight sync | beyond 1-GPU step "
            "| GPU util min / mean | peak GiB | first step s | NCCL transports | failing |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        transports = ", ".join(f"{k} {v}" for k, v in (r.get("nccl_transports") or {}).items()) or "—"
        ttfs = r.get("time_to_first_step_s")
        first = ttfs[0] if isinstance(ttfs, list) and ttfs else ttfs
        name = r["config"] + ("" if r.get("ok") else " (failed)")
        lines.append(
            f"| {name} | {r.get('gpus')} | {_cell(r.get('train_batch_size'))} "
            f"| {_cell(r.get('step_s'), '{:.1f}')} | {_cell(r.get('tokens_per_s_per_gpu'), '{:,.0f}')} "
            f"| {_cell(r.get('efficiency'), '{:.0%}')} | {_cell(r.get('sync_share'), '{:.1%}')} "
            f"| {_cell(r.get('overhead_vs_1gpu'), '{:.0%}')} "
            f"| {_cell(r.get('gpu_util_min_pct'), '{:.0f}')} / {_cell(r.get('gpu_util_mean_pct'), '{:.0f}')}% "
            f"| {_cell(r.get('peak_memory_gib_max'), '{:.1f}')} | {_cell(first, '{:.0f}')} | {transports} "
            f"| {'; '.join(r.get('failing') or []) or '—'} |")
    return "\n".join(lines)


def plot_scaling(rows: Sequence[Mapping[str, Any]], path: Path) -> Path | None:
    """Tokens per second of the whole run against its GPUs, one line per model profile's series (one node,
    colocated, TP 1, weak-scaled), each beside its ideal (the one-GPU run's times the GPUs). None: no series
    has a one-GPU run and another point."""
    series: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if (r.get("ok") and r.get("weak") and r.get("nodes") == 1 and r.get("tp") == 1
                and r.get("placement") == "colocated" and r.get("tokens_per_s_per_gpu")):
            total = float(r["tokens_per_s_per_gpu"]) * int(r["gpus"])
            series.setdefault(str(r["model"]), []).append((int(r["gpus"]), total))
    series = {k: sorted(v) for k, v in series.items() if len(v) > 1 and min(v)[0] == 1}
    if not series:
        return None
    import matplotlib

    matplotlib.use("Agg")  # no display on a GPU node
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for model, points in sorted(series.items()):
        gpus = [g for g, _ in points]
        line, = ax.plot(gpus, [t for _, t in points], marker="o", label=model)
        ax.plot(gpus, [points[0][1] * g for g in gpus], linestyle="--", color=line.get_color(), alpha=0.6,
                label=f"{model}, ideal")
    ax.set(xscale="log", yscale="log", xlabel="GPUs (one host)", ylabel="tokens/s (whole run)",
           title="Weak scaling: tokens/s against GPUs")
    ax.minorticks_off()
    ax.set_xticks([1, 2, 4, 8], labels=["1", "2", "4", "8"])
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
