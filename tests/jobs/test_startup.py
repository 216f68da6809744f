"""What a wait keeps of its job's start, alone: the first step's record."""

from __future__ import annotations

from pathlib import Path

from verl_pipeline.jobs.progress import Progress, first_step_seen_at
from verl_pipeline.jobs.run_files import write_all
from verl_pipeline.jobs.startup import FirstStepRecord


def test_the_first_step_seen_is_written_once_beside_the_metrics_file(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-a1.jsonl"
    record = FirstStepRecord(str(metrics))
    assert record.writes() == []  # no step yet
    record.step(Progress(step=1, total=4, first_step_seen_at=500.0))
    record.step(Progress(step=2, total=4, first_step_seen_at=500.0))
    assert write_all(record.writes()) == [] and record.writes() == []
    assert first_step_seen_at(metrics) == 500.0
    later = FirstStepRecord(str(metrics))  # a waiter that reattached later: the first record stays
    later.step(Progress(step=3, total=4, first_step_seen_at=900.0))
    assert write_all(later.writes()) == [] and first_step_seen_at(metrics) == 500.0


def test_without_a_metrics_file_nothing_is_recorded() -> None:
    record = FirstStepRecord(None)
    record.step(Progress(step=1, total=4, first_step_seen_at=500.0))
    assert record.writes() == []
