"""Operators of the ``verl_ppo`` DAG. Each builds the run's spec from the DAG run's params, calls a
plain step from :mod:`verl_pipeline.steps`, and returns a small JSON-able result for XCom.

Tasks find each other's results by task id (``xcom_pull``) so that teardown still works when an
upstream task failed before pushing anything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from verl_pipeline.airflow.links import RayJobLink, ray_job_url
from verl_pipeline.config import RunSpec, build_run_spec
from verl_pipeline.exceptions import ConfigError, DataError, EnvironmentCheckError, PipelineError

log = logging.getLogger(__name__)

PROVISION_TASK = "provision_ray_cluster"
PREPROCESS_TASK = "preprocess_data"
PLAN_MODELS_TASK = "plan_models"
PREFETCH_TASK = "prefetch_model"
#: Airflow connection holding the hub token (password); optional.
HF_CONN_ID = "hf_default"
SUBMIT_TASK = "submit_verl_job"
WAIT_TASK = "wait_for_verl_job"
TEARDOWN_TASK = "teardown_ray_cluster"


def _connection(conn_id: str) -> Any:
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)


def run_name(context: Any) -> str:
    return f"{context['dag'].dag_id}/{context['run_id']}"


def spec_from_context(context: Any) -> RunSpec:
    params = {k: v for k, v in dict(context["params"]).items()}
    return build_run_spec(params, run_name=run_name(context))


def _fail(e: Exception) -> AirflowException:
    """The task error for a pipeline error: the user's mistakes fail at once, without retries."""
    from verl_pipeline.trainer.validate import VerlConfigError

    if isinstance(e, ConfigError | DataError | EnvironmentCheckError | VerlConfigError):
        return AirflowFailException(f"{type(e).__name__}: {e}")
    return AirflowException(f"{type(e).__name__}: {e}")


