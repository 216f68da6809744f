"""Render, probe and submit the verl job, or reattach to this run's live job."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from airflow.sdk.exceptions import AirflowException

from verl_pipeline.airflow.links import RayJobLink, ray_job_url
from verl_pipeline.airflow.operators.base import (
    PREFETCH_TASK,
    PREPROCESS_TASK,
    PROVISION_TASK,
    WAIT_TASK,
    PipelineOperator,
    spec_from_context,
    task_error,
)
from verl_pipeline.airflow.tracker_links import MlflowRunLink, job_trackers, persist_tracker_links
from verl_pipeline.exceptions import PipelineError

#: The submit task's ``action`` for a run on a shared cluster: its job is submitted by the wait task.
QUEUED = "queued_for_pool"


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

    @staticmethod
    def _wait_deadline(context: Any) -> Any:
        """The wait task's ``execution_timeout`` as a deadline for verl (the job runs under that task)."""
        from datetime import datetime, timezone

        from verl_pipeline.jobs.deadlines import task_deadline

        try:
            wait = context["dag"].get_task(WAIT_TASK)
        except (AttributeError, KeyError, ValueError):
            return None  # a DAG without the pipeline's wait task
        return task_deadline(datetime.now(timezone.utc), getattr(wait, "execution_timeout", None))

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
            hook = self.hook(handle)
            token = hook.token()
            trackers = job_trackers(spec, handle)  # credentials: into the submit call, nowhere else
            prepared = steps.prepare_job(
                spec, handle, data=data, models=models, token=token,
                id_prefix=submission_prefix(context["dag"].dag_id, context["run_id"], self.task_id))
            job, mode, run_dir = prepared.job, prepared.mode, spec.run_dir
            self.log.info("Entrypoint: %s", job.entrypoint)
            self.log.info("runtime_env: %s", job.runtime_env)
            result = {"mode": mode.value, "run_dir": str(run_dir), "dashboard_url": handle.dashboard_url,
                      "environment": prepared.environment, "tracker_links": trackers.links}
            persist_tracker_links(context, trackers.links)
            if spec.admission is not None:
                # A shared cluster: the job is submitted by the wait task, which holds the run's pool
                # slots for the job's whole life (a slot this task held would be free again before
                # the job ends).
                self.log.info("Cluster %s is shared: %s submits the job once it holds %s", handle.name,
                              WAIT_TASK, spec.admission.describe())
                return {"submission_id": None, "action": QUEUED, "admission": spec.admission.to_dict(), **result}
            sub = submit_or_reattach(
                hook.client, job, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                task_id=self.task_id, run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir,
                deadline=self._wait_deadline(context), secret_env=trackers.env.values,
            )
        except PipelineError as e:
            raise task_error(e) from e
        self.log.info("Ray job %s: %s (attempt %d)", sub.submission_id, sub.action, sub.attempt)
        RayJobLink().persist(context, ray_job_url(handle.dashboard_url, sub.submission_id))
        return {**sub.to_dict(), **result}
