"""The critic's part of a run report (PPO with GAE): did the value function learn, and what it cost.

A run without a critic (GRPO) logs none of these metrics and gets no critic section. Each metric is
summarised by its first and last value and its median over the training steps (a loss has no
"best" the way a reward has); the steps of a resumed attempt carry on from the checkpoint, so a
critic that was restored goes on from where the previous attempt left it, and one that started
again from scratch shows its first step's values once more (the plot marks each attempt's start).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from verl_pipeline.trainer import metrics as m


class StepRow(Protocol):
    """What is read of a report row (:class:`verl_pipeline.report.build.StepRow`, which builds on this module)."""

    @property
    def step(self) -> int: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


@dataclass(frozen=True)
class Trend:
    """A per-step metric from its first step to its last."""

    first: float
    first_step: int
    final: float
    final_step: int
    median: float


@dataclass(frozen=True)
class CriticSummary:
    #: By metric name (:data:`verl_pipeline.trainer.metrics.CRITIC_SERIES`), those the run logged.
    trends: dict[str, Trend] = field(default_factory=dict)
    #: Median seconds per step of ``timing_s/values`` and ``timing_s/update_critic``, by that name.
    timing_s: dict[str, float] = field(default_factory=dict)
    #: The critic's phases (values + update) as a share of all step time (a ratio of sums).
    share_of_step: float | None = None


def trend(rows: Sequence[StepRow], name: str) -> Trend | None:
    """``name`` over the rows that report it, None when none does (NaN values, which verl logs for a
    step without valid tokens, are skipped)."""
    points = [(r.step, r.metrics[name]) for r in rows if name in r.metrics and r.metrics[name] == r.metrics[name]]
    if not points:
        return None
    return Trend(first=points[0][1], first_step=points[0][0], final=points[-1][1], final_step=points[-1][0],
                 median=statistics.median(v for _, v in points))


def summarise(rows: Sequence[StepRow]) -> CriticSummary | None:
    """The critic section of the training ``rows`` (merged, one per step); None: the run had no critic."""
    trends = {name: t for name in m.CRITIC_SERIES if (t := trend(rows, name)) is not None}
    timed = {name: [r.metrics[name] for r in rows if name in r.metrics] for name in m.CRITIC_TIMINGS}
    if not trends and not any(timed.values()):
        return None
    timing = {name: statistics.median(values) for name, values in timed.items() if values}
    step_total = sum(r.metrics[m.TIMING_STEP] for r in rows if r.metrics.get(m.TIMING_STEP))
    critic_total = sum(r.metrics.get(name, 0.0) for r in rows if r.metrics.get(m.TIMING_STEP)
                       for name in m.CRITIC_TIMINGS)
    return CriticSummary(trends=trends, timing_s=timing,
                         share_of_step=critic_total / step_total if step_total and timing else None)
