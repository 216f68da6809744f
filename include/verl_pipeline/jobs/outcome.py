"""What a wait on a verl job ends in — decided in one place.

The waiter (the trigger) reports what it saw as one :class:`WaitEvent`; the wait operator's own
look at the job (when a try starts) is expressed in the same vocabulary. :func:`decide` turns that
observation, the run's records (which step the attempt resumed from, what the pipeline itself
stopped and why, the restart budget) and verl's metrics into one :class:`Decision`:

- ``FINISH``: the job succeeded (and, when training, reached its last step);
- ``WAIT``: the job is alive — (re)attach and wait for it;
- ``RESTART``: an infrastructure failure, and the run's restart budget
  (:mod:`verl_pipeline.jobs.restart_budget`) allows another attempt: after the decision's delay, provision a
  healthy cluster and submit the next attempt, resumed from the last checkpoint — within this task
  try, so Airflow's retries are not what a run's restarts are counted by;
- ``FAIL``: the user's failure (a retry cannot fix it), or an infrastructure failure once the budget
  is used up (attempts in a row that made no progress) — fail at once, no retries.

A failure is classified once (:func:`verl_pipeline.jobs.classify.classify`) and the message names
the reason that decided, with the exception that ended the job as evidence.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from verl_pipeline.constants import JobState
from verl_pipeline.durations import format_duration
from verl_pipeline.jobs.classify import FailureKind, classify
from verl_pipeline.jobs.restart_budget import RestartBudget
from verl_pipeline.jobs.watchdog import Hang


class WaitEvent(str, Enum):
    """What a waiter saw: the ``status`` of every trigger event, and of the operator's own look."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"
    #: Fewer Ray nodes alive than provisioned while the job ran.
    NODE_LOST = "node_lost"
    #: RUNNING with no new training step for too long (see :mod:`verl_pipeline.jobs.watchdog`).
    HUNG = "hung"
    #: The Jobs API could not be reached, or the job is unknown to the cluster.
    UNREACHABLE = "unreachable"
    #: Alive (PENDING or RUNNING): only from the operator's look, never a trigger's event.
    RUNNING = "running"

    @classmethod
    def parse(cls, value: Any) -> WaitEvent:
        """The event kind of a status, also of events that triggers of an earlier release sent."""
        legacy = {"success": cls.SUCCEEDED, "error": cls.UNREACHABLE}
        text = str(value)
        return legacy.get(text) or cls(text)

    @classmethod
    def of_state(cls, state: JobState) -> WaitEvent:
        """What Ray's state of a job says, for the trigger and the operator's own look alike."""
        return _EVENT_OF_STATE[state]


#: Every Ray job state, once: a terminal state is the event that ends the wait; the others are alive.
_EVENT_OF_STATE: dict[JobState, WaitEvent] = {
    JobState.PENDING: WaitEvent.RUNNING,
    JobState.RUNNING: WaitEvent.RUNNING,
    JobState.SUCCEEDED: WaitEvent.SUCCEEDED,
    JobState.FAILED: WaitEvent.FAILED,
    JobState.STOPPED: WaitEvent.STOPPED,
}


class Action(str, Enum):
    FINISH = "finish"
    WAIT = "wait"
    RESTART = "restart"
    FAIL = "fail"


