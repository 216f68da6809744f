"""A run's restart budget, read from its own records: any number of restarts while it makes progress.

An attempt **made progress** when the run's newest complete checkpoint is past the step the attempt
resumed from once it ended. For an earlier attempt that is the step the next attempt resumed from
(found by its submit from the checkpoints themselves, recorded in ``attempts.jsonl``); for the
latest, the checkpoint directory as it is now (:func:`~verl_pipeline.jobs.checkpoints.newest_run_step`).
Steps logged without a checkpoint behind them are no progress (the next attempt trains them again),
nor is a crash before the first step; the steps an attempt logged (its metrics file) only say which
of the two it was. A preflight job never checkpoints: each of its attempts is one without progress.

:class:`RestartBudget` counts the attempts *in a row* without progress that end the record, against
the run profile's ``restarts: no_progress_limit`` (:class:`~verl_pipeline.restarts.RestartPolicy`);
``jobs.outcome.decide`` restarts while that count is within the limit and fails the run with the
budget's one-line account when it is past it. Since every attempt moves the checkpoint on or counts,
and the checkpoints are finite, a run restarts a bounded number of times.

**A person renews it.** When the budget ran out, the decision is recorded (``restarts.jsonl``,
``exhausted``). The wait task only runs again after that when someone clears it: the attempts up to
the one that used the budget up no longer count, so the cleared task restarts the run from its
checkpoint with the whole budget.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline.constants import Mode
from verl_pipeline.jobs.attempts import run_steps
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.rundir import RunDir, now
from verl_pipeline.spec import RunSpec


class RestartOutcome(str, Enum):
    """What was decided for the attempt that failed (the ``outcome`` of a ``restarts.jsonl`` line)."""

    RESTART = "restart"
    EXHAUSTED = "exhausted"


@dataclass(frozen=True)
class AttemptProgress:
    """How far one attempt got, from the run's records (run steps: a segment's steps are offset)."""

    attempt: int
    submission_id: str
    #: The checkpoint step it resumed from (0: from scratch).
    resumed_from: int
    #: The newest complete checkpoint's step once it ended (for the latest attempt: now).
    checkpoint_after: int
    #: The last training step it logged; None: it logged none.
    last_step: int | None = None

    @property
    def progressed(self) -> bool:
        return self.checkpoint_after > self.resumed_from

    def describe(self) -> str:
        if self.progressed:
            return (f"attempt {self.attempt} moved the checkpoint from step {self.resumed_from} to "
                    f"{self.checkpoint_after}")
        if self.last_step is None:
            return (f"attempt {self.attempt} ended before its first training step "
                    f"(checkpoint still at step {self.checkpoint_after})")
        return (f"attempt {self.attempt} trained to step {self.last_step} but saved no checkpoint past step "
                f"{self.resumed_from}")


@dataclass(frozen=True)
class RestartBudget:
    """The run's budget when its latest attempt has failed: pure arithmetic over the attempts' progress."""

    policy: RestartPolicy
    #: Every attempt of the run, oldest first; the last is the one that failed.
    attempts: tuple[AttemptProgress, ...]
    #: Attempts up to this number no longer count: a person cleared the wait task after they used the
    #: budget up (0: none).
    renewed_after: int = 0

    @property
    def latest(self) -> AttemptProgress | None:
        return self.attempts[-1] if self.attempts else None

    @property
    def no_progress(self) -> int:
        """Attempts in a row without progress, ending with the latest (0: the latest made progress)."""
        count = 0
        for a in reversed(self.attempts):
            if a.attempt <= self.renewed_after or a.progressed:
                break
            count += 1
        return count

    @property
    def exhausted(self) -> bool:
        return self.no_progress > self.policy.no_progress_limit

    @property
    def left(self) -> int:
        """Attempts without progress the run can still have restarted, after this restart."""
        return max(0, self.policy.no_progress_limit - self.no_progress)

    @property
    def restarts(self) -> int:
        """Restarts so far (the attempts after the first), not counting the one being decided."""
        return max(0, len(self.attempts) - 1)

    @property
    def delay_s(self) -> float:
        return self.policy.delay(self.no_progress)

    def account(self) -> str:
        """The budget in one line: what the latest attempt did and what is left (the task log's words)."""
        latest = self.latest
        did = latest.describe() if latest else "no attempt recorded"
        renewed = f"; renewed after attempt {self.renewed_after}" if self.renewed_after else ""
        if self.exhausted:
            return (f"{did}; {self.no_progress} attempts in a row made no progress and "
                    f"restarts.no_progress_limit is {self.policy.no_progress_limit}{renewed}")
        return (f"{did}; {self.left} of {self.policy.no_progress_limit} restarts without progress left "
                f"({self.no_progress} attempt(s) in a row without progress, {self.restarts} restart(s) before this one"
                f"{renewed})")

    def record(self, *, outcome: RestartOutcome, reason: str) -> dict[str, Any]:
        """The ``restarts.jsonl`` line of this decision (the run report reads these)."""
        latest = self.latest
        return {"attempt": latest.attempt if latest else 0, "submission_id": latest.submission_id if latest else "",
                "reason": reason, "outcome": outcome.value, "progressed": bool(latest and latest.progressed),
                "resumed_from": latest.resumed_from if latest else 0,
                "checkpoint_after": latest.checkpoint_after if latest else 0,
                "last_step": latest.last_step if latest else None, "no_progress": self.no_progress,
                "no_progress_limit": self.policy.no_progress_limit, "left": self.left,
                "delay_s": 0.0 if self.exhausted else self.delay_s, "renewed_after": self.renewed_after,
                "account": self.account(), "at": now()}


def attempt_progress(run_dir: RunDir, checkpoint_now: int) -> list[AttemptProgress]:
    """Every attempt's progress from ``attempts.jsonl`` and the metrics files; ``checkpoint_now``: the run
    step of the newest complete checkpoint now (the latest attempt's; the earlier ones' is the step the
    next one resumed from)."""
    attempts = run_dir.attempts()
    out = []
    for i, a in enumerate(attempts):
        after = attempts[i + 1].resume_from_step if i + 1 < len(attempts) else checkpoint_now
        steps = run_steps(a)
        out.append(AttemptProgress(a.attempt, a.submission_id, a.resume_from_step, after,
                                   max(steps) if steps else None))
    return out


def renewed_after(records: Sequence[dict[str, Any]]) -> int:
    """The last attempt that used the budget up (its ``exhausted`` record), 0 when none did."""
    return max((int(r.get("attempt", 0)) for r in records if r.get("outcome") == RestartOutcome.EXHAUSTED.value),
               default=0)


def run_budget(run_dir: Path, policy: RestartPolicy, *, checkpoint_dir: Path | None,
               settings: dict[str, Any] | None) -> RestartBudget:
    """The budget of the run in ``run_dir`` as its records stand (``checkpoint_dir`` and the job's verl
    ``settings`` for a training job's checkpoints; None for a job that does not checkpoint)."""
    from verl_pipeline.jobs.checkpoints import newest_run_step

    rd = RunDir(run_dir)
    recorded = rd.attempts()
    now_step = recorded[-1].resume_from_step if recorded else 0
    if checkpoint_dir is not None and settings is not None:
        now_step = newest_run_step(checkpoint_dir, settings)
    return RestartBudget(policy, tuple(attempt_progress(rd, now_step)), renewed_after(rd.restart_records()))


def spec_budget(spec: RunSpec) -> RestartBudget:
    """:func:`run_budget` of a run, its latest attempt the one that just ended: the checkpoints are read
    when its job (``job.json``) trains."""
    job = RunDir(spec.run_dir).job() or {}
    trains = job.get("mode") == Mode.TRAIN.value
    return run_budget(spec.run_dir, spec.restarts, checkpoint_dir=spec.checkpoint_dir if trains else None,
                      settings=dict(job.get("settings") or {}) if trains else None)


__all__ = ["AttemptProgress", "RestartBudget", "RestartOutcome", "attempt_progress", "renewed_after", "run_budget",
           "spec_budget"]
