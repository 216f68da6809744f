"""The run report's PNG plots (matplotlib, Agg backend, imported only when plots are drawn).

Every plot of verl's metrics is per step, with the start of every resumed attempt marked (a dashed
line labelled with the step it resumed from). A plot whose metrics verl did not report is not drawn.
Each host with GPU readings gets its own plot over time, one line per GPU (:func:`draw_gpu`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_pipeline.report.build import AttemptInfo, StepRow, timing_names, training_rows
from verl_pipeline.report.gpu import GpuSeries, Window, by_host
from verl_pipeline.report.scaling_check import MIN_GPU_UTILIZATION_PCT
from verl_pipeline.trainer import metrics as m

log = logging.getLogger(__name__)

#: File name of each plot in the report directory, by what it shows.
REWARD_PNG = "reward.png"
RESPONSE_LENGTH_PNG = "response_length.png"
THROUGHPUT_PNG = "throughput.png"
TIMING_PNG = "timing.png"
CRITIC_PNG = "critic.png"
#: A GPU's line has at most this many points; a longer series (a week of 10 s samples is 60,000) is
#: drawn as the means of that many equal spans, which is all a plot this wide shows.
MAX_GPU_POINTS = 2000


def gpu_png(index: int) -> str:
    """File name of the ``index``-th host's GPU plot (1-based, in the report's order of hosts)."""
    return f"gpu_node_{index}.png"


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # no display on workers
    import matplotlib.pyplot as plt

    return plt


def _line(ax: Any, rows: list[StepRow], name: str, label: str, **style: Any) -> bool:
    points = [(r.step, r.metrics[name]) for r in rows if name in r.metrics]
    if points:
        ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)
    return bool(points)


def _attempt_marks(ax: Any, attempts: list[AttemptInfo]) -> None:
    for a in attempts[1:]:
        if a.first_step is not None:
            ax.axvline(a.first_step - 0.5, color="dimgrey", linestyle="--", linewidth=1, zorder=5)
            what = f"segment {a.segment}, merged" if a.segment > 1 else f"from step {a.resumed_from_step}"
            ax.annotate(f"attempt {a.attempt}\n({what})", (a.first_step - 0.5, 1),
                        xycoords=("data", "axes fraction"), fontsize=7, va="top", ha="left", color="dimgrey",
                        zorder=6, bbox={"facecolor": "white", "alpha": 0.8, "linewidth": 0})


def _reward(ax: Any, rows: list[StepRow]) -> bool:
    drawn = _line(ax, rows, m.SCORE, "train: " + m.SCORE, marker=".")
    val = sorted({k for r in rows for k in r.metrics if k.startswith(m.VAL_CORE_PREFIX)})
    for name in val:
        drawn = _line(ax, rows, name, name, marker="o", linestyle=":") or drawn
    ax.set_ylabel("reward")
    return drawn


def _response_length(ax: Any, rows: list[StepRow]) -> bool:
    drawn = _line(ax, rows, m.RESPONSE_LENGTH, "mean", marker=".")
    _line(ax, rows, m.RESPONSE_LENGTH_MAX, "max", linestyle=":")
    ax.set_ylabel("response length (tokens)")
    return drawn


def _throughput(ax: Any, rows: list[StepRow]) -> bool:
    drawn = _line(ax, rows, m.THROUGHPUT_PER_GPU, "perf/throughput (per GPU)", marker=".")
    ax.set_ylabel("tokens / s / GPU")
    return drawn


def _timing(ax: Any, rows: list[StepRow]) -> bool:
    """The step's own phases stacked under the step's time; what verl times apart from the step
    (validation) as its own dashed line, never stacked on the step."""
    rows = training_rows(rows)  # a row of validation alone (step 0) is no step of 0 s
    phases = [k for k in timing_names(rows, in_step=True) if k != m.TIMING_STEP]
    if not phases:
        return False
    steps = [r.step for r in rows]
    ax.stackplot(steps, [[r.metrics.get(k, 0.0) for r in rows] for k in phases],
                 labels=[k[len(m.TIMING_PREFIX):] for k in phases], alpha=0.8)
    _line(ax, rows, m.TIMING_STEP, "step (total)", color="black", linewidth=1)
    for k in timing_names(rows, in_step=False):
        _line(ax, rows, k, f"{k[len(m.TIMING_PREFIX):]} (apart from the step)", linestyle="--", marker="x")
    ax.set_ylabel("seconds")
    return True


def _critic(ax: Any, rows: list[StepRow]) -> bool:
    """The value loss on the left axis; the explained variance and the values' mean (other scales) on
    the right, each also entered in the left axis' legend (an empty line of its colour)."""
    drawn = _line(ax, rows, m.CRITIC_VF_LOSS, m.CRITIC_VF_LOSS, marker=".", color="tab:red")
    ax.set_ylabel("value loss")
    right = ax.twinx()
    for name, color in ((m.CRITIC_EXPLAINED_VAR, "tab:blue"), (m.CRITIC_VALUES_MEAN, "tab:green")):
        if _line(right, rows, name, name, marker="o", linestyle=":", color=color):
            ax.plot([], [], marker="o", linestyle=":", color=color, label=f"{name} (right)")
            drawn = True
    return drawn


