"""Submit-or-reattach: never two live jobs for one task of one DAG run."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from verl_pipeline.constants import JobState
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.jobs.ids import attempt_of, submission_id
from verl_pipeline.trainer.render import RenderedJob

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Submission:
    submission_id: str
    #: "submitted", "reattached" (a live job of this run) or "already_succeeded".
    action: str
    attempt: int
    status: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def submit_or_reattach(
    client: RayJobsClient,
    job: RenderedJob,
    *,
    dag_id: str,
    run_id: str,
    task_id: str,
    metadata: dict[str, str] | None = None,
) -> Submission:
    """Reattach to a live (or succeeded) job of this run, else submit the next attempt."""
    prefix = submission_id(dag_id, run_id, task_id, 1)[: -len("-a1")]
    mine = []
    for info in client.list_jobs():
        n = attempt_of(info.submission_id, prefix)
        if n is not None:
            mine.append((n, info))
    mine.sort(key=lambda item: item[0])
    for n, info in mine:
        if not info.status.is_terminal():
            log.info("Reattaching to live Ray job %s (attempt %d, %s)", info.submission_id, n, info.status.value)
            return Submission(info.submission_id, "reattached", n, info.status.value)
    if mine and mine[-1][1].status is JobState.SUCCEEDED:
        n, info = mine[-1]
        log.info("Ray job %s of this run already succeeded: not submitting again", info.submission_id)
        return Submission(info.submission_id, "already_succeeded", n, info.status.value)
    attempt = (mine[-1][0] + 1) if mine else 1
    sub_id = submission_id(dag_id, run_id, task_id, attempt)
    meta = {"dag_id": dag_id, "run_id": run_id, "task_id": task_id, "mode": job.mode.value,
            **(metadata or {})}
    log.info("Submitting Ray job %s (attempt %d, mode %s)", sub_id, attempt, job.mode.value)
    client.submit(entrypoint=job.entrypoint, submission_id=sub_id, runtime_env=job.runtime_env, metadata=meta)
    return Submission(sub_id, "submitted", attempt, JobState.PENDING.value)


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
