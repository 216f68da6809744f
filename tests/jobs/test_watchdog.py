from __future__ import annotations

import json

import pytest

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.gpu_usage import GpuReading, NodeGpuSample
from verl_pipeline.jobs.progress import GpuSummary
from verl_pipeline.jobs.watchdog import (
    GpuActivity,
    Hang,
    NodeWatch,
    StallWatch,
    WatchSettings,
    gpu_activity,
    speaks_of_a_death,
)

MIN = 60.0


def said(hang: Hang | None) -> str | None:
    """What the task log says of a hang (its message), None for no hang."""
    return hang.message if hang is not None else None


def test_defaults_are_two_hours_to_the_first_step_then_max_30_min_or_5x_the_slowest_step() -> None:
    s = WatchSettings()
    assert s.startup_timeout_s == 2 * 3600
    assert s.stall_limit(None) == 30 * MIN
    assert s.stall_limit(3 * MIN) == 30 * MIN
    assert s.stall_limit(20 * MIN) == 100 * MIN  # slow steps are not cut at 30 min


def test_startup_window_before_the_first_step() -> None:
    w = StallWatch(WatchSettings(startup_timeout_s=600), started_at=1000.0)
    assert w.hang(1000.0 + 600) is None
    assert said(w.hang(1000.0 + 601)) == "hang: no training step within 10m1s of the start (watch.startup_timeout 10m)"


def test_a_stall_after_steps_names_the_last_step_and_the_limit() -> None:
    w = StallWatch(WatchSettings(min_stall_timeout_s=30 * MIN), started_at=0.0)
    t = 0.0
    for step in range(1, 119):
        t += 3 * MIN
        w.step(step, t, seconds=3 * MIN)
    assert w.hang(t + 30 * MIN) is None
    assert said(w.hang(t + 42 * MIN)) == "hang: no training step for 42m, last step 118 (stall limit 30m)"


def test_the_limit_grows_with_the_slowest_step_seen_by_gap_or_by_verls_own_timing() -> None:
    w = StallWatch(WatchSettings(min_stall_timeout_s=60, stall_factor=5), started_at=0.0)
    w.step(1, 10.0)
    w.step(2, 110.0)  # a 100 s gap between steps
    assert w.hang(110.0 + 499) is None and w.hang(110.0 + 501) is not None
    w.step(3, 120.0, seconds=200.0)  # verl says the step took 200 s
    assert w.hang(120.0 + 999) is None and w.hang(120.0 + 1001) is not None


def test_a_fixed_stall_timeout_wins_and_old_steps_do_not_reset_the_clock() -> None:
    w = StallWatch(WatchSettings(stall_timeout_s=100), started_at=0.0, last_step=7)
    w.step(20, 50.0, seconds=10_000)
    w.step(20, 140.0)  # the same step seen again (the console line after the metrics file)
    w.step(5, 140.0)
    assert said(w.hang(151.0)) == "hang: no training step for 1m41s, last step 20 (stall limit 1m40s)"


def test_a_reattached_waiter_counts_the_carried_step_as_seen_at_its_start() -> None:
    w = StallWatch(WatchSettings(startup_timeout_s=10, min_stall_timeout_s=50), started_at=500.0, last_step=3)
    assert w.hang(540.0) is None  # not the startup window: step 3 was seen
    assert "last step 3" in (said(w.hang(551.0)) or "")


def test_a_hang_carries_what_the_decision_reads_and_travels_as_json() -> None:
    w = StallWatch(WatchSettings(stall_timeout_s=100), started_at=0.0)
    w.step(7, 10.0)
    hang = w.hang(160.0)
    assert hang == Hang(last_step=7, waited_s=150.0, limit_s=100.0)
    assert (hang.reason, hang.limit) == ("hang: no training step for 2m30s, last step 7", "stall limit 1m40s")
    assert Hang.from_dict(json.loads(json.dumps(hang.to_dict()))) == hang
    before_the_first = StallWatch(WatchSettings(startup_timeout_s=60), started_at=0.0).hang(90.0)
    assert before_the_first == Hang(last_step=None, waited_s=90.0, limit_s=60.0)
    assert Hang.from_dict(json.loads(json.dumps(before_the_first.to_dict()))) == before_the_first
    assert before_the_first.limit == "watch.startup_timeout 1m"
    assert Hang.from_dict(None) is None  # an event of a trigger of an earlier release


def test_profile_section() -> None:
    s = WatchSettings.from_profile({"stall_timeout": "45m", "startup_timeout": "3h"}, "p")
    assert (s.stall_timeout_s, s.startup_timeout_s) == (45 * MIN, 3 * 3600)
    assert WatchSettings.from_profile({"stall_timeout": "auto", "stall_factor": 8}, "p").stall_factor == 8
    assert WatchSettings.from_profile(None, "p") == WatchSettings()
    assert "45m" in WatchSettings.from_profile({"stall_timeout": "45m"}, "p").describe()