@dataclass(frozen=True)
class Observation:
    """One look at the job: by the trigger (its event) or by the operator (the job's state)."""

    kind: WaitEvent
    job_id: str
    message: str = ""
    #: Ray's status of the job when known (``FAILED``, ``STOPPED`` …).
    job_status: str = ""
    #: What the watchdog saw (``HUNG`` events of this release; the message says it for people).
    hang: Hang | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> Observation:
        return cls(WaitEvent.parse(event.get("status")), str(event.get("job_id", "?")),
                   str(event.get("message") or ""), str(event.get("job_status") or ""),
                   Hang.from_dict(event.get("hang")))

    @classmethod
    def from_job(cls, job_id: str, info: Any, *, reachable: bool) -> Observation:
        """From a :class:`~verl_pipeline.jobs.client.JobInfo` (None: unknown, or the API unreachable)."""
        if info is None:
            why = "the job is unknown to the cluster" if reachable else "the Ray Jobs API is unreachable"
            return cls(WaitEvent.UNREACHABLE, job_id, why)
        return cls(WaitEvent.of_state(info.status), job_id, info.message, info.status.value)

    @property
    def may_restart(self) -> bool:
        """Neither alive nor succeeded (failed, stopped, lost, hung, out of reach): the decision may be a
        restart, and needs the run's restart budget."""
        return self.kind not in (WaitEvent.RUNNING, WaitEvent.SUCCEEDED)

    @property
    def needs_log(self) -> bool:
        """A failure is classified from the job's log tail: fetch it before deciding."""
        return self.kind in (WaitEvent.FAILED, WaitEvent.STOPPED)


@dataclass(frozen=True)
class TrainingRecord:
    """What the run's files say of the attempt that ran ``job_id`` (training jobs only)."""

    total_steps: int
    #: ``training/global_step`` of every metrics line this attempt wrote.
    steps_logged: Sequence[int]
    resume_from_step: int = 0
    metrics_path: str = ""


@dataclass(frozen=True)
class Decision:
    action: Action
    #: The reason, as the task log and the exception say it.
    reason: str
    message: str
    kind: FailureKind | None = None
    evidence: str = ""
    #: The job may still be running (hung, or hanging on a dead node): stop it first, so a restart
    #: never runs two at once. Record why, so a later look knows the stop was the pipeline's.
    stop_job: bool = False
    #: ``RESTART``: seconds to wait before the next attempt is submitted.
    delay_s: float = 0.0
    #: An infrastructure failure's restart budget, as it was decided with (recorded and shown).
    budget: RestartBudget | None = None

    @property
    def infrastructure(self) -> bool:
        return self.kind is FailureKind.INFRASTRUCTURE


def _infrastructure(obs: Observation, reason: str, *, budget: RestartBudget | None, detail: str = "",
                    evidence: str = "", stop_job: bool = False) -> Decision:
    if budget is None:
        raise ValueError(f"the infrastructure failure of {obs.job_id} needs the run's restart budget to be decided")
    detail = " ".join(detail.split())  # the decision's message is one line
    ended = obs.kind in (WaitEvent.FAILED, WaitEvent.STOPPED)
    what = f"Ray job {obs.job_id}" + (f" ended {obs.job_status}" if ended and obs.job_status else
                                      f" ({obs.job_status})" if obs.job_status else "")
    text = f"{what} [infrastructure failure: {reason}]" + (f": {detail}" if detail and detail != reason else "")
    if budget.exhausted:
        return Decision(Action.FAIL, reason,
                        f"{text} — not restarted, the restart budget is used up: {budget.account()}"
                        # The evidence, unless it is Ray's message the detail already says.
                        + (f". Evidence: {evidence}" if evidence and evidence[:60] not in detail else "")
                        + ". Fix: remove the cause, then clear the wait task (it resumes from the checkpoint "
                          "with a renewed budget), or raise restarts.no_progress_limit in the run profile",
                        FailureKind.INFRASTRUCTURE, evidence, stop_job, budget=budget)
    return Decision(Action.RESTART, reason,
                    f"{text} — restart {budget.restarts + 1} in {format_duration(budget.delay_s)}, on a healthy "
                    f"cluster, from the last checkpoint. Restart budget: {budget.account()}",
                    FailureKind.INFRASTRUCTURE, evidence, stop_job,
                    budget.delay_s, budget)


