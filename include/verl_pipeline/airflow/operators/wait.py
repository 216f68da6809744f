"""Wait for the verl job: defer to the trigger, then act on the one decision of :mod:`verl_pipeline.jobs.outcome`.

The path from "Ray says the job failed" to "restart with resume", in reading order:

1. :class:`~verl_pipeline.airflow.triggers.RayJobTrigger` polls the job and yields one event, a
   :class:`~verl_pipeline.jobs.outcome.WaitEvent` (``failed``, ``node_lost``, ``hung`` …);
2. :meth:`WaitForVerlJobOperator.execute_complete` turns it into an
   :class:`~verl_pipeline.jobs.outcome.Observation` — as :meth:`~WaitForVerlJobOperator.execute`
   does with its own look at the job when a try starts;
3. the run's restart budget is read from its records (:func:`verl_pipeline.jobs.restart_budget.run_budget`:
   which attempts moved the checkpoint on) and :func:`~verl_pipeline.jobs.outcome.decide` decides
   (classifying a failure once);
4. :meth:`WaitForVerlJobOperator._act` carries the decision out and records a restart decision
   (``restarts.jsonl``, the ``restart_budget`` XCom): ``RESTART`` defers to a timer for the
   decision's delay (no worker slot held), then :meth:`~WaitForVerlJobOperator.restart_after_delay`
   provisions a healthy cluster (re-provisioned when the old one is gone) and submits the next
   attempt, resumed from the last checkpoint (:meth:`~WaitForVerlJobOperator._resubmit`), and waits
   on it — all within the task's try. ``FAIL`` fails the task without retries.

Restarts are counted by the run's budget, not by Airflow's retries: a week-long run that keeps
training is restarted as often as it loses a node. Airflow's retries (``default_args``) are left
for the try itself failing (its worker lost, a cluster that cannot be provisioned just now); the
next try looks at the job afresh and decides again from the same records.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowFailException

from verl_pipeline.airflow.links import MlflowRunLink, RayJobLink, persist_tracker_links
from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error, wait_deadline
from verl_pipeline.airflow.operators.wait_result import run_mode, training_record, wait_result
from verl_pipeline.airflow.task_ids import (
    PREFETCH_TASK,
    PREPROCESS_TASK,
    PROVISION_TASK,
    RESTART_BUDGET_KEY,
    SUBMIT_TASK,
)
from verl_pipeline.airflow.tracker_connections import job_trackers
from verl_pipeline.constants import Mode, SubmitAction
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.jobs.outcome import Action, Decision, Observation, WaitEvent
from verl_pipeline.jobs.restart_budget import spec_budget
from verl_pipeline.jobs.wait_request import WaitRequest
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer.length import planned_steps


def _skipped(spec: RunSpec) -> list[str]:
    """The start-up phases the run's current job was rendered without (its ``job.json``: validation on a resume)."""
    from verl_pipeline.jobs.startup.phases import skipped_phases

    return sorted(p.value for p in skipped_phases((RunDir(spec.run_dir).job() or {}).get("settings")))


