"""The restart budget: progress read from the run's records, attempts in a row without it counted, case by case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.fakes.fake_verl_trainer import save_checkpoint
from verl_pipeline.jobs.checkpoints import SEGMENTS_FILE, newest_run_step
from verl_pipeline.jobs.restart_budget import (
    AttemptProgress,
    RestartBudget,
    RestartOutcome,
    attempt_progress,
    renewed_after,
    run_budget,
)
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.rundir import Attempt, RunDir

POLICY = RestartPolicy(no_progress_limit=2, delay_s=20.0, max_delay_s=600.0)


def progress(n: int, resumed: int, after: int, last: int | None) -> AttemptProgress:
    return AttemptProgress(n, f"job-a{n}", resumed, after, last)


def budget(*attempts: AttemptProgress, policy: RestartPolicy = POLICY, renewed: int = 0) -> RestartBudget:
    return RestartBudget(policy, attempts, renewed)


def test_progress_is_the_checkpoint_moving_on_not_steps_logged() -> None:
    moved = progress(1, 0, 4, 5)
    assert moved.progressed and moved.describe() == "attempt 1 moved the checkpoint from step 0 to 4"
    before_first = progress(2, 4, 4, None)
    assert not before_first.progressed
    assert before_first.describe() == "attempt 2 ended before its first training step (checkpoint still at step 4)"
    # Steps trained but no checkpoint saved past the resume point: the next attempt trains them again.
    unsaved = progress(3, 4, 4, 5)
    assert not unsaved.progressed
    assert unsaved.describe() == "attempt 3 trained to step 5 but saved no checkpoint past step 4"


def test_a_run_that_keeps_making_progress_never_runs_out_and_pays_the_same_delay_each_time() -> None:
    """Five node losses, each after the attempt saved a checkpoint: five restarts, each after 20 s."""
    attempts = [progress(n, 2 * (n - 1), 2 * n, 2 * n + 1) for n in range(1, 6)]
    for n in range(1, 6):
        b = budget(*attempts[:n])
        assert (b.no_progress, b.exhausted, b.left, b.delay_s, b.restarts) == (0, False, 2, 20.0, n - 1)


def test_attempts_in_a_row_without_progress_are_counted_and_progress_starts_the_count_again() -> None:
    a1, a2, a3 = progress(1, 0, 4, 5), progress(2, 4, 4, None), progress(3, 4, 4, 4)
    assert (budget(a1, a2).no_progress, budget(a1, a2).left, budget(a1, a2).delay_s) == (1, 1, 40.0)
    assert (budget(a1, a2, a3).no_progress, budget(a1, a2, a3).left, budget(a1, a2, a3).delay_s) == (2, 0, 80.0)
    assert not budget(a1, a2, a3).exhausted
    a4 = progress(4, 4, 4, None)
    assert budget(a1, a2, a3, a4).exhausted and budget(a1, a2, a3, a4).left == 0
    # An attempt that moves the checkpoint on earns the budget back, whatever came before.
    a4_moved = progress(4, 4, 6, 7)
    assert budget(a1, a2, a3, a4_moved).no_progress == 0 and budget(a1, a2, a3, a4_moved).left == 2
    # A first attempt that never reached a step counts too (a preflight job never checkpoints).
    assert budget(progress(1, 0, 0, None)).no_progress == 1


def test_the_delay_doubles_per_attempt_without_progress_up_to_its_cap() -> None:
    policy = RestartPolicy(no_progress_limit=10, delay_s=20.0, max_delay_s=100.0)
    none = [progress(n, 0, 0, None) for n in range(1, 6)]
    assert [budget(*none[:n], policy=policy).delay_s for n in range(1, 6)] == [40.0, 80.0, 100.0, 100.0, 100.0]
    assert RestartPolicy(delay_s=0.0, max_delay_s=0.0).delay(5) == 0.0


def test_a_person_who_clears_the_task_after_the_budget_ran_out_renews_it() -> None:
    crashed = [progress(n, 0, 0, None) for n in range(1, 4)]
    assert budget(*crashed).exhausted
    renewed = budget(*crashed, renewed=3)
    assert (renewed.exhausted, renewed.no_progress, renewed.left, renewed.delay_s) == (False, 0, 2, 20.0)
    assert "renewed after attempt 3" in renewed.account()
    # The attempts after the renewal count again.
    later = budget(*crashed, *[progress(n, 0, 0, None) for n in range(4, 7)], renewed=3)
    assert later.exhausted and later.no_progress == 3
    records = [{"attempt": 2, "outcome": "restart"}, {"attempt": 3, "outcome": "exhausted"},
               {"attempt": 5, "outcome": "restart"}]
    assert renewed_after(records) == 3 and renewed_after([]) == 0


def test_the_record_of_a_decision_holds_what_the_report_shows() -> None:
    b = budget(progress(1, 0, 4, 5), progress(2, 4, 4, None))
    row = b.record(outcome=RestartOutcome.RESTART, reason="node died")
    assert row["account"] == b.account()
    assert {k: row[k] for k in row if k not in ("at", "account")} == {
        "attempt": 2, "submission_id": "job-a2", "reason": "node died", "outcome": "restart", "progressed": False,
        "resumed_from": 4, "checkpoint_after": 4, "last_step": None, "no_progress": 1, "no_progress_limit": 2,
        "left": 1, "delay_s": 40.0, "renewed_after": 0}
    json.dumps(row)  # a line of restarts.jsonl


def _metrics(rd: RunDir, attempt: int, steps: list[int]) -> str:
    path = rd.metrics_file(attempt)
    path.write_text("".join(json.dumps({"step": s, "data": {"training/global_step": s}}) + "\n" for s in steps))
    return str(path)


def test_progress_is_read_from_the_attempts_records_and_the_checkpoints(tmp_path: Path) -> None:
    """Attempt 1 trained to 5 and saved 4; attempt 2 resumed from 4 and ended before a step; attempt 3
    resumed from 4, trained to 7 and saved 6 before it was lost: read from attempts.jsonl, the metrics
    files and the checkpoint directory as the stand-in trainer (verl's FSDP layout) left it."""
    rd = RunDir(tmp_path / "run")
    rd.path.mkdir()
    ckpt = tmp_path / "ckpt"
    for step in (2, 4, 6):
        save_checkpoint(ckpt, step, world=1, critic=False)
    rd.record_attempt(Attempt("job-a1", 1, 0.0, "", 0, _metrics(rd, 1, [1, 2, 3, 4, 5])))
    rd.record_attempt(Attempt("job-a2", 2, 0.0, "", 4, _metrics(rd, 2, [])))
    rd.record_attempt(Attempt("job-a3", 3, 0.0, "", 4, _metrics(rd, 3, [5, 6, 7])))
    settings = {"algorithm.adv_estimator": "grpo"}
    assert newest_run_step(ckpt, settings) == 6
    got = run_budget(rd.path, POLICY, checkpoint_dir=ckpt, settings=settings)
    assert got.attempts == (progress(1, 0, 4, 5), progress(2, 4, 4, None), progress(3, 4, 6, 7))
    assert got.no_progress == 0
    # Step 6's save cut short (a shard missing): the newest complete checkpoint is 4 again.
    (ckpt / "global_step_6" / "actor" / "model_world_size_1_rank_0.pt").unlink()
    assert run_budget(rd.path, POLICY, checkpoint_dir=ckpt, settings=settings).no_progress == 2
    # A job that does not checkpoint (preflight): the latest attempt's checkpoint is where it started.
    assert attempt_progress(rd, 4)[-1] == progress(3, 4, 4, 7)
    assert run_budget(rd.path, POLICY, checkpoint_dir=None, settings=None).attempts[-1] == progress(3, 4, 4, 7)
    # The run's restart records renew the budget after an exhausted one.
    rd.record_restart({"attempt": 2, "outcome": "exhausted"})
    assert run_budget(rd.path, POLICY, checkpoint_dir=ckpt, settings=settings).renewed_after == 2


def test_the_newest_checkpoint_is_counted_in_run_steps_in_a_segment_and_by_the_tracker_for_megatron(
        tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    assert newest_run_step(ckpt, {}) == 0  # no checkpoint yet
    segment = tmp_path / "ckpt" / "segment_2" / "checkpoints"
    save_checkpoint(segment, 2, world=1, critic=False)
    (ckpt / SEGMENTS_FILE).write_text(json.dumps([{
        "index": 2, "start_step": 6, "checkpoint_dir": str(segment), "model_path": "/m", "world_size": 1,
        "merged_from": str(ckpt / "global_step_6")}]))
    assert newest_run_step(ckpt, {"algorithm.adv_estimator": "grpo"}) == 8
    megatron = tmp_path / "megatron"
    megatron.mkdir()
    (megatron / "latest_checkpointed_iteration.txt").write_text("12")
    assert newest_run_step(megatron, {"actor_rollout_ref.actor.strategy": "megatron"}) == 12


@pytest.mark.parametrize("n", [0, 1, 2])
def test_no_attempt_yet_or_one_left_counts_from_what_is_recorded(n: int) -> None:
    b = budget(*[progress(k, 0, 0, None) for k in range(1, n + 1)])
    assert b.no_progress == n and b.restarts == max(0, n - 1) and (b.latest is None) == (n == 0)