def decide(
    obs: Observation,
    *,
    log_tail: str = "",
    infrastructure_gone: str | None = None,
    stopped_by_pipeline: str | None = None,
    training: TrainingRecord | None = None,
    budget: RestartBudget | None = None,
) -> Decision:
    """The one decision of a wait. Pure: everything it depends on is an argument.

    :param log_tail: the end of the job's log (failures only; see :attr:`Observation.needs_log`).
    :param infrastructure_gone: the backend's word that the site took the cluster away (e.g. "Slurm
        job 12 is CANCELLED"), when the Jobs API is unreachable.
    :param stopped_by_pipeline: why the pipeline itself stopped this job (a hang, a lost node).
    :param training: the attempt's record when the job trains (its success is checked against it).
    :param budget: the run's restart budget with this job as its latest attempt; needed for every
        observation that may end in one (:attr:`Observation.may_restart`): an infrastructure failure
        is restarted while it lasts.
    """
    if obs.kind is WaitEvent.RUNNING:
        return Decision(Action.WAIT, f"job is {obs.job_status or 'alive'}",
                        f"Ray job {obs.job_id} is {obs.job_status or 'alive'}: waiting for it")
    if obs.kind is WaitEvent.SUCCEEDED:
        return _succeeded(obs, training)
    if obs.kind is WaitEvent.NODE_LOST:
        return _infrastructure(obs, "node died", budget=budget, detail=obs.message, stop_job=True)
    if obs.kind is WaitEvent.HUNG:
        if obs.hang is None:  # an event of a trigger of an earlier release: its message says the rest
            return _infrastructure(obs, "hang", budget=budget, detail=obs.message, stop_job=True)
        return _infrastructure(obs, obs.hang.reason, budget=budget, detail=obs.hang.detail, stop_job=True)
    if obs.kind is WaitEvent.UNREACHABLE:
        if infrastructure_gone:
            return _infrastructure(obs, infrastructure_gone, budget=budget, detail=obs.message)
        return _infrastructure(obs, "Ray Jobs API unreachable", budget=budget, detail=obs.message)
    if obs.kind is WaitEvent.STOPPED and stopped_by_pipeline:
        return _infrastructure(obs, stopped_by_pipeline, budget=budget, detail="stopped by the pipeline")
    c = classify(obs.message, log_tail, status=obs.job_status or obs.kind.value.upper())
    if c.retryable:
        return _infrastructure(obs, c.reason, budget=budget, detail=_first_line(obs.message), evidence=c.evidence)
    return Decision(Action.FAIL, c.reason,
                    f"Ray job {obs.job_id} ended {obs.job_status or obs.kind.value.upper()} "
                    f"[user failure: {c.reason}] — not retried. Evidence: {c.evidence}"
                    + (f". Fix: {c.remedy}" if c.remedy else ""),
                    FailureKind.USER, c.evidence)


def _first_line(message: str) -> str:
    """Ray's status message up to its first line break: it goes on with the log's first lines (``last
    available logs …``), which the task log has already, and the decision's message stays one line."""
    return next((line.strip() for line in message.splitlines() if line.strip()), "")[:300]


def _succeeded(obs: Observation, training: TrainingRecord | None) -> Decision:
    """A SUCCEEDED training job must have reached its last step; a resumed one must have started
    right after its checkpoint."""
    done = Decision(Action.FINISH, "succeeded", f"Ray job {obs.job_id} SUCCEEDED")
    if training is None:
        return done
    logged = list(training.steps_logged)
    last = max(logged, default=0)
    if last < training.total_steps:
        reason = f"stopped early at step {last} of {training.total_steps}"
        return Decision(Action.FAIL, reason,
                        f"Ray job {obs.job_id} SUCCEEDED but reached step {last} of trainer.total_training_steps="
                        f"{training.total_steps} (metrics: {training.metrics_path}); a run that stops early is a "
                        "failure", FailureKind.USER)
    if training.resume_from_step and min(logged) != training.resume_from_step + 1:
        reason = f"did not resume after step {training.resume_from_step}"
        return Decision(Action.FAIL, reason,
                        f"Ray job {obs.job_id} should have resumed after checkpoint step "
                        f"{training.resume_from_step} but its first step was {min(logged)}: check "
                        "trainer.resume_mode and trainer.default_local_dir", FailureKind.USER)
    return done
