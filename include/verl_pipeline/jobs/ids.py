"""Deterministic Ray submission ids: a retried task finds its job instead of submitting another."""

from __future__ import annotations

import re

from verl_pipeline.paths import short_hash, slug

#: What stands between a submission id's prefix and its attempt number (``<prefix>-a3``).
_ATTEMPT_SEP = "-a"
_ATTEMPT = re.compile(re.escape(_ATTEMPT_SEP) + r"(\d+)$")


def submission_prefix(dag_id: str, run_id: str, task_id: str) -> str:
    """The part of the id shared by every attempt of one task in one DAG run."""
    return f"verl-{slug(dag_id, 24)}-{short_hash(dag_id, run_id, task_id, length=12)}"


def submission_id(dag_id: str, run_id: str, task_id: str, attempt: int = 1) -> str:
    if attempt < 1:
        raise ValueError("attempt starts at 1")
    return f"{submission_prefix(dag_id, run_id, task_id)}{_ATTEMPT_SEP}{attempt}"


def attempt_of(sub_id: str, prefix: str) -> int | None:
    """The attempt number of ``sub_id`` when it belongs to ``prefix``, else None."""
    if not sub_id.startswith(prefix + _ATTEMPT_SEP):
        return None
    m = _ATTEMPT.search(sub_id)
    return int(m.group(1)) if m else None


def job_page_url(dashboard_url: str, submission_id: str) -> str:
    """The Ray dashboard's page of a job (its status, logs, driver)."""
    return f"{dashboard_url.rstrip('/')}/#/jobs/{submission_id}"
