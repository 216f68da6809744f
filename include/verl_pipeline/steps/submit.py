"""One attempt's submission: the job prepared for the cluster as it is now, submitted (or an attempt
already running reattached), and the room its checkpoints will need."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.cluster.registry import cluster_deadline
from verl_pipeline.constants import Mode, SubmitAction
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.jobs.deadlines import Deadline, earliest
from verl_pipeline.jobs.ids import submission_prefix
from verl_pipeline.jobs.submit import Submission, existing_job, submit_or_reattach
from verl_pipeline.rundir import RunDir, now
from verl_pipeline.spec import RunSpec
from verl_pipeline.steps.cluster import backend_spec
from verl_pipeline.steps.job import PreparedJob, prepare_job

if TYPE_CHECKING:  # pyarrow and numpy stay out of DAG parsing
    pass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submitted:
    """What :func:`submit_attempt` did: the job (new, or the run's live one) and, for a new one, what
    was prepared for it (mode, job, probe report)."""

    submission: Submission
    prepared: PreparedJob | None

    @property
    def mode(self) -> Mode | None:
        return self.prepared.mode if self.prepared else None


def submit_attempt(
    spec: RunSpec,
    handle: ClusterHandle,
    client: RayJobsClient,
    *,
    data: dict[str, Any],
    models: dict[str, Any],
    dag_id: str,
    run_id: str,
    task_id: str,
    deadline: Deadline | None = None,
    secret_env: Mapping[str, str] | None = None,
) -> Submitted:
    """The one submit path: the first submission, a shared cluster's admitted one, a resubmission after
    a failure, and the CLI's.

    A live (or succeeded) job of the run is reattached to as it is. Otherwise the cluster as it is
    now (a re-provisioned one included) is probed, the job rendered and saved (:func:`prepare_job`),
    and the next attempt submitted (:func:`~verl_pipeline.jobs.submit.submit_or_reattach`: resumed
    from the newest complete checkpoint, told the earliest of ``deadline`` and the end of the
    cluster's allocation, tracker credentials in a private file, recorded in the run's attempts).
    """
    found = existing_job(client, dag_id=dag_id, run_id=run_id, task_id=task_id)
    if found is not None:
        return Submitted(found, None)
    prepared = prepare_job(spec, handle, client, data=data, models=models,
                           id_prefix=submission_prefix(dag_id, run_id, task_id))
    if prepared.job.mode is Mode.TRAIN and spec.model_facts is not None:
        warn_checkpoint_room(spec.checkpoint_dir, prepared.job.settings, spec.model_facts.params_b)
    ends = earliest([deadline, cluster_deadline(handle, backend_spec(handle))])
    sub = submit_or_reattach(client, prepared.job, dag_id=dag_id, run_id=run_id, task_id=task_id,
                             run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir, deadline=ends,
                             secret_env=secret_env)
    if prepared.decision is not None and sub.action is SubmitAction.SUBMITTED:
        RunDir(spec.run_dir).record_decision({"attempt": sub.attempt, "submission_id": sub.submission_id,
                                              "at": now(), **prepared.decision.to_dict()})
    return Submitted(sub, prepared)


def warn_checkpoint_room(checkpoint_dir: Path, settings: dict[str, Any], params_b: float) -> None:
    """Warn when the run's checkpoints may outgrow the free space of their storage (an estimate from the model's
    size: a save cut short by a full disk fails the attempt hours in, and every retry after it)."""
    from verl_pipeline.jobs.checkpoints import checkpoint_room

    try:
        room = checkpoint_room(checkpoint_dir, settings, params_b)
    except OSError as e:  # a warning never stops a submit: the storage's own errors come with the job
        log.info("Could not estimate the room for the run's checkpoints in %s: %s", checkpoint_dir, e)
        return
    if room.short:
        log.warning("The run's checkpoints may not fit in %s: up to %d save(s) at once of ~%.1f GB each (the "
                    "models' fp32 weights and Adam's moments) may need %.1f GB more and %.1f GB are free; keep fewer "
                    "(trainer.max_actor_ckpt_to_keep) or give the cluster profile's storage.checkpoints more room",
                    checkpoint_dir, room.saves, room.save_bytes / 1e9, room.need / 1e9, room.free / 1e9)
