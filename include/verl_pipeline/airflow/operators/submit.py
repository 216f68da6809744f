"""Render, probe and submit the verl job, or reattach to this run's live job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk.exceptions import AirflowException

from verl_pipeline.airflow.links import MlflowRunLink, RayJobLink, persist_tracker_links
from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error, wait_deadline
from verl_pipeline.airflow.task_ids import PREFETCH_TASK, PREPROCESS_TASK, PROVISION_TASK, WAIT_TASK
from verl_pipeline.airflow.tracker_connections import job_trackers
from verl_pipeline.constants import SubmitAction
from verl_pipeline.exceptions import PipelineError


class SubmitVerlJobOperator(PipelineOperator):
    """Render the verl job (entrypoint + runtime_env), probe every node for what it needs, and submit
    it, or reattach to this run's live job. On a shared cluster (a cluster profile with ``pool:``)
    the wait task submits it, under the run's pool slots (:mod:`verl_pipeline.airflow.policy`).

    The probe (:func:`verl_pipeline.steps.check_environment`) fails a training job at once, without
    retries, when a node misses a package, a GPU or a path; in preflight mode it only reports what
    a GPU run would miss. Its report is logged and returned under ``environment``.
    """

    template_fields: Sequence[str] = ("cluster_task_id", "data_task_id", "model_task_id")
    operator_extra_links = (RayJobLink(), MlflowRunLink())

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
        from verl_pipeline.models.prefetch import models_by_role

        cluster = self._pull(context, self.cluster_task_id)
        data = self._pull(context, self.data_task_id)
        models = models_by_role(self._pull(context, self.model_task_id))
        if not cluster or not data or "actor" not in models:
            raise AirflowException("upstream results missing (cluster, data or model): did an upstream task fail?")
        try:
            spec = spec_from_context(context)
            handle = ClusterHandle.from_dict(cluster)
            hook = self.hook(handle)
            trackers = job_trackers(spec, handle)  # credentials: into the submit call, nowhere else
            persist_tracker_links(context, trackers.links)
            result: dict[str, Any] = {"run_dir": str(spec.run_dir), "dashboard_url": handle.dashboard_url,
                                      "tracker_links": trackers.links}
            if spec.admission is not None:
                # A shared cluster: the job is submitted by the wait task, which holds the run's pool
                # slots for the job's whole life (a slot this task held would be free again before
                # the job ends). What it will submit is checked now.
                prepared = steps.prepare_job(
                    spec, handle, hook.client, data=data, models=models,
                    id_prefix=submission_prefix(context["dag"].dag_id, context["run_id"], self.task_id))
                self._log_job(prepared.job)
                self.log.info("Cluster %s is shared: %s submits the job once it holds %s", handle.name,
                              WAIT_TASK, spec.admission.describe())
                return {"submission_id": None, "action": SubmitAction.QUEUED_FOR_POOL.value,
                        "admission": spec.admission.to_dict(), "mode": prepared.mode.value,
                        "environment": prepared.environment, **result}
            done = steps.submit_attempt(
                spec, handle, hook.client, data=data, models=models, dag_id=context["dag"].dag_id,
                run_id=context["run_id"], task_id=self.task_id, deadline=wait_deadline(context),
                secret_env=trackers.env.values)
        except PipelineError as e:
            raise task_error(e) from e
        sub = done.submission
        if done.prepared is not None:
            self._log_job(done.prepared.job)
            result["environment"] = done.prepared.environment
        self.log.info("Ray job %s: %s (attempt %d)", sub.submission_id, sub.action.value, sub.attempt)
        RayJobLink().persist(context, sub.submission_id)
        return {**sub.to_dict(), "mode": self._mode(spec, done), **result}

    def _log_job(self, job: Any) -> None:
        self.log.info("Entrypoint: %s", job.entrypoint)
        self.log.info("runtime_env: %s", job.runtime_env)

    @staticmethod
    def _mode(spec: Any, done: Any) -> str:
        """The run's mode: decided by this submission, or by the one that started the job reattached to."""
        from verl_pipeline.rundir import RunDir

        if done.mode is not None:
            return str(done.mode.value)
        return str((RunDir(spec.run_dir).job() or {}).get("mode") or spec.mode.value)
