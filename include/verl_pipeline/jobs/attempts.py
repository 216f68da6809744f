"""The run's record of submitted attempts (``attempts.jsonl`` in the run directory).

Ray's job table lives in the cluster's GCS and is gone when a cluster is re-provisioned; this
record survives, so attempt numbers never repeat and a resumed attempt knows which checkpoint it
should start from.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ATTEMPTS_FILE = "attempts.jsonl"
#: Jobs the pipeline stopped itself (a hang, a lost node), with why: their retry resumes them.
STOPS_FILE = "stops.jsonl"
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: verl's file logger output of attempt N is ``metrics-a<N>.jsonl``: one file per attempt, because
#: verl's FileLogger truncates its file when a trainer starts (a resumed attempt would erase the last).
METRICS_PREFIX = "metrics-a"
METRICS_SUFFIX = ".jsonl"


@dataclass(frozen=True)
class Attempt:
    submission_id: str
    attempt: int
    submitted_at: float
    dashboard_url: str
    #: Last checkpointed step when this attempt was submitted (0: none, starts from scratch).
    resume_from_step: int
    metrics_path: str | None
    #: The run segment this attempt trains (1, or 2, 3, … after a merge on a changed world size; see
    #: :mod:`verl_pipeline.jobs.checkpoints`) and the run step it starts from: verl's step ``s`` logged
    #: by this attempt is run step ``segment_start_step + s``.
    segment: int = 1
    segment_start_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def metrics_file(run_dir: Path, attempt: int) -> Path:
    """Where verl's file logger writes the metrics of ``attempt`` (``$VERL_FILE_LOGGER_PATH``)."""
    return run_dir / f"{METRICS_PREFIX}{attempt}{METRICS_SUFFIX}"


def metrics_files(run_dir: Path) -> dict[int, Path]:
    """Every attempt's metrics file present in ``run_dir``, by attempt number (ascending)."""
    found = {}
    for path in run_dir.glob(f"{METRICS_PREFIX}*{METRICS_SUFFIX}"):
        number = path.name[len(METRICS_PREFIX):-len(METRICS_SUFFIX)]
        if number.isdigit():
            found[int(number)] = path
    return dict(sorted(found.items()))


def read_attempts(run_dir: Path) -> list[Attempt]:
    path = run_dir / ATTEMPTS_FILE
    if not path.is_file():
        return []
    return [Attempt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]


def record_attempt(run_dir: Path, attempt: Attempt) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / ATTEMPTS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(attempt.to_dict()) + "\n")
        f.flush()


def record_stop(run_dir: Path, submission_id: str, reason: str) -> None:
    """Note that the pipeline stopped ``submission_id`` because of an infrastructure problem."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / STOPS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps({"submission_id": submission_id, "reason": reason, "at": now()}) + "\n")


def stop_reason(run_dir: Path, submission_id: str) -> str | None:
    """Why the pipeline stopped ``submission_id``, if it did."""
    path = run_dir / STOPS_FILE
    if not path.is_file():
        return None
    reasons = [row["reason"] for line in path.read_text().splitlines() if line.strip()
               for row in [json.loads(line)] if row.get("submission_id") == submission_id]
    return reasons[-1] if reasons else None


def latest_checkpoint_step(checkpoint_dir: Path) -> int:
    """The step verl's tracker file names (what ``resume_mode=auto`` resumes from), 0 when none."""
    tracker = checkpoint_dir / TRACKER_FILE
    try:
        return int(tracker.read_text().strip())
    except (FileNotFoundError, ValueError):
        return 0


def metric_steps(metrics_path: Path) -> list[int]:
    """``training/global_step`` of every line verl's file logger wrote (``{"step": N, "data": {…}}``)."""
    if not metrics_path.is_file():
        return []
    steps = []
    for line in metrics_path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        steps.append(int(row.get("data", {}).get("training/global_step", row.get("step", 0))))
    return steps


def run_steps(attempt: Attempt) -> list[int]:
    """The run steps ``attempt`` logged: verl's steps offset by its segment's start (see ``segment``)."""
    if not attempt.metrics_path:
        return []
    return [attempt.segment_start_step + s for s in metric_steps(Path(attempt.metrics_path))]


def now() -> float:
    return round(time.time(), 3)
