"""What a finished wait returns (the wait task's XCom): the job, its progress, and what it did.

A training job's success is checked against its attempt's record first (:func:`training_record`,
read for ``jobs.outcome.decide``); the result then says how the run's attempts went. A preflight
job's result is the summary it printed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from airflow.sdk.exceptions import AirflowException

from verl_pipeline.constants import JobState, Mode
from verl_pipeline.jobs.outcome import TrainingRecord
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec


def run_mode(sub: dict[str, Any]) -> Mode | None:
    """The mode the run's job was submitted in (the submit task's result), None before it was decided."""
    return Mode(sub["mode"]) if sub.get("mode") else None


def training_record(spec: RunSpec, job_id: str) -> TrainingRecord:
    """The steps the attempt that ran ``job_id`` logged, against the run's total (for the decision)."""
    from verl_pipeline.jobs.attempts import run_steps
    from verl_pipeline.trainer.length import planned_steps

    mine = RunDir(spec.run_dir).attempt_of(job_id)
    if mine is None or not mine.metrics_path:
        raise AirflowException(f"no attempt record for {job_id} in {spec.run_dir}: cannot check its progress")
    # Run steps: a segment trained from merged weights (another world size) counts verl's from 1.
    return TrainingRecord(planned_steps(spec), run_steps(mine), mine.resume_from_step, mine.metrics_path)


def succeeded(waited: Any) -> bool:
    """Whether the wait task's XCom (:func:`wait_result`) says the run's job succeeded."""
    return isinstance(waited, dict) and waited.get("status") == JobState.SUCCEEDED.value


def wait_result(spec: RunSpec, job_id: str, sub: dict[str, Any], training: TrainingRecord | None, *,
                job_log: Callable[[], str], log: logging.Logger | Any) -> dict[str, Any]:
    """The result of a wait whose job succeeded (``job_log``: the job's log, read for a preflight's summary)."""
    from verl_pipeline.jobs.logstream import WaitCursor

    result: dict[str, Any] = {"job_id": job_id, "status": JobState.SUCCEEDED.value, "mode": sub.get("mode"),
                              "run_dir": sub.get("run_dir"),
                              "progress": WaitCursor.load(spec.run_dir, job_id).progress}
    if run_mode(sub) is Mode.PREFLIGHT:
        result["preflight"] = preflight_result(job_id, job_log(), log=log)
    else:
        result["training"] = training_result(spec, job_id, training, log=log)
    return result


def preflight_result(job_id: str, job_log: str, *, log: logging.Logger | Any) -> dict[str, Any]:
    """The checks of the preflight job, from the summary it printed."""
    from verl_pipeline.jobs.submit import preflight_summary

    summary = preflight_summary(job_log)
    if summary is None:
        raise AirflowException(f"preflight job {job_id} succeeded but printed no summary")
    reward = summary["checks"].get("reward", {})
    out = {
        "ok": summary.get("ok"),
        "checks": {name: bool(c.get("ok")) for name, c in summary["checks"].items()},
        "all_ground_truths_score_1": reward.get("all_ground_truths_score_1"),
        "scored": {s: reward.get(s, {}).get("scored") for s in ("train", "val")},
        "cluster": summary.get("cluster"),
        "seconds": summary.get("seconds"),
    }
    log.info("Preflight summary for %s: %s", job_id, out)
    return out


def training_result(spec: RunSpec, job_id: str, record: TrainingRecord | None, *,
                    log: logging.Logger | Any) -> dict[str, Any]:
    """How the run's attempts went (the steps of this one were read, and checked, for the decision)."""
    from verl_pipeline.jobs.attempts import run_steps

    run_dir = RunDir(spec.run_dir)
    attempts = run_dir.attempts()
    mine = next(a for a in attempts if a.submission_id == job_id)
    logged = list(record.steps_logged) if record else run_steps(mine)
    previous = [s for a in attempts if a.attempt < mine.attempt for s in run_steps(a)]
    out = {"attempts": len(attempts), "attempt": mine.attempt, "resumed_from_step": mine.resume_from_step,
           "first_step": min(logged), "last_step": max(logged),
           "steps_redone": max(0, max(previous, default=0) - mine.resume_from_step),
           "restarts": len({r.get("attempt") for r in run_dir.restart_records() if r.get("outcome") == "restart"})}
    log.info("Training of %s: %s", job_id, out)
    return out
