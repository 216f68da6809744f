"""The report's restart section: the run's restart budget and each restart decision (its ``restarts.jsonl``).

The wait task records every decision after an infrastructure failure (``jobs.restart_budget.RestartBudget.record``):
the attempt that failed, whether it moved the checkpoint on, how many attempts in a row had not, what
was left of the budget and how long the restart waited — or that the budget was used up. The
report shows them as recorded, one row per attempt (the last decision for it, when a later try
decided again): :class:`RestartSummary` here, its section of the page in ``report/html.py``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from verl_pipeline.jobs.restart_budget import RestartOutcome

_RESTART, _EXHAUSTED = RestartOutcome.RESTART.value, RestartOutcome.EXHAUSTED.value


@dataclass(frozen=True)
class RestartDecision:
    """One decision after an attempt's infrastructure failure."""

    attempt: int
    reason: str
    #: A :class:`~verl_pipeline.jobs.restart_budget.RestartOutcome` value (``exhausted``: the budget was used up,
    #: the run failed).
    outcome: str
    progressed: bool
    resumed_from: int
    checkpoint_after: int
    #: The last step the attempt logged; None: none.
    last_step: int | None
    #: Attempts in a row without progress, this one included.
    no_progress: int
    #: Restarts without progress left after this one.
    left: int
    delay_s: float

    @classmethod
    def from_record(cls, row: dict[str, Any]) -> RestartDecision:
        last = row.get("last_step")
        return cls(int(row.get("attempt", 0)), str(row.get("reason", "")), str(row.get("outcome", "")),
                   bool(row.get("progressed")), int(row.get("resumed_from", 0)), int(row.get("checkpoint_after", 0)),
                   None if last is None else int(last), int(row.get("no_progress", 0)), int(row.get("left", 0)),
                   float(row.get("delay_s", 0.0)))


@dataclass(frozen=True)
class RestartSummary:
    """The budget (the run profile's ``restarts: no_progress_limit``) and what the run used of it."""

    no_progress_limit: int
    decisions: list[RestartDecision] = field(default_factory=list)

    @property
    def restarts(self) -> int:
        return sum(d.outcome == _RESTART for d in self.decisions)

    @property
    def after_progress(self) -> int:
        return sum(d.outcome == _RESTART and d.progressed for d in self.decisions)

    @property
    def most_in_a_row(self) -> int:
        """The most attempts in a row without progress the run had (how close it came to the limit)."""
        return max((d.no_progress for d in self.decisions), default=0)

    @property
    def exhausted(self) -> bool:
        return any(d.outcome == _EXHAUSTED for d in self.decisions)

    def headline(self) -> str:
        if self.exhausted:
            last = self.decisions[-1]
            return (f"The restart budget was used up: {last.no_progress} attempts in a row made no progress, the "
                    f"last attempt {last.attempt} (restarts.no_progress_limit {self.no_progress_limit}); "
                    f"{self.restarts} restart(s) before it.")
        if not self.decisions:
            return (f"No restart. Budget: any number of restarts after attempts that move the checkpoint on, "
                    f"{self.no_progress_limit} in a row after attempts that do not.")
        return (f"{self.restarts} restart(s), {self.after_progress} after progress; at most {self.most_in_a_row} "
                f"attempt(s) in a row without progress, of the {self.no_progress_limit} the budget allows.")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "restarts": self.restarts, "after_progress": self.after_progress,
                "most_in_a_row": self.most_in_a_row, "exhausted": self.exhausted}


def summarise(records: list[dict[str, Any]], no_progress_limit: int) -> RestartSummary:
    """The run's restart decisions (``restarts.jsonl`` lines, oldest first), the last one per attempt."""
    last: dict[int, RestartDecision] = {}
    for row in records:
        d = RestartDecision.from_record(row)
        last[d.attempt] = d
    return RestartSummary(no_progress_limit, [last[a] for a in sorted(last)])

