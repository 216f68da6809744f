"""When a line of a verl job's log was printed, read from the line itself.

The waiter sees a line when it reads the log (every other poll: 10 s at the default 5 s polls), so a
time taken at the read is up to a read late. Most lines that end a start's phases carry the time
their logger wrote them, to the millisecond or the second:

- verl 0.9.1's logger: ``INFO:2026-12-05 10:29:23,189:create worker group …`` (``%(levelname)s:%(asctime)s:``);
- vLLM 0.24's: ``INFO 12-05 10:31:39 [kv_cache_utils.py:2146] GPU KV cache size: …`` (no year).

Both are the wall-clock time of the process that printed, in its node's local time zone, which the
waiter does not know. A time zone is a whole number of quarter hours from UTC, and a line arrives
within :data:`MAX_LAG_S` of its printing, so the line's time read as UTC is off from its arrival by a
zone plus a lag shorter than half a quarter hour: rounding the difference to quarter hours gives the
zone. A time is kept only where the line then arrived between :data:`CLOCK_SKEW_S` before and
:data:`MAX_LAG_S` after it; any other line (no stamp, one too old, a vLLM line whose year is not the
arrival's) has no time here, and its reader falls back to the arrival.
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timezone

#: How long after its printing a line may reach the waiter and still be timed by its stamp: reads
#: come seconds apart, and a waiter that takes over re-reads the last 30 s of log.
MAX_LAG_S = 300.0
#: How far the job's nodes' clocks and the waiter's may disagree (NTP keeps them well within it).
CLOCK_SKEW_S = 2.0
#: Time zones are whole quarter hours from UTC, at most 14 hours either way.
_ZONE_STEP_S = 900
_MAX_ZONE_S = 14 * 3600

# verl's logging format ``%(levelname)s:%(asctime)s:%(message)s``: the year, milliseconds after a comma.
_VERL = re.compile(r"\b[A-Z]+:(\d{4})-(\d\d)-(\d\d) (\d\d):(\d\d):(\d\d),(\d{3}):")
# vLLM's ``%(levelname)s %(asctime)s [%(fileinfo)s:%(lineno)d]`` with ``%m-%d %H:%M:%S``: no year.
_VLLM = re.compile(r"\b[A-Z]+ (\d\d)-(\d\d) (\d\d):(\d\d):(\d\d) \[")


def _stamp_as_utc(line: str, year: int) -> float | None:
    """The line's stamp read as UTC (epoch seconds); None without one (or a date that does not exist)."""
    verl = _VERL.search(line)
    if verl:
        y, mo, d, h, mi, s, ms = (int(g) for g in verl.groups())
        parts, fraction = (y, mo, d, h, mi, s), ms / 1000
    else:
        vllm = _VLLM.search(line)
        if not vllm:
            return None
        mo, d, h, mi, s = (int(g) for g in vllm.groups())
        parts, fraction = (year, mo, d, h, mi, s), 0.0
    try:
        return datetime(*parts, tzinfo=timezone.utc).timestamp() + fraction
    except ValueError:  # no such date (a vLLM line of 02-29 read in another year)
        return None


def printed_at(line: str, arrived: float) -> float | None:
    """When ``line`` was printed (epoch seconds), from its own stamp, given that it reached the waiter at
    ``arrived``; None where the line has no stamp or its stamp does not fit its arrival."""
    naive = _stamp_as_utc(line, time.gmtime(arrived).tm_year)
    if naive is None:
        return None
    zone = round((arrived - naive) / _ZONE_STEP_S) * _ZONE_STEP_S
    at = naive + zone
    if abs(zone) > _MAX_ZONE_S or not -CLOCK_SKEW_S <= arrived - at <= MAX_LAG_S:
        return None
    return at
