"""Retries resume from the newest complete checkpoint, and refuse another world size.

Real Ray (the session's local head), the stand-in trainer writing verl's FSDP checkpoint layout, and
the pipeline's own render + submit-or-reattach (what the wait task calls for each resubmit). A save
is killed deterministically: the trainer SIGKILLs itself after writing some of that save's files.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fakes.fake_verl_trainer import save_checkpoint
from tests.faults.conftest import metric_lines, record_result
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.constants import JobState, Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.checkpoints import list_checkpoints, tracker_step
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.jobs.deadlines import Deadline
from verl_pipeline.jobs.submit import Submission, submit_or_reattach
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.report.build import RunOutcome
from verl_pipeline.report.write import write_report
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer.render import render_job

pytestmark = pytest.mark.integration

TOTAL = 6


def _spec(name: str, *overrides: str, **params: object) -> RunSpec:
    return build_run_spec({"profile": "ckpt", "verl_overrides": list(overrides), **params},
                          run_name=f"faults/{name}")


def _submit(client: RayJobsClient, spec: RunSpec, deadline: Deadline | None = None) -> Submission:
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/train.parquet", val_files="/d/val.parquet",
                     model_path="/m/actor")
    return submit_or_reattach(client, job, dag_id="faults", run_id=spec.run_name.split("/")[1], task_id="train",
                              run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir, deadline=deadline)


def _first_step_after(spec: RunSpec, attempt: int, since: float, timeout_s: float = 60) -> float:
    """Seconds from ``since`` until ``attempt`` logged its first step."""
    deadline = time.monotonic() + timeout_s
    while not _steps(spec, attempt):
        assert time.monotonic() < deadline, f"attempt {attempt} logged no step within {timeout_s}s"
        time.sleep(0.05)
    return round(time.monotonic() - since, 2)


def _wait(client: RayJobsClient, job_id: str, timeout_s: float = 60) -> JobState:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.get_job(job_id)
        assert info is not None
        if info.status.is_terminal():
            return info.status
        time.sleep(0.2)
    raise AssertionError(f"Ray job {job_id} still running after {timeout_s}s")


def _steps(spec: RunSpec, attempt: int) -> list[int]:
    return [m["step"] for m in metric_lines(spec.run_dir / f"metrics-a{attempt}.jsonl")]


@pytest.mark.parametrize(("files", "resumed", "mode"), [
    # Killed after rank 0's three actor files of step 4: the tracker still names 2.
    (3, 2, "auto"),
    # Killed inside the tracker's write: step 4 is complete, the tracker is empty (verl's auto would
    # fail on it): resumed from step 4 by path.
    (99, 4, "resume_path"),
])
def test_killed_mid_save_resumes_from_the_newest_complete_checkpoint(
    checkpoint_env: Path, ray_cluster: ClusterHandle, request: pytest.FixtureRequest, results_file: Path,
    caplog: pytest.LogCaptureFixture, files: int, resumed: int, mode: str,
) -> None:
    client = ray_cluster.client()
    name = f"mid-save-{files}-{request.node.callspec.id}"
    first = _submit(client, _spec(name, "+fake.die_in_save_at_step=4", f"+fake.die_after_files={files}"))
    spec = _spec(name)
    assert _wait(client, first.submission_id) is JobState.FAILED
    failed = time.monotonic()
    assert "killed mid-save" in client.logs(first.submission_id)
    newest = list_checkpoints(spec.checkpoint_dir, critic=True)[-1]
    assert newest.step == 4 and newest.complete == (files == 99)

    with caplog.at_level("INFO", logger="verl_pipeline.jobs.submit"):
        second = _submit(client, spec)
    assert second.attempt == 2
    info = client.get_job(second.submission_id)
    assert info is not None and f"trainer.resume_mode={mode}" in info.entrypoint
    assert second.submission_id in caplog.text and f"from step {resumed}" in caplog.text
    if files == 3:
        assert "checkpoint global_step_4 (missing actor/model_world_size_2_rank_1.pt" in caplog.text
    first_step_s = _first_step_after(spec, 2, failed)
    assert _wait(client, second.submission_id) is JobState.SUCCEEDED
    assert RunDir(spec.run_dir).attempts()[1].resume_from_step == resumed
    assert _steps(spec, 1) == [1, 2, 3, 4]
    assert _steps(spec, 2) == list(range(resumed + 1, TOTAL + 1))
    assert tracker_step(spec.checkpoint_dir) == TOTAL
    assert all(c.complete for c in list_checkpoints(spec.checkpoint_dir, critic=True))
    # The run report reads the same record: both attempts, the resume, each step once.
    report = write_report(spec.run_dir, status=RunOutcome.SUCCEEDED, plots=False).report
    assert [(a.attempt, a.resumed_from_step, a.first_step, a.last_step) for a in report.attempts] == [
        (1, 0, 1, 4), (2, resumed, resumed + 1, TOTAL)]
    assert report.steps_done == TOTAL and report.steps_redone == 4 - resumed
    assert report.throughput_per_gpu and report.timing_s["gen"] < report.timing_s["step"]
    where = "inside the tracker's write" if files == 99 else f"after {files} of step 4's files"
    record_result(results_file, f"killed mid-save ({where})",
                  {"recovery_s": first_step_s, "killed_after_step": 4, "resumed_from_step": resumed,
                   "steps_redone": 4 - resumed, "resume_mode": mode,
                   "note": "the job's failure seen -> the resubmitted attempt's first step (no Airflow)"})


def test_a_retry_removes_what_the_attempt_before_left_past_the_checkpoints_kept(
    checkpoint_env: Path, ray_cluster: ClusterHandle, caplog: pytest.LogCaptureFixture,
) -> None:
    """Saving every step and keeping 2 (the default), attempt 1 is killed in step 5's save. Its trainer
    pruned its own saves as verl's checkpoint manager does: to their data.pt, and before a save down to one
    fewer than it keeps, so 1-3 are leftovers and 4 is whole. The retry removes 1-3 and resumes from 4; its
    own trainer keeps its own 2 and never touches 4: the run ends with 3 checkpoints, not 6."""
    client = ray_cluster.client()
    first = _submit(client, _spec("retention", "trainer.save_freq=1", "+fake.die_in_save_at_step=5",
                                  "+fake.die_after_files=3"))
    spec = _spec("retention", "trainer.save_freq=1")
    assert _wait(client, first.submission_id) is JobState.FAILED
    left = list_checkpoints(spec.checkpoint_dir, critic=True)
    assert [(c.step, c.complete) for c in left] == [(1, False), (2, False), (3, False), (4, True), (5, False)]
    with caplog.at_level("INFO", logger="verl_pipeline.jobs.submit"):
        second = _submit(client, spec)
    removed = [line for line in caplog.text.splitlines() if "removed incomplete checkpoint" in line
               and second.submission_id in line and "keeps its newest 2 complete ones" in line]
    assert [line.split("global_step_")[1].split(":")[0] for line in removed] == ["1", "2", "3"]
    assert _wait(client, second.submission_id) is JobState.SUCCEEDED
    assert [(c.step, c.complete) for c in list_checkpoints(spec.checkpoint_dir, critic=True)] == [
        (4, True), (5, True), (6, True)]
    assert tracker_step(spec.checkpoint_dir) == TOTAL


def test_retry_on_a_smaller_world_size_is_refused_before_submitting(
    checkpoint_env: Path, ray_cluster: ClusterHandle, request: pytest.FixtureRequest,
) -> None:
    client = ray_cluster.client()
    name = f"smaller-{request.node.name[-8:]}"
    spec = _spec(name)
    # What a first attempt on 1 x 2 GPUs left, written by the stand-in trainer's own save.
    for step in (2, 4):
        save_checkpoint(spec.checkpoint_dir, step, world=2, critic=True)
    before = len(client.list_jobs())
    # The re-provisioned cluster has one GPU where the checkpoints were written by two ranks.
    with pytest.raises(ConfigError) as e:
        _submit(client, _spec(name, n_gpus_per_node=1))
    text = str(e.value)
    assert "world size 2" in text and "world size 1" in text and "global_step_4" in text
    assert "2 GPUs again" in text and "\n" not in text
    assert len(client.list_jobs()) == before
    assert RunDir(spec.run_dir).attempts() == []


def test_allocation_deadline_saves_before_the_end_and_the_retry_loses_at_most_one_step(
    checkpoint_env: Path, ray_cluster: ClusterHandle, request: pytest.FixtureRequest, results_file: Path,
) -> None:
    """An allocation ending in 50 s (verl saves when the time left <= longest step + 60 s): verl's
    should_save_ckpt_esi saves after every step although save_freq would save only at step 100; the
    allocation's end kills the job after step 3; the retry resumes from the last save."""
    client = ray_cluster.client()
    name = f"deadline-{request.node.name[-8:]}"
    spec = _spec(name, "trainer.use_v1=false", "trainer.save_freq=100", "+fake.step_seconds=0.2",
                 total_training_steps=8)
    first = _submit(client, spec, deadline=Deadline(time.time() + 50, "a test allocation"))
    wait_until = time.monotonic() + 60
    while len(_steps(spec, 1)) < 3:
        info = client.get_job(first.submission_id)
        assert time.monotonic() < wait_until and info is not None and not info.status.is_terminal()
        time.sleep(0.05)
    assert client.stop(first.submission_id)  # the allocation ends: every process of the job dies
    killed = time.monotonic()
    assert _wait(client, first.submission_id) is JobState.STOPPED
    assert "Force saving checkpoint: ESI instance expiration approaching." in client.logs(first.submission_id)
    logged = max(_steps(spec, 1))

    second = _submit(client, spec)  # the new allocation has no deadline here
    resumed = RunDir(spec.run_dir).attempts()[1].resume_from_step
    first_step_s = _first_step_after(spec, 2, killed)
    assert _wait(client, second.submission_id) is JobState.SUCCEEDED
    assert logged - resumed <= 1 and resumed >= 3 - 1
    assert _steps(spec, 2) == list(range(resumed + 1, 9))
    record_result(results_file, "allocation deadline (verl's should_save_ckpt_esi, trainer.use_v1=false)",
                  {"recovery_s": first_step_s, "killed_after_step": logged, "resumed_from_step": resumed,
                   "steps_redone": logged - resumed, "save_freq": 100,
                   "note": f"without the deadline: {logged} steps lost (no save before step 100)"})
