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
from verl_pipeline.exceptions import ConfigError, DataError, PipelineError

log = logging.getLogger(__name__)

PROVISION_TASK = "provision_ray_cluster"
PREPROCESS_TASK = "preprocess_data"
PREFETCH_TASK = "prefetch_model"
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

    if isinstance(e, ConfigError | DataError | VerlConfigError):
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
PREPROCESSED_DATA_ASSET_NAME = "verl_pipeline_preprocessed_data"


def preprocessed_data_asset() -> Any:
    from airflow.sdk import Asset

    return Asset(name=PREPROCESSED_DATA_ASSET_NAME, uri="verl-pipeline://preprocessed-data",
                 group="verl_pipeline")


class PreprocessDataOperator(_PipelineOperator):
    """Write the run's train/val parquet in verl's row schema (checked, content-keyed, atomic).

    ``recipe`` (templated) replaces the profile's recipe; the DAG passes its ``recipe`` param.
    The output is the :func:`preprocessed_data_asset` outlet.
    """

    template_fields: Sequence[str] = ("recipe",)

    def __init__(self, *, recipe: str | None = None, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [preprocessed_data_asset()])
        super().__init__(**kwargs)
        self.recipe = recipe

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
        if events is not None:
            for asset in self.outlets:
                events[asset].extra = {"train_path": result.train_path, "val_path": result.val_path,
                                       "key": result.key, "cached": result.cached, "recipe": c.get("recipe"),
                                       "rows": c.get("written")}
        return result.to_dict()


class PrefetchModelOperator(_PipelineOperator):
    """Fetch (or build) the actor model, and the critic's when it differs; return local paths."""

    def __init__(self, *, hf_conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.hf_conn_id = hf_conn_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.models.prefetch import prefetch

        token = None
        if self.hf_conn_id:
            token = _connection(self.hf_conn_id).password or None
        try:
            spec = spec_from_context(context)
            out = {"actor": prefetch(spec.model, spec.model_cache, token=token).to_dict()}
            if spec.critic_model and spec.critic_model != spec.model:
                out["critic"] = prefetch(spec.critic_model, spec.model_cache, token=token).to_dict()
        except PipelineError as e:
            raise _fail(e) from e
        return out


class SubmitVerlJobOperator(_PipelineOperator):
    """Render the verl job (entrypoint + runtime_env) and submit it, or reattach to this run's live job."""

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
        from verl_pipeline.jobs.submit import submit_or_reattach

        cluster = self._pull(context, self.cluster_task_id)
        data = self._pull(context, self.data_task_id)
        models = self._pull(context, self.model_task_id)
        if not cluster or not data or not models:
            raise AirflowException("upstream results missing (cluster, data or model): did an upstream task fail?")
        try:
            spec = spec_from_context(context)
            handle = ClusterHandle.from_dict(cluster)
            token = self._token(handle.conn_id)
            mode = steps.resolve_mode(spec, handle, token)
            job = steps.render(spec, data=data, models=models, mode=mode)
            run_dir = steps.save_run_files(spec, job)
            self.log.info("Entrypoint: %s", job.entrypoint)
            self.log.info("runtime_env: %s", job.runtime_env)
            sub = submit_or_reattach(
                handle.client(token), job, dag_id=context["dag"].dag_id, run_id=context["run_id"],
                task_id=self.task_id,
            )
        except PipelineError as e:
            raise _fail(e) from e
        self.log.info("Ray job %s: %s (attempt %d)", sub.submission_id, sub.action, sub.attempt)
        RayJobLink().persist(context, ray_job_url(handle.dashboard_url, sub.submission_id))
        return {**sub.to_dict(), "mode": mode.value, "run_dir": str(run_dir), "dashboard_url": handle.dashboard_url}


class WaitForVerlJobOperator(_PipelineOperator):
    """Wait for the verl job without holding a worker slot (deferrable); job logs go to this task's log.

    No timeout by default: RL runs last days. Set ``execution_timeout`` to cap one.
    """

    template_fields: Sequence[str] = ("cluster_task_id", "submit_task_id")
    operator_extra_links = (RayJobLink(),)

    def __init__(
        self,
        *,
        cluster_task_id: str = PROVISION_TASK,
        submit_task_id: str = SUBMIT_TASK,
        poll_interval: float = 5.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.cluster_task_id = cluster_task_id
        self.submit_task_id = submit_task_id
        self.poll_interval = poll_interval
        self._job_id: str | None = None
        self._cluster: dict[str, Any] | None = None

    def execute(self, context: Any) -> Any:
        from verl_pipeline.airflow.hooks import RayJobsHook
        from verl_pipeline.airflow.triggers import RayJobTrigger

        cluster = self._pull(context, self.cluster_task_id)
        sub = self._pull(context, self.submit_task_id)
        if not cluster or not sub:
            raise AirflowException("no submitted job to wait for: did the submit task fail?")
        job_id = sub["submission_id"]
        self._job_id, self._cluster = job_id, cluster
        hook = RayJobsHook(cluster, conn_id=self.conn_id)
        RayJobLink().persist(context, ray_job_url(hook.handle.dashboard_url, job_id))
        info = hook.get_job(job_id)
        if info is None:
            raise AirflowException(f"Ray job {job_id} does not exist on {hook.handle.dashboard_url}")
        if info.status.is_terminal():
            return self._finish(context, {"status": "success" if info.status.value == "SUCCEEDED" else "failed",
                                          "job_id": job_id, "job_status": info.status.value,
                                          "message": info.message, "driver_exit_code": info.driver_exit_code})
        self.log.info("Ray job %s is %s: deferring (poll every %.0fs)", job_id, info.status.value, self.poll_interval)
        self.defer(
            trigger=RayJobTrigger(cluster=cluster, job_id=job_id, conn_id=self.conn_id or hook.conn_id,
                                  poll_interval=self.poll_interval),
            method_name="execute_complete",
            timeout=None,
        )

    def execute_complete(self, context: Any, event: dict[str, Any]) -> Any:
        return self._finish(context, event)

    def _finish(self, context: Any, event: dict[str, Any]) -> dict[str, Any]:
        from verl_pipeline.airflow.hooks import RayJobsHook
        from verl_pipeline.jobs.submit import preflight_summary

        job_id = event.get("job_id", "?")
        status = event.get("status")
        cluster = self._pull(context, self.cluster_task_id)
        sub = self._pull(context, self.submit_task_id) or {}
        if status != "success":
            raise AirflowException(
                f"Ray job {job_id} ended {event.get('job_status', status)}: {event.get('message')}"
                f" (driver exit code {event.get('driver_exit_code')})"
            )
        result: dict[str, Any] = {"job_id": job_id, "status": event.get("job_status", "SUCCEEDED"),
                                  "mode": sub.get("mode"), "run_dir": sub.get("run_dir")}
        if sub.get("mode") == "preflight":
            logs = RayJobsHook(cluster, conn_id=self.conn_id).logs(job_id)
            summary = preflight_summary(logs)
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
        return result

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
        run_dir = None
        try:
            spec = spec_from_context(context)
            run_dir = spec.run_dir
            if handle is None:
                # Provision may have died after starting processes: find them from the run's state.
                handle = steps.find_handle(spec)
        except PipelineError as e:
            self.log.warning("Cannot resolve the run's spec (%s); tearing down only what XCom knows", e)
        try:
            result = steps.teardown(handle, job_id=sub.get("submission_id"),
                                    token=self._token(handle.conn_id) if handle else None, run_dir=run_dir)
        except PipelineError as e:
            raise _fail(e) from e
        self.log.info("Teardown: %s", result)
        return result
