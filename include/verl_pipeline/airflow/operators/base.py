"""What every operator of the pipeline shares: task ids, the run's spec from the context, errors as task failures.

Tasks find each other's results by task id (``xcom_pull``) so that teardown still works when an
upstream task failed before pushing anything.
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from airflow.sdk import BaseOperator
from airflow.sdk.exceptions import AirflowException, AirflowFailException

from verl_pipeline import steps
from verl_pipeline.airflow.task_ids import (
    PROVISION_TASK,
    RUN_DIR_KEY,
    WAIT_TASK,
)
from verl_pipeline.exceptions import ConfigError, DataError, EnvironmentCheckError
from verl_pipeline.jobs.deadlines import Deadline, task_deadline
from verl_pipeline.profiles import Asked, build_run_spec
from verl_pipeline.spec import RunSpec

log = logging.getLogger(__name__)

#: Airflow connection holding the hub token (password); optional.
HF_CONN_ID = "hf_default"


def connection(conn_id: str) -> Any:
    from airflow.sdk import BaseHook

    return BaseHook.get_connection(conn_id)


def run_name(context: Any) -> str:
    return f"{context['dag'].dag_id}/{context['run_id']}"


def spec_from_params(context: Any) -> RunSpec:
    """The run's spec built from the DAG run's params and the profiles under ``configs/`` as they are now:
    only provision does this (it freezes the result); every later task reads :func:`spec_from_context`."""
    from verl_pipeline.models.prefetch import config_on_this_machine

    return build_run_spec(dict(context["params"]), run_name=run_name(context), model_config=config_on_this_machine)


def provisioned_spec(context: Any) -> RunSpec:
    """The spec provision uses: the run's frozen one when it has one (a retry of the task), else the one
    its params make now. A param whose value the frozen run does not have (a DAG run id used again with
    other params) is refused; a retry's params are the run's own, so they always agree."""
    spec = spec_from_params(context)
    return steps.frozen_or(spec, Asked.of(dict(context["params"])), starts="when triggering the DAG run")


def freeze_run(context: Any, spec: RunSpec) -> None:
    """Freeze ``spec`` (checked) as the run's spec and say where it is (XCom ``run_dir`` of the provision
    task): what the provision task leaves for every later task, retry and resubmission."""
    steps.freeze(spec)
    context["ti"].xcom_push(key=RUN_DIR_KEY, value=str(spec.run_dir))


def spec_from_context(context: Any) -> RunSpec:
    """The run's frozen spec, saved by the provision task (``configs/`` is not read again: a retry days
    later submits what the run started with).

    A run whose provision recorded none was provisioned by an earlier release (a deployment upgraded
    while the run trains): its spec comes from its params and ``configs/``, as it did then, and the
    task log says so. A run whose provision failed has none either: building it raises the same error.
    """
    run_dir = context["ti"].xcom_pull(task_ids=PROVISION_TASK, key=RUN_DIR_KEY)
    if run_dir:
        return steps.load_frozen(Path(run_dir))
    spec = spec_from_params(context)
    log.warning("Run %s: %s recorded no frozen spec (provisioned by an earlier release): its spec is built "
                "from its params and configs/ as they are now", spec.run_name, PROVISION_TASK)
    return spec


def wait_deadline(context: Any) -> Deadline | None:
    """When the wait task gives up (its ``execution_timeout``), as the deadline verl saves ahead of.

    The job runs under the wait task: counted from that task's start when it is the one submitting
    (a retry, a shared cluster's admission), else from now (the submit task, just before it).
    """
    try:
        wait = context["dag"].get_task(WAIT_TASK)
    except (AttributeError, KeyError, ValueError):
        return None  # a DAG without the pipeline's wait task
    ti = context["ti"]
    start = getattr(ti, "start_date", None) if getattr(ti, "task_id", None) == WAIT_TASK else None
    return task_deadline(start or datetime.now(timezone.utc), getattr(wait, "execution_timeout", None))


def task_error(e: Exception) -> AirflowException:
    """The task error for a pipeline error: the user's mistakes fail at once, without retries."""
    from verl_pipeline.trainer.validate import VerlConfigError

    if isinstance(e, ConfigError | DataError | EnvironmentCheckError | VerlConfigError):
        return AirflowFailException(f"{type(e).__name__}: {e}")
    return AirflowException(f"{type(e).__name__}: {e}")


class PipelineOperator(BaseOperator):
    """Shared plumbing: XCom lookups by task id and the project's errors as task failures."""

    def __init__(self, *, conn_id: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.conn_id = conn_id

    @staticmethod
    def _pull(context: Any, task_id: str) -> Any:
        return context["ti"].xcom_pull(task_ids=task_id)

    def hook(self, handle: Any) -> Any:
        """The Ray hook (all Ray I/O) for ``handle``, with this operator's connection if it has one."""
        from verl_pipeline.airflow.hooks import RayJobsHook

        return RayJobsHook(handle.to_dict(), conn_id=self.conn_id or handle.conn_id)
