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
from verl_pipeline.jobs.watchdog import Hang

EXIT = "Job entrypoint command failed with exit code 1, last available logs (truncated to 20,000 chars):"


def obs(kind: WaitEvent, message: str = "", status: str = "", hang: Hang | None = None) -> Observation:
    return Observation(kind, "job-a1", message, status, hang)


#: The watchdog's hang of the examples: 42 minutes after step 118, the stall limit 30 minutes.
HANG = Hang(last_step=118, waited_s=42 * 60.0, limit_s=30 * 60.0)


def test_a_live_job_is_waited_for_also_on_a_retry() -> None:
    for retry_try in (False, True):
        d = decide(obs(WaitEvent.RUNNING, status="RUNNING"), retry_try=retry_try)
        assert d.action is Action.WAIT and not d.stop_job


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
def test_a_lost_node_or_a_hang_stops_the_job_and_retries(kind: WaitEvent) -> None:
    message = ("hang: no training step for 42m, last step 118 (stall limit 30m)" if kind is WaitEvent.HUNG
               else "Ray node died: 1 of 2 nodes alive while job job-a1 was RUNNING")
    d = decide(obs(kind, message, "RUNNING", HANG if kind is WaitEvent.HUNG else None))
    assert d.action is Action.RETRY and d.stop_job and d.kind is FailureKind.INFRASTRUCTURE
    assert d.reason == ("hang: no training step for 42m, last step 118" if kind is WaitEvent.HUNG else "node died")
    assert f"[infrastructure failure: {d.reason}]" in d.message and "resumes from the last checkpoint" in d.message


def test_a_hangs_gpu_reading_is_in_the_decisions_message_not_its_reason() -> None:
    gpu = GpuSummary(mean_pct=0.5, min_pct=0.0, max_pct=2.0, gpus=8, nodes=1)
    d = decide(obs(WaitEvent.HUNG, "", "RUNNING", replace(HANG, gpu=gpu)))
    assert d.reason == "hang: no training step for 42m, last step 118"
    assert "stall limit 30m; GPUs idle (0% to 2%, mean 0% on 8 GPUs of 1 node)" in d.message


def test_the_retry_after_the_pipeline_stopped_a_job_resubmits_it() -> None:
    stopped = obs(WaitEvent.STOPPED, "Job was intentionally stopped.", "STOPPED")
    d = decide(stopped, retry_try=True, stopped_by_pipeline="hang: no training step for 42m, last step 118")
    assert d.action is Action.RESUBMIT and "hang: no training step for 42m" in d.message
    # The same stop by someone else (a user, teardown) is not undone.
    assert decide(stopped, retry_try=True).action is Action.FAIL


def test_an_infrastructure_failure_fails_the_try_then_its_retry_resubmits() -> None:
    failed = obs(WaitEvent.FAILED, EXIT, "FAILED")
    log = "Traceback (most recent call last):\nray.exceptions.ActorDiedError: its node was terminated"
    first = decide(failed, log_tail=log)
    assert first.action is Action.RETRY and first.reason == "actor died with its node"
    assert first.evidence.startswith("ray.exceptions.ActorDiedError")
    assert decide(failed, log_tail=log, retry_try=True).action is Action.RESUBMIT


def test_a_user_failure_fails_at_once_naming_the_reason_that_decided_and_the_ending_exception() -> None:
    log = ("WARNING torchtitan engine is not available: ModuleNotFoundError: No module named 'torchtitan'\n"
           "Traceback (most recent call last):\nImportError: the package flash_attn seems to be not installed")
    for retry_try in (False, True):
        d = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, retry_try=retry_try)
        assert d.action is Action.FAIL and d.reason == "import error" and d.kind is FailureKind.USER
        assert d.message.endswith("Evidence: ImportError: the package flash_attn seems to be not installed")
        assert "[user failure: import error]" in d.message


def test_a_gpu_out_of_memory_fails_at_once_with_the_fix() -> None:
    log = ("(WorkerDict pid=9) torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.32 GiB.\n"
           "Traceback (most recent call last):\nRuntimeError: rollout failed")
    d = decide(obs(WaitEvent.FAILED, EXIT, "FAILED"), log_tail=log, retry_try=True)
    assert d.action is Action.FAIL and d.reason == "GPU out of memory" and d.kind is FailureKind.USER
    assert "Evidence: torch.OutOfMemoryError: CUDA out of memory" in d.message
    assert "Fix: lower actor_rollout_ref.rollout.gpu_memory_utilization" in d.message


def test_an_unreachable_cluster_names_what_the_backend_says() -> None:
    gone = decide(obs(WaitEvent.UNREACHABLE, "Ray Jobs API unreachable: connection refused"),
                  infrastructure_gone="Slurm job 12 is CANCELLED")
    assert gone.action is Action.RETRY and "[infrastructure failure: Slurm job 12 is CANCELLED]" in gone.message
    plain = decide(obs(WaitEvent.UNREACHABLE, "the job is unknown to the cluster"))
    assert plain.action is Action.RETRY and plain.reason == "Ray Jobs API unreachable"
    assert decide(obs(WaitEvent.UNREACHABLE), retry_try=True).action is Action.RESUBMIT


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
    d = decide(Observation.from_event(event))
    assert d.action is Action.RETRY and d.stop_job
    assert d.reason == "hang: no training step for 42m, last step 118"
    assert d.message.endswith("[infrastructure failure: hang: no training step for 42m, last step 118]: "
                              "stall limit 30m — the retry provisions a healthy cluster and resumes from the last "
                              "checkpoint")
    for wording in ("", "the job is stuck (whatever this says)", "hang: no step for 1m, last step 3 (stall limit 1m)"):
        assert decide(Observation.from_event({**event, "message": wording})) == d
    startup = Hang(last_step=None, waited_s=7201.0, limit_s=7200.0)
    s = decide(obs(WaitEvent.HUNG, "whatever", "PENDING", startup), retry_try=True)
    assert s.action is Action.RESUBMIT and s.reason == "hang: no training step within 2h1s of the start"
    assert "watch.startup_timeout 2h" in s.message


def test_a_hang_event_of_an_earlier_release_keeps_its_message_as_the_detail() -> None:
    d = decide(obs(WaitEvent.HUNG, "hang: no training step for 42m, last step 118 (stall limit 30m)", "RUNNING"))
    assert d.action is Action.RETRY and d.stop_job and d.reason == "hang"
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
