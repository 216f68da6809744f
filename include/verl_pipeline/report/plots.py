"""The run report's PNG plots (matplotlib, Agg backend, imported only when plots are drawn).

Every plot of verl's metrics is per step, with the start of every resumed attempt marked (a dashed
line labelled with the step it resumed from). A plot whose metrics verl did not report is not drawn.
Each node with GPU readings gets its own plot over time (:func:`draw_gpu`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.gpu_usage import NodeGpuSample
from verl_pipeline.report.build import AttemptInfo, StepRow, timing_names, training_rows
from verl_pipeline.report.gpu import NodeGpuSummary, Window, by_node
from verl_pipeline.report.scaling import MIN_GPU_UTILIZATION_PCT
from verl_pipeline.trainer import metrics as m

log = logging.getLogger(__name__)

#: File name of each plot in the report directory, by what it shows.
REWARD_PNG = "reward.png"
RESPONSE_LENGTH_PNG = "response_length.png"
THROUGHPUT_PNG = "throughput.png"
TIMING_PNG = "timing.png"
CRITIC_PNG = "critic.png"


def gpu_png(index: int) -> str:
    """File name of the ``index``-th node's GPU plot (1-based, in the report's order of nodes)."""
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
                fig.tight_layout()
                tmp = out_dir / f".{name}.tmp"
                fig.savefig(tmp, format="png")
                tmp.replace(out_dir / name)
                drawn[name] = title
        finally:
            plt.close(fig)
    return drawn


def _gpu_node(axes: Any, samples: list[NodeGpuSample], windows: list[Window], attempts: list[AttemptInfo],
              origin: float) -> None:
    """Utilisation (top) and memory (bottom) of each GPU of one node, in minutes since ``origin``."""
    util_ax, mem_ax = axes
    util: dict[int, tuple[list[float], list[float]]] = {}
    mem: dict[int, tuple[list[float], list[float]]] = {}
    for s in samples:  # one pass: a multi-day run has tens of thousands of samples per node
        minutes = (s.time - origin) / 60
        for g in s.gpus:
            for series, value in ((util, g.utilization_pct), (mem, g.memory_pct)):
                if value is not None:
                    xs, ys = series.setdefault(g.index, ([], []))
                    xs.append(minutes)
                    ys.append(value)
    for index in sorted(util.keys() | mem.keys()):
        (line,) = util_ax.plot(*util.get(index, ([], [])), label=f"GPU {index}", linewidth=1)
        mem_ax.plot(*mem.get(index, ([], [])), label=f"GPU {index}", linewidth=1, color=line.get_color())
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


def draw_gpu(samples: list[NodeGpuSample], nodes: list[NodeGpuSummary], windows: list[Window],
             attempts: list[AttemptInfo], out_dir: Path) -> dict[str, str]:
    """One plot per node of ``nodes`` (its GPUs' utilisation and memory over time, the training window
    shaded, each attempt's submission dotted); ``{node id: file name}`` of those drawn."""
    samples_of = by_node(samples)
    if not nodes or not samples_of:
        return {}
    origin = min(a.submitted_at for a in attempts) if attempts else min(s.time for s in samples)
    plt = _pyplot()
    out_dir.mkdir(parents=True, exist_ok=True)
    drawn = {}
    for index, node in enumerate(nodes, start=1):
        if not samples_of.get(node.node_id):
            continue
        name = gpu_png(index)
        fig, axes = plt.subplots(2, 1, sharex=True, figsize=(8, 4.8), dpi=100)
        try:
            _gpu_node(axes, samples_of[node.node_id], windows, attempts, origin)
            axes[0].set_title(f"GPU utilisation and memory, node {node.label}")
            fig.tight_layout()
            tmp = out_dir / f".{name}.tmp"
            fig.savefig(tmp, format="png")
            tmp.replace(out_dir / name)
            drawn[node.node_id] = name
        finally:
            plt.close(fig)
    return drawn
