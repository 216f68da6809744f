"""The run report's PNG plots (matplotlib, Agg backend, imported only when plots are drawn).

Every plot is per step, with the start of every resumed attempt marked (a dashed line labelled
with the step it resumed from). A plot whose metrics verl did not report is not drawn.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_pipeline.report.build import AttemptInfo, StepRow, timing_names, training_rows
from verl_pipeline.trainer import metrics as m

log = logging.getLogger(__name__)

#: File name of each plot in the report directory, by what it shows.
REWARD_PNG = "reward.png"
RESPONSE_LENGTH_PNG = "response_length.png"
THROUGHPUT_PNG = "throughput.png"
TIMING_PNG = "timing.png"


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


PLOTS: dict[str, tuple[str, Callable[[Any, list[StepRow]], bool]]] = {
    REWARD_PNG: ("Reward per step (train score, validation)", _reward),
    RESPONSE_LENGTH_PNG: ("Response length per step", _response_length),
    THROUGHPUT_PNG: ("Throughput per step", _throughput),
    TIMING_PNG: ("Time per step by phase (timing_s/*)", _timing),
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