class _PipelineOperator(BaseOperator):
    """Shared plumbing: XCom lookups by task id and the project's errors as task failures."""

    def __init__(self, *, conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn_id = conn_id

    @staticmethod
    def _pull(context: Any, task_id: str) -> Any:
        return context["ti"].xcom_pull(task_ids=task_id)

    def _token(self, handle_conn_id: str | None) -> str | None:
        conn_id = self.conn_id or handle_conn_id
        if not conn_id:
            return None
        from verl_pipeline.airflow.hooks import endpoint_from_connection

        return endpoint_from_connection(_connection(conn_id))[1]


class ProvisionRayClusterOperator(_PipelineOperator):
    """Validate the run (params, profiles, verl's own config checks), then start or reach the cluster.

    Nothing starts when validation fails. Returns the cluster handle.
    """

    ui_color = "#d6eaf8"

    def __init__(self, *, validate_with_verl: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_with_verl = validate_with_verl

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps

        try:
            spec = spec_from_context(context)
            self.log.info("Run %s: profile %s (model %s, cluster %s), target %d x %d GPU(s), mode %s",
                          spec.run_name, spec.profile, spec.model_profile, spec.cluster_profile, spec.nnodes,
                          spec.n_gpus_per_node, spec.mode.value)
            for key, rule in spec.derived.items():
                self.log.info("derived %s: %s", key, rule)
            if self.validate_with_verl:
                steps.validate_spec_with_verl(spec)
            endpoint = None
            conn_id = self.conn_id or spec.cluster.get("conn_id")
            if spec.cluster.get("backend") == "address" and conn_id and not spec.cluster.get("dashboard_url"):
                from verl_pipeline.airflow.hooks import endpoint_from_connection

                endpoint = endpoint_from_connection(_connection(conn_id))
            handle = steps.provision(spec, endpoint=endpoint)
        except PipelineError as e:
            raise _fail(e) from e
        return handle.to_dict()


#: The preprocessed train/val parquet: a retraining DAG can be scheduled on it (``schedule=[...]``).
#: Each event's ``extra`` names the files, the content key and whether they are new.
class PreprocessDataOperator(_PipelineOperator):
    """Write the run's train/val parquet in verl's row schema (checked, content-keyed, atomic).

    ``recipe`` (templated) replaces the profile's recipe; the DAG passes its ``recipe`` param.
    With ``emit_asset`` the output is an event on the run profile's preprocessed-data Asset
    (through the :func:`preprocessed_data_alias` outlet), which retraining DAGs are scheduled on;
    a DAG scheduled on that Asset must not emit it (it would trigger itself).
    """

    template_fields: Sequence[str] = ("recipe",)

    def __init__(self, *, recipe: str | None = None, emit_asset: bool = True, **kwargs: Any) -> None:
        if emit_asset:
            from verl_pipeline.airflow.assets import preprocessed_data_alias

            kwargs.setdefault("outlets", [preprocessed_data_alias()])
        super().__init__(**kwargs)
        self.recipe = recipe
        self.emit_asset = emit_asset

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.data.preprocess import preprocess_for_spec

        try:
            spec = spec_from_context(context)
            result = preprocess_for_spec(spec, recipe=self.recipe or None)
        except PipelineError as e:
            raise _fail(e) from e
        c = result.counts
        self.log.info("Data (%s): %d rows in, %d train / %d val written, rejected %s, %d duplicates, %d too long%s",
                      c.get("recipe"), c.get("records_in", 0), c.get("train_rows", 0), c.get("val_rows", 0),
                      c.get("rejected"), c.get("deduplicated", 0), c.get("too_long", 0),
                      " (cached)" if result.cached else "")
        events = context.get("outlet_events")
        if self.emit_asset and events is not None:
            from verl_pipeline.airflow.assets import preprocessed_data_alias, preprocessed_data_asset

            events[preprocessed_data_alias()].add(
                preprocessed_data_asset(spec.profile),
                extra={"train_path": result.train_path, "val_path": result.val_path, "key": result.key,
                       "cached": result.cached, "recipe": c.get("recipe"), "rows": c.get("written")},
            )
        return result.to_dict()


class PlanModelsOperator(_PipelineOperator):
    """List the run's distinct models with the roles each plays: what ``prefetch_model`` maps over.

    Returns ``[{"source": ..., "roles": ["actor", ...]}, ...]`` (the actor's model first).
    """

    ui_color = "#fdebd0"

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from verl_pipeline.models.prefetch import plan_models

        try:
            plan = plan_models(spec_from_context(context))
        except PipelineError as e:
            raise _fail(e) from e
        for item in plan:
            self.log.info("Model %s for %s", item["source"], ", ".join(item["roles"]))
        return plan


class PrefetchModelOperator(_PipelineOperator):
    """Fetch (or build) one model of the run into the shared cache, verify it, return its local path by role.

    ``model`` is one item of :class:`PlanModelsOperator`'s result (the DAG maps this operator over
    them); without it, every model of the run is fetched in turn. The hub token comes from the
    Airflow connection ``hf_conn_id`` (password) when it exists, else from ``HF_TOKEN``; it is never
    logged. Returns ``{role: {"path": ..., "commit": ..., ...}}``.
    """

    ui_color = "#fdebd0"

    def __init__(self, *, model: dict[str, Any] | None = None, hf_conn_id: str | None = HF_CONN_ID,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.model = model
        self.hf_conn_id = hf_conn_id

    def _hub_token(self) -> str | None:
        if not self.hf_conn_id:
            return None
        from airflow.sdk.exceptions import AirflowNotFoundException

        try:
            conn = _connection(self.hf_conn_id)
        except AirflowNotFoundException:  # normal: public models need no token
            self.log.info("No Airflow connection %r: hub requests use HF_TOKEN if set", self.hf_conn_id)
            return None
        if conn.password:
            from airflow.sdk.log import mask_secret

            mask_secret(conn.password)  # redacted should any library ever print it
        return conn.password or None

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.models.hub import ModelAccessError
        from verl_pipeline.models.prefetch import prefetch_roles, prefetch_run

        token = self._hub_token()
        try:
            spec = spec_from_context(context)
            if self.model:
                roles = list(self.model.get("roles") or [])
                context["model_label"] = f"{'+'.join(roles)}: {self.model.get('source')}"
                out = prefetch_roles(spec, roles, token=token)
                source = out[roles[0]]["source"]
                if self.model.get("source") and source != self.model["source"]:
                    raise AirflowFailException(f"model of {roles} changed since planning: {self.model['source']} "
                                               f"-> {source}")
            else:
                out = prefetch_run(spec, token=token)
        except ModelAccessError as e:  # gated, unknown repo or revision: a retry cannot succeed
            raise AirflowFailException(f"{type(e).__name__}: {e}") from e
        except PipelineError as e:
            raise _fail(e) from e
        for role, r in out.items():
            self.log.info("%s: %s (%s)", role, r["path"], "cache hit" if r.get("cached") else "fetched")
        return out


class SubmitVerlJobOperator(_PipelineOperator):
    """Render the verl job (entrypoint + runtime_env), probe every node for what it needs, and submit
    it, or reattach to this run's live job.

    The probe (:func:`verl_pipeline.steps.check_environment`) fails a training job at once, without
    retries, when a node misses a package, a GPU or a path; in preflight mode it only reports what
    a GPU run would miss. Its report is logged and returned under ``environment``.
    """

    template_fields: Sequence[str] = ("cluster_task_id", "data_task_id", "model_task_id")
    operator_extra_links = (RayJobLink(),)

    def __init__(
        self,
        *,
        cluster_task_id: str = PROVISION_TASK,
        data_task_id: str = PREPROCESS_TASK,
        model_task_id: str = PREFETCH_TASK,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_task_id = cluster_task_id
        self.data_task_id = data_task_id
        self.model_task_id = model_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps
        from verl_pipeline.cluster.base import ClusterHandle
        from verl_pipeline.jobs.ids import submission_prefix
        from verl_pipeline.jobs.submit import submit_or_reattach

        cluster = self._pull(context, self.cluster_task_id)
        data = self._pull(context, self.data_task_id)
        from verl_pipeline.models.prefetch import models_by_role

        models = models_by_role(self._pull(context, self.model_task_id))
        if not cluster or not data or "actor" not in models:
            raise AirflowException("upstream results missing (cluster, data or model): did an upstream task fail?")
        try:
            spec = spec_from_context(context)
            handle = ClusterHandle.from_dict(cluster)
            token = self._token(handle.conn_id)
            prepared = steps.prepare_job(
                spec, handle, data=data, models=models, token=token,
                id_prefix=submission_prefix(context["dag"].dag_id, context["run_id"], self.task_id))
            job, mode, run_dir = prepared.job, prepared.mode, spec.run_dir
            self.log.info("Entrypoint: %s", job.entrypoint)
            self.log.info("runtime_env: %s", job.runtime_env)
            sub = submit_or_reattach(
                handle.client(token), job, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                task_id=self.task_id, run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir,
            )
        except PipelineError as e:
            raise _fail(e) from e
        self.log.info("Ray job %s: %s (attempt %d)", sub.submission_id, sub.action, sub.attempt)
        RayJobLink().persist(context, ray_job_url(handle.dashboard_url, sub.submission_id))
        return {**sub.to_dict(), "mode": mode.value, "run_dir": str(run_dir), "dashboard_url": handle.dashboard_url,
                "environment": prepared.environment}


class WaitForVerlJobOperator(_PipelineOperator):
    """Wait for the verl job without holding a worker slot (deferrable); job logs go to this task's log.

    Failures are classified (:mod:`verl_pipeline.jobs.classify`): the user's fail at once without
    retries; infrastructure failures fail this try, and the retry (exponential backoff from
    ``default_args``) re-provisions the cluster when it is unhealthy and submits the next attempt
    with ``trainer.resume_mode=auto`` from the last checkpoint. A retry that finds the run's job
    still alive reattaches to it. No timeout by default: RL runs last days.

    The job's new log lines are forwarded (at most ``max_lines_per_poll`` per poll) and verl's
    progress is logged at most every ``progress_interval`` seconds; the log cursor and the last
    progress travel through every deferral (``wait-cursor.json`` in the run directory), so a
    reattach or retry forwards no line twice. The result carries the last ``progress``.
    """

    template_fields: Sequence[str] = ("cluster_task_id", "submit_task_id", "data_task_id", "model_task_id")
    operator_extra_links = (RayJobLink(),)

    def __init__(
        self,
        *,
        cluster_task_id: str = PROVISION_TASK,
        submit_task_id: str = SUBMIT_TASK,
        data_task_id: str = PREPROCESS_TASK,
        model_task_id: str = PREFETCH_TASK,
        poll_interval: float = 5.0,
        max_poll_errors: int = 12,
        progress_interval: float = 60.0,
        max_lines_per_poll: int = 1000,
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

    # -- helpers ----------------------------------------------------------------------------------
    def _handle(self, context: Any, spec: RunSpec) -> Any:
        from verl_pipeline import steps

        handle = steps.current_handle(spec, self._pull(context, self.cluster_task_id))
        if handle is None:
            raise AirflowException("no cluster recorded for this run: did provision_ray_cluster fail?")
        return handle

    def _latest_job_id(self, spec: RunSpec, sub: dict[str, Any]) -> str:
        from verl_pipeline.jobs.attempts import read_attempts

        attempts = read_attempts(spec.run_dir)
        return attempts[-1].submission_id if attempts else str(sub["submission_id"])

    def _defer(self, context: Any, spec: RunSpec, handle: Any, job_id: str) -> None:
        from verl_pipeline.airflow.triggers import RayJobTrigger
        from verl_pipeline.jobs.attempts import read_attempts
        from verl_pipeline.jobs.logstream import WaitCursor

        self._job_id, self._cluster = job_id, handle.to_dict()
        RayJobLink().persist(context, ray_job_url(handle.dashboard_url, job_id))
        cursor = WaitCursor.load(spec.run_dir, job_id)
        mine = next((a for a in read_attempts(spec.run_dir) if a.submission_id == job_id), None)
        metrics_path = mine.metrics_path if mine else None
        self.log.info("Ray job %s is running: deferring (poll every %.0fs, log from byte %d)", job_id,
                      self.poll_interval, cursor.log_offset_bytes)
        self.defer(
            trigger=RayJobTrigger(cluster=handle.to_dict(), job_id=job_id, conn_id=self.conn_id or handle.conn_id,
                                  poll_interval=self.poll_interval, max_poll_errors=self.max_poll_errors,
                                  expected_nodes=handle.expected_nodes if handle.owned else 0,
                                  log_offset_bytes=cursor.log_offset_bytes,
                                  metrics_offset_bytes=cursor.metrics_offset_bytes, progress=cursor.progress,
                                  metrics_path=metrics_path,
                                  total_steps=spec.total_training_steps if metrics_path else 0,
                                  progress_interval=self.progress_interval,
                                  max_lines_per_poll=self.max_lines_per_poll),
            method_name="execute_complete",
            timeout=None,
        )

    def _raise_failure(self, job_id: str, status: str, message: str, logs: str) -> None:
        from verl_pipeline.jobs.classify import classify

        c = classify(message, logs, status=status)
        self.log.warning("Ray job %s ended %s: classified as %s (%s): %s", job_id, status, c.kind.value, c.reason,
                         c.evidence)
        text = f"Ray job {job_id} ended {status} [{c.kind.value} failure: {c.reason}]: {message}"
        if c.retryable:
            raise AirflowException(text + " — retrying re-provisions the cluster if needed and resumes from the "
                                          "last checkpoint")
        raise AirflowFailException(text + f" — not retried. Evidence: {c.evidence}")

    def _logs(self, handle: Any, job_id: str) -> str:
        try:
            return str(handle.client(self._token(handle.conn_id)).logs(job_id))
        except PipelineError:
            return ""

    # -- execution --------------------------------------------------------------------------------
    def execute(self, context: Any) -> Any:
        from verl_pipeline.constants import JobState
        from verl_pipeline.exceptions import ClusterError

        sub = self._pull(context, self.submit_task_id)
        if not sub:
            raise AirflowException("no submitted job to wait for: did the submit task fail?")
        try:
            spec = spec_from_context(context)
        except PipelineError as e:
            raise _fail(e) from e
        handle = self._handle(context, spec)
        job_id = self._latest_job_id(spec, sub)
        client = handle.client(self._token(handle.conn_id))
        try:
            info = client.get_job(job_id)
            reachable = True
        except ClusterError as e:
            self.log.warning("Cluster %s is unreachable: %s", handle.name, e)
            info, reachable = None, False
        if info is not None and not info.status.is_terminal():
            self._defer(context, spec, handle, job_id)  # also the retry of a killed waiter: reattach
        if info is not None and info.status is JobState.SUCCEEDED:
            return self._finish(context, {"status": "success", "job_id": job_id, "job_status": "SUCCEEDED"})
        first_try = int(getattr(context["ti"], "try_number", 1) or 1) <= 1
        if first_try:
            if info is None:
                message = "the cluster is unreachable" if not reachable else "the job is unknown to the cluster"
                raise AirflowException(f"Ray job {job_id}: {message} (Ray Jobs API unreachable) — retrying")
            self._raise_failure(job_id, info.status.value, info.message, self._logs(handle, job_id))
        if info is not None:
            from verl_pipeline.jobs.classify import classify

            c = classify(info.message, self._logs(handle, job_id), status=info.status.value)
            if not c.retryable:
                self._raise_failure(job_id, info.status.value, info.message, "")
        return self._recover(context, spec, handle, sub)

    def _recover(self, context: Any, spec: RunSpec, handle: Any, sub: dict[str, Any]) -> Any:
        """After an infrastructure failure: a healthy cluster, then the next attempt, resumed."""
        from verl_pipeline import steps
        from verl_pipeline.constants import Mode
        from verl_pipeline.jobs.submit import submit_or_reattach
        from verl_pipeline.models.prefetch import models_by_role

        data = self._pull(context, self.data_task_id)
        models = models_by_role(self._pull(context, self.model_task_id))
        if not data or not models:
            raise AirflowException("cannot resubmit: data or model results of this run are missing")
        try:
            token = self._token(handle.conn_id)
            handle = steps.ensure_cluster(spec, handle, token=token)
            job = steps.render(spec, data=data, models=models, mode=Mode(sub["mode"]))
            new = submit_or_reattach(handle.client(token), job, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                                     task_id=self.submit_task_id, run_dir=spec.run_dir,
                                     checkpoint_dir=spec.checkpoint_dir)
        except PipelineError as e:
            raise _fail(e) from e
        self.log.warning("Recovered: Ray job %s (%s, attempt %d) on cluster %s", new.submission_id, new.action,
                         new.attempt, handle.dashboard_url)
        if new.action == "already_succeeded":
            return self._finish(context, {"status": "success", "job_id": new.submission_id,
                                          "job_status": "SUCCEEDED"})
        self._defer(context, spec, handle, new.submission_id)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> Any:
        if event is None:
            # Resumed without a trigger event (the process that deferred died and the task was run
            # again): look at the job afresh — reattach if it still runs.
            return self.execute(context)
        from verl_pipeline.jobs.logstream import WaitCursor

        # Saved first: whatever _finish decides (retry, reattach), the next waiter continues here.
        try:
            WaitCursor.from_event(event).save(spec_from_context(context).run_dir)
        except (OSError, PipelineError) as e:
            self.log.warning("Could not save the log cursor of Ray job %s: %s", event.get("job_id"), e)
        if event.get("progress"):
            context["ti"].xcom_push(key="progress", value=event["progress"])
        return self._finish(context, event)

    def _finish(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        from verl_pipeline.jobs.logstream import WaitCursor
        from verl_pipeline.jobs.submit import preflight_summary

        job_id = event.get("job_id", "?")
        status = event.get("status")
        spec = spec_from_context(context)
        handle = self._handle(context, spec)
        sub = self._pull(context, self.submit_task_id) or {}
        if status != "success":
            message = str(event.get("message") or "")
            if status == "error":
                # The trigger could not reach the job: the backend says whether the site took the
                # cluster away (e.g. the Slurm allocation was cancelled) — an infrastructure failure.
                from verl_pipeline import steps

                health = steps.cluster_health(handle)
                if health.infrastructure:
                    raise AirflowException(
                        f"Ray job {job_id}: {message} [infrastructure failure: {health.detail}] — retrying "
                        "provisions a fresh cluster and resumes from the last checkpoint")
                raise AirflowException(f"Ray job {job_id}: {message} ({health.state}: {health.detail}) — retrying")
            if status == "node_lost":
                # The job may hang on the dead node: stop it so the retry never runs two at once.
                try:
                    handle.client(self._token(handle.conn_id)).stop(job_id)
                except PipelineError as e:
                    self.log.warning("Could not stop Ray job %s: %s", job_id, e)
                raise AirflowException(f"Ray job {job_id}: {message} [infrastructure failure: node died] — "
                                       "retrying re-provisions the cluster and resumes from the last checkpoint")
            self._raise_failure(job_id, str(event.get("job_status", status)), message, self._logs(handle, job_id))
        result: dict[str, Any] = {"job_id": job_id, "status": event.get("job_status", "SUCCEEDED"),
                                  "mode": sub.get("mode"), "run_dir": sub.get("run_dir"),
                                  "progress": event.get("progress") or WaitCursor.load(spec.run_dir, job_id).progress}
        if sub.get("mode") == "preflight":
            summary = preflight_summary(self._logs(handle, job_id))
            if summary is None:
                raise AirflowException(f"preflight job {job_id} succeeded but printed no summary")
            reward = summary["checks"].get("reward", {})
            result["preflight"] = {
                "ok": summary.get("ok"),
                "checks": {name: bool(c.get("ok")) for name, c in summary["checks"].items()},
                "all_ground_truths_score_1": reward.get("all_ground_truths_score_1"),
                "scored": {s: reward.get(s, {}).get("scored") for s in ("train", "val")},
                "cluster": summary.get("cluster"),
                "seconds": summary.get("seconds"),
            }
            self.log.info("Preflight summary for %s: %s", job_id, result["preflight"])
        else:
            result["training"] = self._check_progress(spec, job_id)
        return result

    def _check_progress(self, spec: RunSpec, job_id: str) -> dict[str, Any]:
        """A SUCCEEDED training job must have reached total_training_steps; a resumed one must have
        started right after its checkpoint and advanced."""
        from pathlib import Path

        from verl_pipeline.jobs.attempts import metric_steps, read_attempts

        attempts = read_attempts(spec.run_dir)
        mine = next((a for a in attempts if a.submission_id == job_id), None)
        if mine is None or not mine.metrics_path:
            raise AirflowException(f"no attempt record for {job_id} in {spec.run_dir}: cannot check its progress")
        steps_logged = metric_steps(Path(mine.metrics_path))
        total = spec.total_training_steps
        if not steps_logged or max(steps_logged) < total:
            raise AirflowFailException(
                f"Ray job {job_id} SUCCEEDED but reached step {max(steps_logged, default=0)} of "
                f"trainer.total_training_steps={total} (metrics: {mine.metrics_path}); a run that stops early "
                "is a failure"
            )
        if mine.resume_from_step and min(steps_logged) != mine.resume_from_step + 1:
            raise AirflowFailException(
                f"Ray job {job_id} should have resumed after checkpoint step {mine.resume_from_step} but its "
                f"first step was {min(steps_logged)}: check trainer.resume_mode and trainer.default_local_dir"
            )
        previous = [s for a in attempts if a.attempt < mine.attempt and a.metrics_path
                    for s in metric_steps(Path(a.metrics_path))]
        redone = max(0, max(previous, default=0) - mine.resume_from_step)
        out = {"attempts": len(attempts), "attempt": mine.attempt, "resumed_from_step": mine.resume_from_step,
               "first_step": min(steps_logged), "last_step": max(steps_logged), "steps_redone": redone}
        self.log.info("Training of %s: %s", job_id, out)
        return out

    def on_kill(self) -> None:
        if self._job_id and self._cluster:
            from verl_pipeline.airflow.hooks import RayJobsHook

            self.log.warning("Task killed: stopping Ray job %s", self._job_id)
            RayJobsHook(self._cluster, conn_id=self.conn_id).stop(self._job_id)


class TeardownRayClusterOperator(_PipelineOperator):
    """Stop the job if it still runs and release the cluster (when the pipeline owns it). Runs always."""

    template_fields: Sequence[str] = ("cluster_task_id", "submit_task_id")

    def __init__(self, *, cluster_task_id: str = PROVISION_TASK, submit_task_id: str = SUBMIT_TASK,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.cluster_task_id = cluster_task_id
        self.submit_task_id = submit_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps
        from verl_pipeline.cluster.base import ClusterHandle

        cluster = self._pull(context, self.cluster_task_id)
        sub = self._pull(context, self.submit_task_id) or {}
        handle = ClusterHandle.from_dict(cluster) if cluster else None
        job_id = sub.get("submission_id")
        run_dir = None
        try:
            spec = spec_from_context(context)
            run_dir = spec.run_dir
            # The run's latest cluster (a retry may have re-provisioned it; provision may have died
            # after starting processes) and its latest job attempt.
            handle = steps.current_handle(spec, cluster)
            from verl_pipeline.jobs.attempts import read_attempts

            attempts = read_attempts(spec.run_dir)
            if attempts:
                job_id = attempts[-1].submission_id
        except PipelineError as e:
            self.log.warning("Cannot resolve the run's spec (%s); tearing down only what XCom knows", e)
        try:
            result = steps.teardown(handle, job_id=job_id,
                                    token=self._token(handle.conn_id) if handle else None, run_dir=run_dir)
        except PipelineError as e:
            raise _fail(e) from e
        self.log.info("Teardown: %s", result)
        return result


def cleanup_failed_run(context: Any) -> None:
    """DAG ``on_failure_callback``: stop the run's job and cluster when the run failed without its
    teardown task running (a run marked failed by hand, a DAG-run timeout). Safe to call twice."""
    from verl_pipeline import steps
    from verl_pipeline.jobs.attempts import read_attempts

    dag_run = context.get("dag_run")
    run_id = context.get("run_id") or getattr(dag_run, "run_id", None)
    dag = context.get("dag")
    dag_id = getattr(dag, "dag_id", None) or getattr(dag_run, "dag_id", "verl_ppo")
    params = dict(context.get("params") or {})
    try:
        spec = build_run_spec({k: v for k, v in params.items()}, run_name=f"{dag_id}/{run_id}")
        handle = steps.find_handle(spec)
        attempts = read_attempts(spec.run_dir)
        result = steps.teardown(handle, job_id=attempts[-1].submission_id if attempts else None,
                                run_dir=spec.run_dir)
        log.warning("Run %s failed: cleaned up its job and cluster: %s", run_id, result)
    except PipelineError as e:
        log.error("Run %s failed and its cleanup failed too: %s", run_id, e)
