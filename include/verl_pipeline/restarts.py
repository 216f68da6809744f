"""The run profile's ``restarts:`` section: what a run affords in restarts after infrastructure failures.

A restart that follows an attempt which made progress (its checkpoint moved on) is always granted;
only attempts *in a row* that made none (the same checkpoint, a crash before the first step) use up
``no_progress_limit``. The delay before a restart grows with those attempts only, so a run that
keeps training pays ``delay`` for each failure, however many it has had. The budget itself is kept
from the run's records by :mod:`verl_pipeline.jobs.restart_budget`; ``jobs.outcome.decide`` decides with it.

.. code-block:: yaml

    restarts:
      no_progress_limit: 2   # attempts in a row without progress that are restarted; one more fails the run
      delay: 20s             # before a restart after progress; x2 per attempt in a row without progress
      max_delay: 10m         # the most a restart waits
      reprobe: on_change     # or always: probe the nodes again before every restart (jobs/reprobe.py)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from verl_pipeline.durations import duration_setting, format_duration
from verl_pipeline.exceptions import ConfigError, section_of

#: The run profile's section and its keys.
SECTION = "restarts"
_KEYS = ("no_progress_limit", "delay", "max_delay", "reprobe")


class Reprobe(str, Enum):
    """Whether a restart probes the nodes again (``restarts: reprobe``)."""

    #: Only when something may have changed on them (:mod:`verl_pipeline.jobs.reprobe` decides).
    ON_CHANGE = "on_change"
    #: Before every restart, as before the first attempt.
    ALWAYS = "always"


@dataclass(frozen=True)
class RestartPolicy:
    """How many restarts without progress a run affords, and how long it waits before each restart."""

    #: Attempts in a row without progress that are still restarted; the next one fails the run.
    no_progress_limit: int = 2
    #: Seconds before a restart after an attempt that made progress.
    delay_s: float = 20.0
    #: The longest wait before a restart.
    max_delay_s: float = 600.0
    #: Whether a restart probes the nodes again or may reuse the run's last probe (``jobs/reprobe.py``).
    reprobe: Reprobe = Reprobe.ON_CHANGE

    def __post_init__(self) -> None:
        object.__setattr__(self, "reprobe", Reprobe(self.reprobe))  # from a frozen spec's string

    def delay(self, no_progress: int) -> float:
        """Seconds to wait before the restart after ``no_progress`` attempts in a row without progress
        (0: the attempt that failed made progress): ``delay`` doubled per such attempt, at most ``max_delay``."""
        return float(min(self.max_delay_s, self.delay_s * 2 ** max(0, no_progress)))

    def describe(self) -> str:
        return (f"{self.no_progress_limit} restart(s) in a row without progress, any number after progress; "
                f"delay {format_duration(self.delay_s)} doubled per attempt without progress, "
                f"at most {format_duration(self.max_delay_s)}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "reprobe": self.reprobe.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> RestartPolicy:
        return cls(**(data or {}))

    @classmethod
    def from_profile(cls, section: Any, profile: str) -> RestartPolicy:
        """The policy of a run profile's ``restarts:`` section (absent: the defaults)."""
        where = f"profiles/{profile}.{SECTION}"
        section = section_of(section, where, _KEYS, what="restarts setting", example="restarts: {no_progress_limit: 2}")
        if section is None:
            return cls()
        out: dict[str, Any] = {}
        limit = section.get("no_progress_limit")
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ConfigError(f"{where}.no_progress_limit", limit, "must be a whole number of at least 0",
                                  "no_progress_limit: 2 (0: fail at the first attempt that makes no progress)")
            out["no_progress_limit"] = limit
        for key in ("delay", "max_delay"):
            if section.get(key) is not None:
                out[f"{key}_s"] = duration_setting(f"{where}.{key}", section[key], positive=False, also=", or 0s")
        reprobe = section.get("reprobe")
        if reprobe is not None:
            if reprobe not in {r.value for r in Reprobe}:
                raise ConfigError(f"{where}.reprobe", reprobe, "is not one of " + ", ".join(r.value for r in Reprobe),
                                  "reprobe: on_change (the default) or reprobe: always")
            out["reprobe"] = Reprobe(reprobe)
        policy = cls(**out)
        if policy.max_delay_s < policy.delay_s:
            raise ConfigError(f"{where}.max_delay", format_duration(policy.max_delay_s),
                              f"is shorter than delay ({format_duration(policy.delay_s)})",
                              f"max_delay: {format_duration(max(policy.delay_s, 600))}")
        return policy


__all__ = ["SECTION", "Reprobe", "RestartPolicy"]
