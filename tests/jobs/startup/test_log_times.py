"""When a line of a verl job's log was printed, from the stamps verl's and vLLM's loggers write."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from verl_pipeline.jobs.startup.log_times import CLOCK_SKEW_S, MAX_LAG_S, printed_at

# The lines as a 0.5B GRPO run on the H200 (2026-12-05) forwarded them, Ray's actor prefix included.
VERL = "\x1b[36m(TaskRunnerV1 pid=3221)\x1b[0m INFO:2026-12-05 10:29:23,189:create worker group dict_keys(['actor'])"
VLLM = ("\x1b[36m(vLLMHttpServer pid=4546)\x1b[0m (EngineCore pid=4857) INFO 12-05 10:31:39 "
        "[kv_cache_utils.py:2146] GPU KV cache size: 9,560,512 tokens")


def _epoch(text: str, zone_h: float = 0.0) -> float:
    """``text`` (``2026-12-05 10:29:23``) as a wall clock ``zone_h`` hours from UTC, in epoch seconds."""
    local = datetime.fromisoformat(text).replace(tzinfo=timezone(timedelta(hours=zone_h)))
    return local.timestamp()


def test_a_verl_line_is_timed_to_the_millisecond_and_a_vllm_line_to_the_second() -> None:
    assert printed_at(VERL, _epoch("2026-12-05 10:29:31")) == pytest.approx(_epoch("2026-12-05 10:29:23") + 0.189)
    assert printed_at(VLLM, _epoch("2026-12-05 10:31:45.5")) == _epoch("2026-12-05 10:31:39")


@pytest.mark.parametrize("zone_h", [-8.0, 5.5, 5.75, 14.0, -12.0])
def test_the_nodes_time_zone_is_read_from_the_arrival(zone_h: float) -> None:
    """The stamp is the node's local time; the same instant arrives 7 s later at the waiter (epoch seconds)."""
    printed = _epoch("2026-12-05 10:29:23.189", zone_h)
    assert printed_at(VERL, printed + 7.0) == pytest.approx(printed)
    printed = _epoch("2026-12-05 10:31:39", zone_h)
    assert printed_at(VLLM, printed + 7.0) == printed


def test_a_stamp_that_does_not_fit_its_arrival_gives_no_time() -> None:
    printed = _epoch("2026-12-05 10:29:23.189")
    assert printed_at(VERL, printed + MAX_LAG_S) == pytest.approx(printed)
    assert printed_at(VERL, printed + MAX_LAG_S + 5) is None  # too old: the arrival times it
    assert printed_at(VERL, printed - CLOCK_SKEW_S - 1) is None  # from the future beyond the clocks' skew
    assert printed_at(VERL, printed + 30 * 3600) is None  # no time zone is 30 hours off
    # vLLM's stamp has no year: a line of 12-31 read on 1 January is read in the wrong year, not timed.
    assert printed_at(VLLM.replace("12-05", "12-31"), _epoch("2027-01-01 00:00:05")) is None
    assert printed_at(VLLM.replace("12-05", "02-29"), _epoch("2026-03-01 00:00:05")) is None  # no such day


@pytest.mark.parametrize("line", [
    "(TaskRunnerV1 pid=3221) (\"Initial validation metrics: {'val-aux/openai/gsm8k/reward/mean@1': \"",
    "step:1 - actor/pg_loss:np.float64(0.1)",
    "LLMServerManager: ['127.0.0.1:8000']",
])
def test_a_line_without_a_stamp_has_no_time(line: str) -> None:
    assert printed_at(line, _epoch("2026-12-05 10:29:31")) is None
