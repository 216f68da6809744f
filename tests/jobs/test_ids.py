from __future__ import annotations

import pytest

from verl_pipeline.jobs.ids import attempt_of, submission_id, submission_prefix


def test_submission_id_is_deterministic_and_scoped() -> None:
    a = submission_id("verl_ppo", "manual__2026-01-01", "submit_verl_job")
    assert a == submission_id("verl_ppo", "manual__2026-01-01", "submit_verl_job")
    assert a != submission_id("verl_ppo", "manual__2026-01-02", "submit_verl_job")
    assert a != submission_id("verl_ppo", "manual__2026-01-01", "other_task")
    assert a != submission_id("other_dag", "manual__2026-01-01", "submit_verl_job")
    assert a.endswith("-a1")
    assert a.startswith("verl-verl-ppo-")


def test_attempts() -> None:
    prefix = submission_prefix("d", "r", "t")
    assert attempt_of(submission_id("d", "r", "t", 3), prefix) == 3
    assert attempt_of(submission_id("d", "r2", "t", 3), prefix) is None
    assert attempt_of("unrelated-job", prefix) is None
    with pytest.raises(ValueError):
        submission_id("d", "r", "t", 0)


def test_ids_are_safe_names() -> None:
    sid = submission_id("My DAG/with spaces", "scheduled__2026-01-01T00:00:00+00:00", "t")
    assert all(c.isalnum() or c == "-" for c in sid)