@pytest.mark.parametrize(("section", "key"), [
    ({"stall_timeout": "soon"}, "profiles/p.watch.stall_timeout"),
    ({"stall_timeout": 30}, "profiles/p.watch.stall_timeout"),
    ({"startup_timeout": "0m"}, "profiles/p.watch.startup_timeout"),
    ({"stall_factor": 0.5}, "profiles/p.watch.stall_factor"),
    ({"stall_timout": "30m"}, "profiles/p.watch.stall_timout"),
    (["30m"], "profiles/p.watch"),
])
def test_bad_settings_name_the_key(section: object, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        WatchSettings.from_profile(section, "p")
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_a_profiles_watch_section_reaches_the_run_spec() -> None:
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": "gsm8k-qwen2.5-0.5b-ppo"}, run_name="t/watch")
    assert spec.watch == WatchSettings(stall_timeout_s=None, startup_timeout_s=7200, min_stall_timeout_s=1800,
                                       stall_factor=5)
    assert spec.to_dict()["watch"]["startup_timeout_s"] == 7200


# -- the GPUs as a hang's evidence ------------------------------------------------------------------
def _gpus(*utils: float | None, per_node: int = 8) -> GpuSummary | None:
    """One reading of nodes of ``per_node`` GPUs with these utilisations (in order)."""
    readings = [GpuReading(i % per_node, u, 1000.0, 143771.0) for i, u in enumerate(utils)]
    return GpuSummary.of([NodeGpuSample(0.0, f"n{k}", f"10.0.0.{k}", tuple(readings[k:k + per_node]))
                          for k in range(0, len(readings), per_node)])


def test_idle_and_busy_gpus_during_a_hang_point_to_different_causes() -> None:
    idle, busy, uneven = _gpus(*[0.0] * 15, 3.0), _gpus(*[100.0] * 16), _gpus(100.0, 0.0, 100.0, 0.0)
    assert idle is not None and busy is not None and uneven is not None
    assert [gpu_activity(g) for g in (idle, busy, uneven)] == [GpuActivity.IDLE, GpuActivity.BUSY,
                                                               GpuActivity.UNEVEN]
    hang = Hang(last_step=118, waited_s=42 * MIN, limit_s=30 * MIN, gpu=idle)
    assert hang.reason == "hang: no training step for 42m, last step 118"  # the decision's name: unchanged
    assert hang.message.startswith("hang: no training step for 42m, last step 118 (stall limit 30m; GPUs idle "
                                   "(0% to 3%, mean 0% on 16 GPUs of 2 nodes): nothing runs on them")
    assert "a peer that is gone" in hang.message and "spins" not in hang.message
    busy_hang = Hang(last_step=None, waited_s=3 * 3600.0, limit_s=2 * 3600.0, gpu=busy)
    assert "GPUs busy (100% to 100%, mean 100% on 16 GPUs of 2 nodes): kernels run and no step ends" in \
        busy_hang.message
    assert "NCCL collective waiting for a peer that never joins spins at 100%" in busy_hang.message
    assert "GPUs uneven (0% to 100%, mean 50% on 4 GPUs of 1 node)" in Hang(7, 200.0, 100.0, gpu=uneven).message
    # Without a reading (no GPU, or a cluster the waiter does not read), the message is the limit alone.
    assert Hang(7, 200.0, 100.0).message == "hang: no training step for 3m20s, last step 7 (stall limit 1m40s)"


def test_a_hang_with_its_gpus_travels_as_json() -> None:
    hang = Hang(last_step=7, waited_s=150.0, limit_s=100.0, gpu=_gpus(95.0, 99.0))
    again = Hang.from_dict(json.loads(json.dumps(hang.to_dict())))
    assert again == hang and again is not None and again.detail == hang.detail
    # An event of a trigger of the earlier release has no ``gpu``.
    assert Hang.from_dict({"last_step": 7, "waited_s": 150.0, "limit_s": 100.0}) == Hang(7, 150.0, 100.0)


def test_gpus_that_report_no_utilisation_are_no_evidence() -> None:
    assert _gpus(None, None) is None and GpuSummary.of([]) is None


# -- counting the nodes -------------------------------------------------------------------------------
def _polls_until_lost(watch: NodeWatch, alive_per_poll: list[int], reasons: frozenset[int] = frozenset()) -> int | None:
    """The poll (1-based) on which ``watch`` reports a loss, counting when it says so."""
    for poll, alive in enumerate(alive_per_poll, start=1):
        if watch.due(reason=poll in reasons) and watch.counted(alive):
            return poll
    return None


def test_nodes_are_counted_every_other_poll_while_all_are_alive() -> None:
    watch = NodeWatch(expected=2, grace_polls=3)
    assert [watch.due() and not watch.counted(2) for _ in range(8)] == [False, True] * 4  # from the second


@pytest.mark.parametrize("grace", [1, 2, 3, 5])
@pytest.mark.parametrize("lost_after", range(1, 7))
def test_a_lost_node_is_reported_at_most_one_poll_later_than_counting_every_poll(grace: int, lost_after: int) -> None:
    """The node dies after poll ``lost_after``: counting every poll reports it ``grace`` polls later;
    the cadence at most one poll more, never less (the blip tolerance is kept)."""
    alive = [2] * lost_after + [1] * (grace + 3)
    every_poll = lost_after + grace
    reported = _polls_until_lost(NodeWatch(expected=2, grace_polls=grace), alive)
    assert reported is not None and every_poll <= reported <= every_poll + 1


def test_a_blip_shorter_than_the_grace_is_not_a_loss_and_a_death_in_the_log_counts_at_once() -> None:
    assert _polls_until_lost(NodeWatch(expected=2, grace_polls=3), [2, 1, 1, 2, 1, 1, 2] * 3) is None
    # A poll whose log says something died counts at once: the loss is reported as by counting every poll.
    assert _polls_until_lost(NodeWatch(expected=2, grace_polls=2), [2, 1, 1, 1, 1], reasons=frozenset({2})) == 3
    assert speaks_of_a_death("ray.exceptions.ActorDiedError: The actor died because its node has died.")
    assert speaks_of_a_death("The node with node id: abc has been marked dead because the detector has missed")
    assert not speaks_of_a_death("step:3 - training/global_step:3 - perf/throughput:1317.6")
