"""Durations as profiles write them: ``"90s"``, ``"45m"``, ``"6h"``, ``"1d12h"`` (one rule for every setting)."""

from __future__ import annotations

import re
from typing import Any

from verl_pipeline.exceptions import ConfigError

_PART = re.compile(r"(\d+)([dhms])")
_UNIT_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
EXAMPLES = '"90s", "45m", "6h" or "1d12h"'


def parse_duration(text: str) -> int | None:
    """Seconds of a duration string, or None when ``text`` is not one (zero is a duration: 0)."""
    compact = text.strip().lower()
    if not compact or _PART.sub("", compact):
        return None
    return sum(int(n) * _UNIT_SECONDS[unit] for n, unit in _PART.findall(compact))


def format_duration(seconds: float) -> str:
    """The shortest duration string for whole ``seconds`` (``5400`` → ``"1h30m"``)."""
    rest, parts = int(seconds), []
    for unit, size in _UNIT_SECONDS.items():
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return "".join(parts) or "0s"


def duration_setting(key: str, value: Any, *, positive: bool, also: str = "") -> float:
    """Seconds of the profile setting ``key`` written as ``value``: a duration string, longer than zero when
    ``positive``; anything else is a one-line ConfigError naming the key (``also``: what else it accepts)."""
    seconds = parse_duration(value) if isinstance(value, str) else None
    if seconds is None or (positive and seconds == 0):
        rule = "is not a duration longer than zero" if positive else "is not a duration"
        raise ConfigError(key, value, rule, f"{key.rsplit('.', 1)[-1]}: one of {EXAMPLES}{also}")
    return float(seconds)