class WaitForVerlJobOperator(PipelineOperator):
    """Wait for the verl job without holding a worker slot (deferrable); job logs go to this task's log.

    What happens when the job ends is decided by :func:`verl_pipeline.jobs.outcome.decide`: the
    user's failures fail at once without retries; infrastructure failures (a lost node, a hang, a
    cluster taken away) restart the run while its restart budget lasts (the run profile's
    ``restarts:``: any number of restarts after attempts that moved the checkpoint on, a few in a
    row after attempts that did not): after a delay, the cluster is re-provisioned when it is
    unhealthy and the next attempt submitted from the last complete checkpoint, within this try. A
    try that finds the run's job still alive reattaches to it. No timeout by default: RL runs last days;
    the hang watchdog (the run profile's ``watch:``) ends a training job that stops making steps.

    The job's new log lines are forwarded (at most ``max_lines_per_poll`` per poll) and verl's
    progress is logged at most every ``progress_interval`` seconds; the log cursor and the last
    progress travel through every deferral (``wait-cursor.json`` in the run directory), so a
    reattach or restart forwards no line twice. The result carries the last ``progress``.

    On a shared cluster (a cluster profile with ``pool:``) this task also submits the job: it runs
    in the cluster's Airflow pool with a slot per GPU of the run (:mod:`verl_pipeline.airflow.policy`),
    and the pool counts it while deferred, so no other run's job starts on those GPUs meanwhile.
    """

    template_fields: Sequence[str] = ("cluster_task_id", "submit_task_id", "data_task_id", "model_task_id")
    operator_extra_links = (RayJobLink(), MlflowRunLink())

    def __init__(
        self,
        *,
        cluster_task_id: str = PROVISION_TASK,
        submit_task_id: str = SUBMIT_TASK,
        data_task_id: str = PREPROCESS_TASK,
        model_task_id: str = PREFETCH_TASK,
        poll_interval: float = WaitRequest.poll_interval,
        max_poll_errors: int = WaitRequest.max_poll_errors,
        progress_interval: float = WaitRequest.progress_interval,
        max_lines_per_poll: int = WaitRequest.max_lines_per_poll,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_task_id = cluster_task_id
        self.submit_task_id = submit_task_id
        self.data_task_id = data_task_id
        self.model_task_id = model_task_id
        self.poll_interval = poll_interval
        self.max_poll_errors = max_poll_errors
        self.progress_interval = progress_interval
        self.max_lines_per_poll = max_lines_per_poll
        self._job_id: str | None = None
        self._cluster: dict[str, Any] | None = None

    # -- the two ways in ----------------------------------------------------------------------------
    def execute(self, context: Any) -> Any:
        """A try starts (the first, Airflow's retry, a person's clear, or a waiter whose process died): look
        at the job afresh."""
        sub = self._pull(context, self.submit_task_id)
        if not sub:
            raise AirflowException("no submitted job to wait for: did the submit task fail?")
        persist_tracker_links(context, sub.get("tracker_links") or {})
        try:
            spec = spec_from_context(context)
        except PipelineError as e:
            raise task_error(e) from e
        handle = self._handle(context, spec)
        hook = self.hook(handle)  # this try's one hook (a new one only for a re-provisioned cluster)
        run_dir = RunDir(spec.run_dir)
        if not sub.get("submission_id") and not run_dir.attempts():
            return self._submit_admitted(context, spec, handle, hook, sub)
        job_id = str(run_dir.latest_job_id(sub.get("submission_id")))
        return self._act(context, spec, handle, hook, sub, self._look(hook, handle, job_id))

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        """The trigger's one event."""
        if event is None:
            # Resumed without a trigger event (the process that deferred died and the task was run
            # again): look at the job afresh — reattach if it still runs.
            return self.execute(context)
        from verl_pipeline.jobs.logstream import WaitCursor

        spec = spec_from_context(context)
        # Saved first: whatever is decided (restart, reattach), the next waiter continues here.
        try:
            WaitCursor.from_event(event).save(spec.run_dir)
        except (OSError, PipelineError) as e:
            self.log.warning("Could not save the log cursor of Ray job %s: %s", event.get("job_id"), e)
        if event.get("progress"):
            context["ti"].xcom_push(key="progress", value=event["progress"])
        sub = self._pull(context, self.submit_task_id) or {}
        handle = self._handle(context, spec)
        return self._act(context, spec, handle, self.hook(handle), sub, Observation.from_event(event))

    def restart_after_delay(self, context: Any, event: Any = None, reason: str = "") -> Any:
        """The restart's delay is over (the timer's event): the next attempt, on a healthy cluster — unless
        the job is alive after all (the Jobs API was out of reach for a while) or has succeeded."""
        spec = spec_from_context(context)
        sub = self._pull(context, self.submit_task_id) or {}
        handle = self._handle(context, spec)
        hook = self.hook(handle)
        job_id = str(RunDir(spec.run_dir).latest_job_id(sub.get("submission_id")))
        obs = self._look(hook, handle, job_id)
        if obs.kind in (WaitEvent.RUNNING, WaitEvent.SUCCEEDED):
            self.log.warning("Ray job %s is %s after %s: not restarting it", job_id, obs.job_status, reason)
            return self._act(context, spec, handle, hook, sub, obs)
        return self._resubmit(context, spec, handle, hook, sub, reason or "an infrastructure failure")

    def _look(self, hook: Any, handle: Any, job_id: str) -> Observation:
        """The job as the Jobs API reports it now (unreachable: said so, to be decided like a trigger's event)."""
        from verl_pipeline.exceptions import ClusterError

        try:
            info, reachable = hook.get_job(job_id), True
        except ClusterError as e:
            self.log.warning("Cluster %s is unreachable while looking at Ray job %s: %s", handle.name, job_id, e)
            info, reachable = None, False
        return Observation.from_job(job_id, info, reachable=reachable)

    # -- the decision, and carrying it out ----------------------------------------------------------
    def _act(self, context: Any, spec: RunSpec, handle: Any, hook: Any, sub: dict[str, Any], obs: Observation) -> Any:
        from verl_pipeline.jobs.outcome import decide

        training = (training_record(spec, obs.job_id)
                    if obs.kind is WaitEvent.SUCCEEDED and run_mode(sub) is Mode.TRAIN else None)
        decision = decide(
            obs,
            log_tail=self._log_text(hook, obs.job_id) if obs.needs_log else "",
            infrastructure_gone=self._gone(handle) if obs.kind is WaitEvent.UNREACHABLE else None,
            stopped_by_pipeline=RunDir(spec.run_dir).stop_reason(obs.job_id) if obs.kind is WaitEvent.STOPPED else None,
            training=training,
            budget=spec_budget(spec) if obs.may_restart else None,
        )
        self.log.log(logging.INFO if decision.action in (Action.WAIT, Action.FINISH) else logging.WARNING,
                     "Ray job %s: %s -> %s (%s)", obs.job_id, obs.kind.value, decision.action.value, decision.reason)
        if decision.stop_job:
            # It may hang on (a dead node, a stuck collective): stop it so a restart never runs two at once,
            # and note why, so a later look knows the stop was the pipeline's and resumes the run.
            RunDir(spec.run_dir).record_stop(obs.job_id, decision.reason)
            self._stop(hook, obs.job_id)
        if decision.infrastructure and decision.budget is not None:
            self._record_budget(context, spec, decision)
        if decision.action is Action.WAIT:
            return self._defer(context, spec, handle, obs.job_id, run_mode(sub))
        if decision.action is Action.FINISH:
            return wait_result(spec, obs.job_id, sub, training, job_log=lambda: self._log_text(hook, obs.job_id),
                               log=self.log)
        if decision.action is Action.RESTART:
            self.log.warning("%s", decision.message)
            return self._restart(context, spec, handle, hook, sub, decision)
        raise AirflowFailException(decision.message)

    def _record_budget(self, context: Any, spec: RunSpec, decision: Decision) -> None:
        """A restart decision into the run's ``restarts.jsonl`` (the report's and the next decision's
        record) and this task's ``restart_budget`` XCom (the UI shows it while the run goes on)."""
        from verl_pipeline.jobs.restart_budget import RestartOutcome

        assert decision.budget is not None  # an infrastructure decision carries the budget it was made with
        outcome = RestartOutcome.RESTART if decision.action is Action.RESTART else RestartOutcome.EXHAUSTED
        row = decision.budget.record(outcome=outcome, reason=decision.reason)
        self.log.warning("Restart budget of run %s (%s): %s", spec.run_key, spec.restarts.describe(),
                         decision.budget.account())
        try:
            RunDir(spec.run_dir).record_restart(row)
        except OSError as e:
            self.log.warning("Could not record the restart decision in %s: %s", spec.run_dir, e)
        context["ti"].xcom_push(key=RESTART_BUDGET_KEY, value=row)

    def _restart(self, context: Any, spec: RunSpec, handle: Any, hook: Any, sub: dict[str, Any],
                 decision: Decision) -> Any:
        """The next attempt now, or after the decision's delay (deferred to a timer: no worker slot held)."""
        if decision.delay_s <= 0:
            return self._resubmit(context, spec, handle, hook, sub, decision.reason)
        from datetime import datetime, timedelta, timezone

        from airflow.providers.standard.triggers.temporal import DateTimeTrigger

        self.defer(trigger=DateTimeTrigger(moment=datetime.now(timezone.utc) + timedelta(seconds=decision.delay_s)),
                   method_name="restart_after_delay", kwargs={"reason": decision.reason}, timeout=None)

    def _resubmit(self, context: Any, spec: RunSpec, handle: Any, hook: Any, sub: dict[str, Any],
                  reason: str) -> Any:
        """After an infrastructure failure: a healthy cluster, then the next attempt, resumed."""
        from verl_pipeline import steps

        try:
            healthy = steps.ensure_cluster(spec, handle, hook.client)
            if healthy is not handle:  # re-provisioned: another cluster, reached by a hook of its own
                handle, hook = healthy, self.hook(healthy)
            new = self._submit_next(context, spec, handle, hook)
        except PipelineError as e:
            raise task_error(e) from e
        self.log.warning("Recovered from %s: Ray job %s (%s, attempt %d) on cluster %s", reason,
                         new.submission_id, new.action.value, new.attempt, handle.dashboard_url)
        return self._follow(context, spec, handle, hook, sub, new)

    def _submit_admitted(self, context: Any, spec: RunSpec, handle: Any, hook: Any, sub: dict[str, Any]) -> Any:
        """A run on a shared cluster: this task holds the run's pool slots now, so it submits the job."""
        try:
            new = self._submit_next(context, spec, handle, hook)
        except PipelineError as e:
            raise task_error(e) from e
        self.log.info("Admitted with %s: Ray job %s (%s, attempt %d) on cluster %s",
                      spec.admission.describe() if spec.admission else "no pool", new.submission_id,
                      new.action.value, new.attempt, handle.dashboard_url)
        return self._follow(context, spec, handle, hook, sub, new)

    def _submit_next(self, context: Any, spec: RunSpec, handle: Any, hook: Any) -> Any:
        """The run's next attempt through the one submit path (or its live job, reattached)."""
        from verl_pipeline import steps
        from verl_pipeline.models.prefetch import models_by_role

        data = self._pull(context, self.data_task_id)
        models = models_by_role(self._pull(context, self.model_task_id))
        if not data or not models:
            raise AirflowException("cannot submit: data or model results of this run are missing")
        # Every attempt's job gets the tracker credentials (a file only its workers read).
        trackers = job_trackers(spec, handle)
        done = steps.submit_attempt(spec, handle, hook.client, data=data, models=models,
                                    dag_id=context["dag"].dag_id, run_id=context["run_id"],
                                    task_id=self.submit_task_id, deadline=wait_deadline(context),
                                    secret_env=trackers.env.values)
        return done.submission

    def _follow(self, context: Any, spec: RunSpec, handle: Any, hook: Any, sub: dict[str, Any], new: Any) -> Any:
        """Wait for a job just submitted (or found): defer, or finish when it had already succeeded."""
        if new.action is SubmitAction.ALREADY_SUCCEEDED:
            return self._act(context, spec, handle, hook, sub,
                             Observation(WaitEvent.SUCCEEDED, new.submission_id, job_status=new.status))
        return self._defer(context, spec, handle, new.submission_id, run_mode(sub))

    def _defer(self, context: Any, spec: RunSpec, handle: Any, job_id: str, mode: Mode | None) -> None:
        from verl_pipeline.airflow.triggers import RayJobTrigger
        from verl_pipeline.jobs.logstream import WaitCursor

        self._job_id, self._cluster = job_id, handle.to_dict()
        RayJobLink().persist(context, job_id)
        cursor = WaitCursor.load(spec.run_dir, job_id)
        mine = RunDir(spec.run_dir).attempt_of(job_id)
        metrics_path = mine.metrics_path if mine else None
        training = mode is Mode.TRAIN
        self.log.info("Ray job %s is running: deferring (poll every %.0fs, log from byte %d%s)", job_id,
                      self.poll_interval, cursor.log_offset_bytes,
                      f"; hang watchdog: {spec.watch.describe()}" if training else "")
        self.defer(
            trigger=RayJobTrigger(**WaitRequest(
                cluster=handle.to_dict(), job_id=job_id, conn_id=self.conn_id or handle.conn_id,
                poll_interval=self.poll_interval, max_poll_errors=self.max_poll_errors,
                expected_nodes=handle.expected_nodes if handle.owned else 0,
                log_offset_bytes=cursor.log_offset_bytes,
                metrics_offset_bytes=cursor.metrics_offset_bytes, progress=cursor.progress,
                metrics_path=metrics_path,
                total_steps=planned_steps(spec) if metrics_path else 0,
                progress_interval=self.progress_interval,
                max_lines_per_poll=self.max_lines_per_poll,
                watch=spec.watch.to_dict() if training else None,
                startup_skipped=_skipped(spec) if training else [],
                cursor_dir=str(spec.run_dir)).to_dict()),
            method_name="execute_complete",
            timeout=None,
        )

    def _stop(self, hook: Any, job_id: str) -> None:
        """Stop the job and wait (bounded) until Ray says it ended, so a restart or a later look sees it ended."""
        from verl_pipeline.jobs.client import wait_job_ended

        try:
            hook.stop(job_id)
            wait_job_ended(hook.client, job_id)
        except PipelineError as e:
            self.log.warning("Could not stop Ray job %s: %s", job_id, e)

    # -- what the decision reads ------------------------------------------------------------------
    def _handle(self, context: Any, spec: RunSpec) -> Any:
        from verl_pipeline import steps

        handle = steps.current_handle(spec, self._pull(context, self.cluster_task_id))
        if handle is None:
            raise AirflowException("no cluster recorded for this run: did provision_ray_cluster fail?")
        return handle

    def _log_text(self, hook: Any, job_id: str) -> str:
        try:
            return str(hook.logs(job_id))
        except PipelineError:
            return ""

    def _gone(self, handle: Any) -> str | None:
        """The backend's word that the site took the cluster away (an infrastructure failure), if so."""
        from verl_pipeline import steps

        health = steps.cluster_health(handle)
        self.log.warning("Cluster %s: %s (%s)", handle.name, health.state, health.detail)
        return health.detail if health.infrastructure else None

    def on_kill(self) -> None:
        """The task is killed while it runs on a worker (not deferred: then the trigger's on_kill acts)."""
        if self._job_id and self._cluster:
            from verl_pipeline.airflow.hooks import RayJobsHook

            self.log.warning("Task killed: stopping Ray job %s", self._job_id)
            RayJobsHook(self._cluster, conn_id=self.conn_id).stop(self._job_id)