PLOTS: dict[str, tuple[str, Callable[[Any, list[StepRow]], bool]]] = {
    REWARD_PNG: ("Reward per step (train score, validation)", _reward),
    RESPONSE_LENGTH_PNG: ("Response length per step", _response_length),
    THROUGHPUT_PNG: ("Throughput per step", _throughput),
    TIMING_PNG: ("Time per step by phase (timing_s/*)", _timing),
    CRITIC_PNG: ("Critic per step (PPO: value loss, explained variance, values)", _critic),
}


def _save_png(fig: Any, path: Path) -> None:
    """``fig`` laid out and written to ``path`` under a temporary name, then renamed: a reader of the
    report (the API server's page) never gets half a PNG."""
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)


def draw(rows: list[StepRow], attempts: list[AttemptInfo], out_dir: Path) -> dict[str, str]:
    """Draw every plot the metrics allow into ``out_dir``; ``{file name: title}`` of those drawn."""
    if not rows:
        return {}
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for name, (title, plot) in PLOTS.items():
        fig, ax = plt.subplots(figsize=(7, 3.6), dpi=100)
        try:
            if plot(ax, rows):
                _attempt_marks(ax, attempts)
                ax.set_title(title)
                ax.set_xlabel("step")
                ax.grid(alpha=0.3)
                ax.legend(fontsize=7, loc="best")
                _save_png(fig, out_dir / name)
                drawn[name] = title
        finally:
            plt.close(fig)
    return drawn


def thinned(xs: Any, ys: Any, max_points: int = MAX_GPU_POINTS) -> tuple[Any, Any]:
    """``(xs, ys)`` with at most ``max_points`` points: the means of equal spans of the samples (NaN
    values left out of the means)."""
    import numpy as np

    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    if len(x) <= max_points:
        return x, y
    edges = np.linspace(0, len(x), max_points + 1).astype(int)
    starts = edges[:-1]
    counts = np.diff(edges)
    known = ~np.isnan(y)
    sums = np.add.reduceat(np.where(known, y, 0.0), starts)
    seen = np.add.reduceat(known.astype(float), starts)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.add.reduceat(x, starts) / counts, sums / seen


def _gpu_host(axes: Any, gpus: list[GpuSeries], windows: list[Window], attempts: list[AttemptInfo],
              origin: float) -> None:
    """Utilisation (top) and memory (bottom) of each GPU of one host, in minutes since ``origin``."""
    import numpy as np

    util_ax, mem_ax = axes
    for g in gpus:
        minutes = (np.asarray(g.times) - origin) / 60
        label = f"GPU {g.index}" + (f" ({len(g.node_ids)} Ray node ids)" if len(g.node_ids) > 1 else "")
        (line,) = util_ax.plot(*thinned(minutes, g.utilization_pct), label=label, linewidth=1)
        if g.memory_total_mib:
            memory_pct = np.asarray(g.memory_used_mib) * (100.0 / g.memory_total_mib)
            mem_ax.plot(*thinned(minutes, memory_pct), label=label, linewidth=1, color=line.get_color())
    util_ax.axhline(MIN_GPU_UTILIZATION_PCT, color="firebrick", linestyle="--", linewidth=1,
                    label=f"{MIN_GPU_UTILIZATION_PCT:.0f}% (target: above)")
    for ax in axes:
        for n, (start, end) in enumerate(windows):
            ax.axvspan((start - origin) / 60, (end - origin) / 60, color="tab:green", alpha=0.08,
                       label="training" if n == 0 else None)
        for n, a in enumerate(attempts):
            ax.axvline((a.submitted_at - origin) / 60, color="dimgrey", linestyle=":", linewidth=1,
                       label="attempt submitted" if n == 0 else None)
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3)
    util_ax.set_ylabel("utilisation %")
    mem_ax.set_ylabel("memory used %")
    mem_ax.set_xlabel("minutes since the first submit" if attempts else "minutes since the first reading")
    util_ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside: 8 GPUs' lines


def draw_gpu(series: list[GpuSeries], windows: list[Window], attempts: list[AttemptInfo],
             out_dir: Path) -> dict[str, str]:
    """One plot per host (each of its GPUs' utilisation and memory over time, the training window
    shaded, each attempt's submission dotted); ``{host address: file name}`` of those drawn."""
    hosts = by_host([s for s in series if s.times])
    if not hosts:
        return {}
    origin = min(a.submitted_at for a in attempts) if attempts else min(s.times[0] for s in series if s.times)
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for index, (host, gpus) in enumerate(hosts.items(), start=1):
        name = gpu_png(index)
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(8, 4.8), dpi=100)
        try:
            _gpu_host(axes, gpus, windows, attempts, origin)
            axes[0].set_title(f"GPU utilisation and memory, host {host or '(address unknown)'}")
            _save_png(fig, out_dir / name)
            drawn[host] = name
        finally:
            plt.close(fig)
    return drawn
