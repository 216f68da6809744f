"""The wait's one decision, case by case."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from verl_pipeline.constants import JobState
from verl_pipeline.jobs.classify import FailureKind
from verl_pipeline.jobs.client import JobInfo
from verl_pipeline.jobs.outcome import Action, Observation, TrainingRecord, WaitEvent, decide
from verl_pipeline.jobs.progress import GpuSummary
from verl_pipeline.jobs.restart_budget import AttemptProgress, RestartBudget
from verl_pipeline.jobs.watchdog import Hang
from verl_pipeline.restarts import RestartPolicy

EXIT = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):"


def obs(kind: WaitEvent, message: str = "", status: str = "", hang: Hang | None = None) -> Observation:
    return Observation(kind, "job-a1", message, status, hang)


#: The watchdog's hang of the examples: 42 minutes after step 118, the stall limit 30 minutes.
HANG = Hang(last_step=118, waited_s=42 * 60.0, limit_s=30 * 60.0)

#: The run's one attempt trained from scratch to step 7 and saved step 6: it made progress.
PROGRESSED = RestartBudget(RestartPolicy(), (AttemptProgress(1, "job-a1", 0, 6, 7),))


def crashed(times: int, limit: int = 2) -> RestartBudget:
    """A run whose attempts after the first all ended before their first step, the checkpoint at 6."""
    attempts = (AttemptProgress(1, "job-a1", 0, 6, 7),
                *(AttemptProgress(n, f"job-a{n}", 6, 6, None) for n in range(2, times + 2)))
    return RestartBudget(RestartPolicy(no_progress_limit=limit), attempts)


def test_a_live_job_is_waited_for() -> None:
    d = decide(obs(WaitEvent.RUNNING, status="RUNNING"))
    assert d.action is Action.WAIT and not d.stop_job and d.budget is None


def test_success_of_a_preflight_job() -> None:
    assert decide(obs(WaitEvent.SUCCEEDED, status="SUCCEEDED")).action is Action.FINISH


def test_success_of_training_must_reach_the_last_step_and_resume_where_it_should() -> None:
    ok = TrainingRecord(total_steps=8, steps_logged=[5, 6, 7, 8], resume_from_step=4)
    assert decide(obs(WaitEvent.SUCCEEDED), training=ok).action is Action.FINISH
    short = decide(obs(WaitEvent.SUCCEEDED), training=TrainingRecord(8, [1, 2, 3], metrics_path="/m.jsonl"))
    assert short.action is Action.FAIL and "reached step 3 of trainer.total_training_steps=8" in short.message
    restarted = decide(obs(WaitEvent.SUCCEEDED), training=TrainingRecord(8, list(range(1, 9)), resume_from_step=4))
    assert restarted.action is Action.FAIL and "resumed after checkpoint step 4 but its first step was 1" in \
        restarted.message


@pytest.mark.parametrize("kind", [WaitEvent.NODE_LOST, WaitEvent.HUNG])
def test_a_lost_node_or_a_hang_stops_the_job_and_restarts(kind: WaitEvent) -> None:
    message = ("hang: no training step for 42m, last step 118 (stall limit 30m)" if kind is WaitEvent.HUNG
               else "Ray node died: 1 of 2 nodes alive while job job-a1 was RUNNING")
    d = decide(obs(kind, message, "RUNNING", HANG if kind is WaitEvent.HUNG else None), budget=PROGRESSED)
    assert d.action is Action.RESTART and d.stop_job and d.kind is FailureKind.INFRASTRUCTURE
    assert d.reason == ("hang: no training step for 42m, last step 118" if kind is WaitEvent.HUNG else "node died")
    assert f"[infrastructure failure: {d.reason}]" in d.message and "from the last checkpoint" in d.message
    assert d.delay_s == 20.0 and d.budget is PROGRESSED
    assert "restart 1 in 20s" in d.message
    assert d.message.endswith("Restart budget: attempt 1 moved the checkpoint from step 0 to 6; 2 of 2 restarts "
                              "without progress left (0 attempt(s) in a row without progress, 0 restart(s) before "
                              "this one)")


def test_a_hangs_gpu_reading_is_in_the_decisions_message_not_its_reason() -> None:
    gpu = GpuSummary(mean_pct=0.5, min_pct=0.0, max_pct=2.0, gpus=8, nodes=1)
    d = decide(obs(WaitEvent.HUNG, "", "RUNNING", replace(HANG, gpu=gpu)), budget=PROGRESSED)
    assert d.reason == "hang: no training step for 42m, last step 118"
    assert "stall limit 30m; GPUs idle (0% to 2%, mean 0% on 8 GPUs of 1 node)" in d.message


def test_a_job_the_pipeline_stopped_is_restarted_one_stopped_by_anyone_else_is_not() -> None:
    stopped = obs(WaitEvent.STOPPED, "Job was intentionally stopped.", "STOPPED")
    d = decide(stopped, stopped_by_pipeline="hang: no training step for 42m, last step 118", budget=PROGRESSED)
    assert d.action is Action.RESTART and "hang: no training step for 42m" in d.message
    # The same stop by someone else (a user, teardown) is not undone.
    other = decide(stopped, budget=PROGRESSED)
    assert other.action is Action.FAIL and other.kind is FailureKind.USER


def test_an_infrastructure_failure_is_restarted_with_the_exception_that_ended_it_as_evidence() -> None:
    failed = obs(WaitEvent.FAILED, EXIT, "FAILED")
    log = "Traceback (most recent call last):\nray.exceptions.ActorDiedError: its node was terminated"
    d = decide(failed, log_tail=log, budget=PROGRESSED)
    assert d.action is Action.RESTART and d.reason == "actor died with its node"
    assert d.evidence.startswith("ray.exceptions.ActorDiedError")


def test_attempts_without_progress_use_the_budget_up_and_then_the_run_fails_in_one_line() -> None:
    """Two attempts in a row that ended before their first step are restarted (the delay doubling), a
    third fails the run: an infrastructure failure, not retried, its one line naming the budget."""
    failed = obs(WaitEvent.FAILED, "Job entrypoint command failed with exit code 137, last available logs "
                                   "(truncated to 20,000 chars):\nRunning entrypoint for job job-a1: python -m x\n"
                                   "killed before the first step\n", "FAILED")
    first, second = decide(failed, budget=crashed(1)), decide(failed, budget=crashed(2))
    assert [first.action, second.action] == [Action.RESTART, Action.RESTART]
    assert [first.delay_s, second.delay_s] == [40.0, 80.0]
    assert "1 of 2 restarts without progress left" in first.message
    assert "0 of 2 restarts without progress left" in second.message
    third = decide(failed, budget=crashed(3))
    assert third.action is Action.FAIL and third.kind is FailureKind.INFRASTRUCTURE and third.reason == \
        "worker killed (OOM or signal)"
    assert "\n" not in third.message  # Ray's message goes on with the log's first lines: only its first is kept
    assert third.message.startswith("Ray job job-a1 ended FAILED [infrastructure failure: worker killed (OOM or "
                                    "signal)]: Job entrypoint command failed with exit code 137, last available logs "
                                    "(truncated to 20,000 chars): — not restarted")
    assert ("not restarted, the restart budget is used up: attempt 4 ended before its first training step "
            "(checkpoint still at step 6); 3 attempts in a row made no progress and restarts.no_progress_limit "
            "is 2") in third.message
    assert "clear the wait task" in third.message and "raise restarts.no_progress_limit" in third.message
    assert "Evidence" not in third.message  # the exit code that decided is Ray's first line, said once
    log = "Traceback (most recent call last):\nray.exceptions.ActorDiedError: its node was terminated"
    lost = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, budget=crashed(3))
    assert lost.action is Action.FAIL and lost.message.count("Evidence: ray.exceptions.ActorDiedError") == 1
    # A limit of 0: the first attempt without progress fails the run; progress before it does not count.
    assert decide(failed, budget=crashed(1, limit=0)).action is Action.FAIL


def test_a_user_failure_fails_at_once_whatever_the_budget() -> None:
    log = "Traceback (most recent call last):\nValueError: user code failed at step 2"
    for budget in (PROGRESSED, crashed(3), None):
        d = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, budget=budget)
        assert d.action is Action.FAIL and d.kind is FailureKind.USER and "[user failure: " in d.message


def test_an_infrastructure_failure_is_not_decided_without_the_budget() -> None:
    with pytest.raises(ValueError, match="needs the run's restart budget"):
        decide(obs(WaitEvent.NODE_LOST, "1 of 2 nodes alive"))


def test_a_user_failure_fails_at_once_naming_the_reason_that_decided_and_the_ending_exception() -> None:
    log = ("WARNING torchtitan engine is not available: ModuleNotFoundError: No module named 'torchtitan'\n"
           "Traceback (most recent call last):\nImportError: the package flash_attn seems to be not installed")
    for budget in (None, PROGRESSED):
        d = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, budget=budget)
        assert d.action is Action.FAIL and d.reason == "import error" and d.kind is FailureKind.USER
        assert d.message.endswith("Evidence: ImportError: the package flash_attn seems to be not installed")
        assert "[user failure: import error]" in d.message


def test_a_gpu_out_of_memory_fails_at_once_with_the_fix() -> None:
    log = ("(WorkerDict pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB.\n"
           "Traceback (most recent call last):\nRuntimeError: rollout failed")
    d = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, budget=PROGRESSED)
    assert d.action is Action.FAIL and d.reason == "GPU out of memory" and d.kind is FailureKind.USER
    assert "Evidence: torch.OutOfMemoryError: CUDA out of memory" in d.message
    assert "Fix: lower actor_rollout_ref.rollout.gpu_memory_utilization" in d.message


def test_an_unreachable_cluster_names_what_the_backend_says() -> None:
    gone = decide(obs(WaitEvent.UNREACHABLE, "Ray Jobs API unreachable: connection refused"),
                  infrastructure_gone="Slurm job 12 is CANCELLED", budget=PROGRESSED)
    assert gone.action is Action.RESTART and "[infrastructure failure: Slurm job 12 is CANCELLED]" in gone.message
    assert not gone.stop_job  # nothing to stop: the job is out of reach (a restart reattaches if it still runs)
    plain = decide(obs(WaitEvent.UNREACHABLE, "the job is unknown to the cluster"), budget=PROGRESSED)
    assert plain.action is Action.RESTART and plain.reason == "Ray Jobs API unreachable"


def test_events_of_an_earlier_release_still_parse() -> None:
    assert WaitEvent.parse("success") is WaitEvent.SUCCEEDED
    assert WaitEvent.parse("error") is WaitEvent.UNREACHABLE
    assert Observation.from_event({"status": "hung", "job_id": "j", "message": "m"}).kind is WaitEvent.HUNG
    with pytest.raises(ValueError):
        WaitEvent.parse("exploded")


#: What each Ray job state means to a wait, written out here independently of the code's table.
EXPECTED_EVENT = {
    JobState.PENDING: WaitEvent.RUNNING,
    JobState.RUNNING: WaitEvent.RUNNING,
    JobState.SUCCEEDED: WaitEvent.SUCCEEDED,
    JobState.FAILED: WaitEvent.FAILED,
    JobState.STOPPED: WaitEvent.STOPPED,
}


@pytest.mark.parametrize("state", list(JobState))  # every state, also one added later (no case: KeyError)
def test_each_ray_job_state_is_one_wait_event(state: JobState) -> None:
    kind = EXPECTED_EVENT[state]
    assert WaitEvent.of_state(state) is kind
    # Only a terminal state ends a wait: the trigger yields it, the operator's look decides on it.
    assert (kind is not WaitEvent.RUNNING) == state.is_terminal()
    info = JobInfo(submission_id="job-a1", status=state, message=f"job is {state.value}")
    assert Observation.from_job("job-a1", info, reachable=True) == Observation(kind, "job-a1", f"job is {state.value}",
                                                                               state.value)


def test_a_hang_is_decided_from_the_watchdogs_fields_not_from_its_message() -> None:
    event = {"status": "hung", "job_id": "job-a1", "job_status": "RUNNING", "hang": HANG.to_dict(),
             "message": HANG.message}
    d = decide(Observation.from_event(event), budget=PROGRESSED)
    assert d.action is Action.RESTART and d.stop_job
    assert d.reason == "hang: no training step for 42m, last step 118"
    assert d.message.startswith("Ray job job-a1 (RUNNING) [infrastructure failure: hang: no training step for 42m, "
                                "last step 118]: stall limit 30m — restart 1 in 20s, on a healthy cluster, from the "
                                "last checkpoint.")
    for wording in ("", "the job is stuck (whatever this says)", "hang: no step for 1m, last step 3 (stall limit 1m)"):
        assert decide(Observation.from_event({**event, "message": wording}), budget=PROGRESSED) == d
    startup = Hang(last_step=None, waited_s=7201.0, limit_s=7200.0)
    s = decide(obs(WaitEvent.HUNG, "whatever", "PENDING", startup), budget=PROGRESSED)
    assert s.action is Action.RESTART and s.reason == "hang: no training step within 2h1s of the start"
    assert "watch.startup_timeout 2h" in s.message


def test_a_hang_event_of_an_earlier_release_keeps_its_message_as_the_detail() -> None:
    d = decide(obs(WaitEvent.HUNG, "hang: no training step for 42m, last step 118 (stall limit 30m)", "RUNNING"),
               budget=PROGRESSED)
    assert d.action is Action.RESTART and d.stop_job and d.reason == "hang"
    assert "[infrastructure failure: hang]: hang: no training step for 42m, last step 118 (stall limit 30m)" in \
        d.message


def test_a_resumed_attempts_validation_row_at_its_checkpoint_step_is_not_a_training_step(tmp_path: Path) -> None:
    """verl's ``val_before_train`` logs a row of validation alone at the step a resumed run starts from
    (and at step 0): the attempt's steps are the ones after it, so the resume is judged right."""
    import json

    from verl_pipeline.jobs.attempts import run_steps
    from verl_pipeline.rundir import Attempt

    metrics = tmp_path / "metrics-a2.jsonl"
    rows = [{"step": 3, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.2, "val-aux/num_turns/min": 1.0}}]
    rows += [{"step": s, "data": {"training/global_step": s, "critic/score/mean": 0.1}} for s in (4, 5, 6)]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    steps = run_steps(Attempt("j-a2", 2, 0.0, "", 3, str(metrics)))
    assert steps == [4, 5, 6]
    done = decide(Observation(WaitEvent.SUCCEEDED, "j-a2", job_status="SUCCEEDED"),
                  training=TrainingRecord(6, steps, resume_from_step=3))
    assert done.action is Action.FINISH
