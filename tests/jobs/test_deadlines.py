"""The allocation's end, read and passed to verl the way verl 0.9.1 reads it."""

from __future__ import annotations

import logging
from datetime import datetime, timedelta, timezone

import pytest

from verl_pipeline.cluster.slurm import slurm_end_time
from verl_pipeline.cluster.slurm_rest import slurm_rest_end_time
from verl_pipeline.constants import Mode
from verl_pipeline.jobs.deadlines import (
    DEADLINE_ENV,
    Deadline,
    earliest,
    task_deadline,
    with_deadline,
)
from verl_pipeline.trainer.render import RenderedJob


def _job(**settings: object) -> RenderedJob:
    overrides = [f"{k}={v}" for k, v in sorted(settings.items())]
    return RenderedJob(mode=Mode.TRAIN, entrypoint=" ".join(["python", "-m", "verl.trainer.main_ppo", *overrides]),
                       overrides=overrides, runtime_env={"env_vars": {"A": "1"}}, settings=dict(settings), derived={})


def test_slurm_end_time_is_scontrol_local_time() -> None:
    at = slurm_end_time({"JobState": "RUNNING", "EndTime": "2026-12-01T16:30:00"})
    assert at == datetime(2026, 12, 1, 16, 30).timestamp()
    assert slurm_end_time({"EndTime": "Unknown"}) is None  # no time limit
    assert slurm_end_time({}) is None


def test_slurmrestd_end_time_in_both_record_shapes() -> None:
    assert slurm_rest_end_time({"end_time": 1_800_000_000}) == 1_800_000_000.0
    assert slurm_rest_end_time({"end_time": {"set": True, "infinite": False, "number": 1_800_000_000}}) == 1.8e9
    assert slurm_rest_end_time({"end_time": {"set": False, "number": 0}}) is None
    assert slurm_rest_end_time({}) is None


def test_the_earliest_known_deadline_wins() -> None:
    a, b = Deadline(200.0, "slurm"), Deadline(100.0, "airflow")
    assert earliest([a, None, b]) is b
    assert earliest([None, None]) is None


def test_task_deadline_is_start_plus_execution_timeout() -> None:
    start = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
    d = task_deadline(start, timedelta(hours=2))
    assert d is not None and d.at == (start + timedelta(hours=2)).timestamp() and "execution_timeout" in d.source
    assert task_deadline(start, None) is None


def test_with_deadline_sets_verl_env_for_every_worker(caplog: pytest.LogCaptureFixture) -> None:
    job = _job(**{"trainer.use_v1": False, "trainer.esi_redundant_time": 30})
    with caplog.at_level(logging.INFO):
        out = with_deadline(job, Deadline(1_800_000_000.5, "Slurm job 7 EndTime"), job_id="raysub-1")
    assert out.runtime_env["env_vars"] == {"A": "1", DEADLINE_ENV: "1800000000"}
    assert job.runtime_env["env_vars"] == {"A": "1"}  # the rendered job is not changed
    assert "trainer.esi_redundant_time=30" in out.entrypoint
    assert "raysub-1" in caplog.text and "verl saves a checkpoint before it" in caplog.text
    assert with_deadline(job, None, job_id="raysub-1") is job


def test_the_v1_trainer_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        out = with_deadline(_job(), Deadline(1_800_000_000, "x"), job_id="raysub-2")
    assert out.runtime_env["env_vars"][DEADLINE_ENV] == "1800000000"
    assert "trainer.esi_redundant_time=0" in out.entrypoint
    assert "raysub-2" in caplog.text and "trainer.use_v1=false" in caplog.text
