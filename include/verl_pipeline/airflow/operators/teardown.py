"""Tear the run down: stop its job, release its cluster — always, also for a run that failed."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error
from verl_pipeline.airflow.task_ids import PROVISION_TASK, SUBMIT_TASK
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec

log = logging.getLogger(__name__)


class TeardownRayClusterOperator(PipelineOperator):
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
            spec = run_spec_for_cleanup(context)
            run_dir = spec.run_dir
            # The run's latest cluster (a retry may have re-provisioned it; provision may have died
            # after starting processes) and its latest job attempt.
            handle = steps.current_handle(spec, cluster)
            job_id = RunDir(run_dir).latest_job_id(job_id)
        except PipelineError as e:
            self.log.warning("Cannot resolve the run's spec (%s); tearing down only what XCom knows", e)
        try:
            result = steps.teardown(handle, client=self.hook(handle).client if handle else None, job_id=job_id,
                                    run_dir=run_dir)
        except PipelineError as e:
            raise task_error(e) from e
        self.log.info("Teardown: %s", result)
        return result


def run_spec_for_cleanup(context: Any) -> RunSpec:
    """The run's frozen spec; when provision recorded none (it failed early, or died after starting
    processes), the spec from the params, only to find the run's directory and cluster."""
    from verl_pipeline import steps

    if context.get("ti") is not None:
        try:
            return spec_from_context(context)
        except PipelineError as e:
            log.warning("%s; finding the run's directory from its params", e)
        except Exception as e:  # a cleanup must go on: its XCom may be out of reach
            # A DAG-level callback runs outside any task: Airflow 3's XCom reads need a task's supervisor
            # (`dags test` raises ImportError for SUPERVISOR_COMMS; the dag-processor has none either).
            log.warning("The run's XCom cannot be read from this callback (%s: %s); finding the run's directory "
                        "from its params", type(e).__name__, e)
    dag_run = context.get("dag_run")
    dag_id = getattr(context.get("dag"), "dag_id", None) or getattr(dag_run, "dag_id", "verl_ppo")
    run_id = context.get("run_id") or getattr(dag_run, "run_id", None)
    built = build_run_spec(dict(context.get("params") or {}), run_name=f"{dag_id}/{run_id}")
    return steps.frozen_or(built)


def cleanup_failed_run(context: Any) -> None:
    """DAG ``on_failure_callback``: stop the run's job and cluster when the run failed without its
    teardown task running (a run marked failed by hand, a DAG-run timeout). Safe to call twice."""
    from verl_pipeline import steps

    run_id = context.get("run_id") or getattr(context.get("dag_run"), "run_id", None)
    try:
        spec = run_spec_for_cleanup(context)
        result = steps.teardown(steps.find_handle(spec), job_id=RunDir(spec.run_dir).latest_job_id(),
                                run_dir=spec.run_dir)
        log.warning("Run %s failed: cleaned up its job and cluster: %s", run_id, result)
    except PipelineError as e:
        log.error("Run %s failed and its cleanup failed too: %s", run_id, e)
