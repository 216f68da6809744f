"""The hang watchdog: a training job RUNNING with no new step for too long is hung.

A collective waiting forever on a peer (every node alive, the job RUNNING, no output) is the hang
nothing else notices. The rule, in one place:

- before the job's first step: ``startup_timeout`` (model loading, rollout engine start and the
  first rollout are slow; default 2 h);
- after a step: ``stall_timeout`` — fixed when the profile sets it, else derived from the step
  times seen: ``max(min_stall_timeout, stall_factor * the slowest step)`` (default
  ``max(30 min, 5 * slowest)``), so a run whose steps take 20 min is not cut at 30.

Times are the waiter's monotonic clock: the windows start when a waiter starts watching, so a
restarted triggerer (whose waiter starts afresh) waits at most one more window, never less.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from verl_pipeline.durations import format_duration
from verl_pipeline.spec import WatchSettings


@dataclass(frozen=True)
class Hang:
    """A job hung: what the wait's decision reads (carried in the trigger event's ``hang``)."""

    #: The last training step seen; None: no step yet (the startup window ran out).
    last_step: int | None
    #: Seconds without a new step: since the last one, or since watching began before the first.
    waited_s: float
    #: The limit that ran out: the stall limit after a step, ``startup_timeout_s`` before the first.
    limit_s: float

    @property
    def reason(self) -> str:
        """What happened, as the decision names the failure (and the stop record keeps it)."""
        if self.last_step is None:
            return f"hang: no training step within {format_duration(self.waited_s)} of the start"
        return f"hang: no training step for {format_duration(self.waited_s)}, last step {self.last_step}"

    @property
    def limit(self) -> str:
        """The limit that ran out, named as the run profile's ``watch:`` sets it."""
        if self.last_step is None:
            return f"watch.startup_timeout {format_duration(self.limit_s)}"
        return f"stall limit {format_duration(self.limit_s)}"

    @property
    def message(self) -> str:
        return f"{self.reason} ({self.limit})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Hang | None:
        """From an event's ``hang`` (None: absent, as in events of triggers of an earlier release)."""
        if not isinstance(data, dict):
            return None
        last = data.get("last_step")
        return cls(last_step=None if last is None else int(last), waited_s=float(data["waited_s"]),
                   limit_s=float(data["limit_s"]))


class StallWatch:
    """Follows one job's steps on a caller-supplied clock; :meth:`hang` says when it is hung.

    :param started_at: when watching began (the startup window's start).
    :param last_step: the step a previous waiter had seen (a reattach): counts as a step seen now.
    """

    def __init__(self, settings: WatchSettings, started_at: float, last_step: int | None = None) -> None:
        self.settings = settings
        self.started_at = started_at
        self.last_step = last_step
        self.last_step_at: float | None = started_at if last_step is not None else None
        self.slowest_s: float | None = None

    def step(self, step: int, now: float, seconds: float | None = None) -> None:
        """A step newer than any seen arrived at ``now``; ``seconds``: its duration as verl reports it."""
        if self.last_step is not None and step <= self.last_step:
            return
        gap = now - self.last_step_at if self.last_step_at is not None else None
        for value in (seconds, gap):
            if value is not None and value > 0:
                self.slowest_s = max(self.slowest_s or 0.0, value)
        self.last_step, self.last_step_at = step, now

    def hang(self, now: float) -> Hang | None:
        """The hang at ``now``, or None while the job is within its window."""
        if self.last_step_at is None:
            waited = now - self.started_at
            if waited > self.settings.startup_timeout_s:
                return Hang(last_step=None, waited_s=waited, limit_s=self.settings.startup_timeout_s)
            return None
        waited = now - self.last_step_at
        limit = self.settings.stall_limit(self.slowest_s)
        if waited > limit:
            return Hang(last_step=self.last_step, waited_s=waited, limit_s=limit)
        return None
