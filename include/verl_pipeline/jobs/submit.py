"""Submit-or-reattach: never two live jobs for one task of one DAG run."""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.constants import JobState, Mode, SubmitAction
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.jobs.deadlines import Deadline, with_deadline
from verl_pipeline.jobs.ids import attempt_of, submission_id, submission_prefix
from verl_pipeline.rundir import Attempt, RunDir, now, tracker_step
from verl_pipeline.trainer.render import RenderedJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    submission_id: str
    #: submitted, reattached (a live job of this run) or already_succeeded.
    action: SubmitAction
    attempt: int
    status: str

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "action": self.action.value}


def submit_or_reattach(
    client: RayJobsClient,
    job: RenderedJob,
    *,
    dag_id: str,
    run_id: str,
    task_id: str,
    metadata: dict[str, str] | None = None,
    run_dir: Path | None = None,
    checkpoint_dir: Path | None = None,
    deadline: Deadline | None = None,
    secret_env: Mapping[str, str] | None = None,
) -> Submission:
    """Reattach to a live (or succeeded) job of this run, else submit the next attempt.

    With ``run_dir``, attempts are numbered after every attempt ever recorded there (also those
    of a cluster that has since been replaced), each attempt's verl file-logger output goes to its
    own :meth:`~verl_pipeline.rundir.RunDir.metrics_file` (verl truncates its file on start), and the
    attempt is recorded with the checkpoint step it will resume from.

    A training job resumes from the run's newest complete checkpoint (:mod:`verl_pipeline.jobs.checkpoints`;
    ConfigError when it was written by another world size) and is told ``deadline``, when its allocation
    ends (the earliest of the Airflow task's execution_timeout and the cluster's end, which the caller
    knows: :func:`verl_pipeline.steps.submit_attempt`), see :mod:`verl_pipeline.jobs.deadlines`.

    ``secret_env`` (tracker credentials, :mod:`verl_pipeline.trackers`) reaches the job's workers
    through a 0600 file in ``run_dir/secrets`` (:func:`~verl_pipeline.trackers.with_secret_env`): neither
    ``job`` (written to the run files) nor the submitted ``runtime_env`` holds the values.
    """
    mine = jobs_of(client, dag_id=dag_id, run_id=run_id, task_id=task_id)
    found = _live_or_succeeded(mine)
    if found is not None:
        return found
    recorded = RunDir(run_dir).attempts() if run_dir else []
    attempt = max([n for n, _ in mine] + [a.attempt for a in recorded] + [0]) + 1
    sub_id = submission_id(dag_id, run_id, task_id, attempt)
    resume_from = (tracker_step(checkpoint_dir) or 0) if checkpoint_dir else 0
    segment, segment_start = 1, 0
    if checkpoint_dir is not None and job.mode is Mode.TRAIN:
        job, resume_from, segment, segment_start = _resume_complete(job, checkpoint_dir, sub_id)
    if job.mode is Mode.TRAIN:
        job = with_deadline(job, deadline, job_id=sub_id)
    runtime_env = copy.deepcopy(job.runtime_env)
    metrics_path = None
    if run_dir is not None:
        # Decided here, where the attempt's number is known: each attempt its own file (verl truncates it
        # on start), over whatever the rendered job or the cluster profile's runtime.env said.
        metrics_path = RunDir(run_dir).metrics_file(attempt)
        runtime_env.setdefault("env_vars", {})["VERL_FILE_LOGGER_PATH"] = str(metrics_path)
    if secret_env:
        from verl_pipeline.trackers import with_secret_env

        if run_dir is None:
            raise ValueError("secret_env needs the run_dir, where its private file is written")
        runtime_env = with_secret_env(runtime_env, secret_env, directory=RunDir(run_dir).secrets_dir,
                                      name=f"{sub_id}.json")
        log.info("Ray job %s: tracker variables %s passed to the job by a private file", sub_id, sorted(secret_env))
    meta = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "mode": job.mode.value,
            "attempt": str(attempt), **(metadata or {})}
    log.info("Submitting Ray job %s (attempt %d, mode %s, resume from step %d)", sub_id, attempt, job.mode.value,
             resume_from)
    client.submit(entrypoint=job.entrypoint, submission_id=sub_id, runtime_env=runtime_env, metadata=meta)
    if run_dir is not None:
        RunDir(run_dir).record_attempt(Attempt(sub_id, attempt, now(), client.dashboard_url, resume_from,
                                        str(metrics_path) if metrics_path else None, segment, segment_start))
    return Submission(sub_id, SubmitAction.SUBMITTED, attempt, JobState.PENDING.value)


def existing_job(client: RayJobsClient, *, dag_id: str, run_id: str, task_id: str) -> Submission | None:
    """This run's live job (reattach to it) or its last job when that one succeeded; None: submit."""
    return _live_or_succeeded(jobs_of(client, dag_id=dag_id, run_id=run_id, task_id=task_id))


def jobs_of(client: RayJobsClient, *, dag_id: str, run_id: str, task_id: str) -> list[tuple[int, Any]]:
    """The cluster's jobs of this run's task, as ``(attempt, JobInfo)`` sorted by attempt."""
    prefix = submission_prefix(dag_id, run_id, task_id)
    mine = []
    for info in client.list_jobs():
        n = attempt_of(info.submission_id, prefix)
        if n is not None:
            mine.append((n, info))
    return sorted(mine, key=lambda item: item[0])


def _live_or_succeeded(mine: list[tuple[int, Any]]) -> Submission | None:
    for n, info in mine:
        if not info.status.is_terminal():
            log.info("Reattaching to live Ray job %s (attempt %d, %s)", info.submission_id, n, info.status.value)
            return Submission(info.submission_id, SubmitAction.REATTACHED, n, info.status.value)
    if mine and mine[-1][1].status is JobState.SUCCEEDED:
        n, info = mine[-1]
        log.info("Ray job %s of this run already succeeded: not submitting again", info.submission_id)
        return Submission(info.submission_id, SubmitAction.ALREADY_SUCCEEDED, n, info.status.value)
    return None


def _remove_stale(checkpoint_dir: Path, settings: dict[str, Any], sub_id: str) -> None:
    """Before the attempt, the checkpoints earlier attempts left that the run no longer keeps (no job of it runs)."""
    from verl_pipeline.jobs.checkpoints import checkpoints_kept, remove_stale

    kept = checkpoints_kept(settings)
    for stale in remove_stale(checkpoint_dir, settings):
        log.info("Ray job %s: removed %s checkpoint %s: the run keeps its newest %d complete ones "
                 "(trainer.max_actor_ckpt_to_keep; 0 keeps every one)", sub_id,
                 "complete" if stale.complete else "incomplete", stale.path, kept)


def _resume_complete(job: RenderedJob, checkpoint_dir: Path, sub_id: str) -> tuple[RenderedJob, int, int, int]:
    """The job resuming from the run's newest complete checkpoint: (job, run step it resumes from, segment,
    the segment's start step). Another world size: ConfigError, or with ``on_world_size_change: merge`` a
    new segment trained from the merged weights (see :mod:`verl_pipeline.jobs.checkpoints`)."""
    from verl_pipeline.jobs.checkpoints import (
        ResumeMode,
        current_segment,
        new_segment,
        plan_for_job,
        read_segments,
        train_world_size,
    )
    from verl_pipeline.trainer.render import with_settings

    ckpt, start, segment = current_segment(checkpoint_dir)
    plan = plan_for_job(ckpt, job.settings, job.on_world_size_change)
    if plan is None:
        log.info("Ray job %s: %s checkpoints are not inspected; verl's resume_mode=%s decides", sub_id,
                 job.settings.get("actor_rollout_ref.actor.strategy"), job.settings.get("trainer.resume_mode"))
        return job, (tracker_step(checkpoint_dir) or 0), 1, 0
    for skipped in plan.skipped:
        log.warning("Ray job %s: checkpoint %s is incomplete: not resuming from it", sub_id, skipped)
    if not plan.merge:  # a merge reads the newest checkpoint of this directory, and leaves it as it is
        _remove_stale(ckpt, job.settings, sub_id)
    rules: dict[str, str] = {}
    updates: dict[str, Any] = {}
    if plan.merge:
        log.warning("Ray job %s: %s", sub_id, plan.reason)
        seg = new_segment(checkpoint_dir, plan, world_size=train_world_size(job.settings), job_id=sub_id)
        ckpt, start, segment = Path(seg.checkpoint_dir), seg.start_step, seg.index
        plan = plan_for_job(ckpt, job.settings) or plan
        log.warning("Ray job %s starts segment %d at run step %d from the merged weights %s (no optimizer state)",
                    sub_id, segment, start, seg.model_path)
    if segment > 1:
        seg = next(s for s in reversed(read_segments(checkpoint_dir)) if s.index == segment)
        total = int(job.settings.get("trainer.total_training_steps", 0))
        updates.update(seg.settings(total))
        rules["trainer.default_local_dir"] = (f"segment {segment} of the run, from run step {start} "
                                              f"(merged weights of {seg.merged_from}; on_world_size_change: merge)")
    if plan.mode is ResumeMode.AUTO and not updates:
        log.info("Ray job %s resumes with resume_mode=auto from step %d (%s)", sub_id, plan.step, plan.reason)
        return job, plan.step, segment, start
    if plan.mode is not ResumeMode.AUTO:
        log.warning("Ray job %s: %s -> trainer.resume_mode=%s%s", sub_id, plan.reason, plan.mode.value,
                    f" from {plan.path}" if plan.path else "")
        rules["trainer.resume_mode"] = f"{plan.mode.value!r} — {plan.reason} (checked before the submit)"
    updates.update(plan.settings())
    return with_settings(job, updates, rules), start + plan.step, segment, start


def preflight_summary(logs: str) -> dict[str, Any] | None:
    """The JSON summary the preflight job printed, if present in ``logs``."""
    import json

    from verl_pipeline.constants import PREFLIGHT_SUMMARY_MARKER

    for line in reversed(logs.splitlines()):
        idx = line.find(PREFLIGHT_SUMMARY_MARKER)
        if idx >= 0:
            try:
                data: dict[str, Any] = json.loads(line[idx + len(PREFLIGHT_SUMMARY_MARKER):])
                return data
            except json.JSONDecodeError:
                return None
    return None
