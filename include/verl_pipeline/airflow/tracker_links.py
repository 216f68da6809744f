"""The run's trackers inside Airflow: credentials from connections, and a button to the tracker's run.

:func:`job_tracker_env` is what the submit steps pass to the job (``submit_or_reattach(secret_env=…)``);
:func:`check_tracker_connections` runs in the provision task, so a missing connection fails the run
before any cluster starts; :func:`persist_tracker_links` stores the tracker's run page once the run
exists (verl creates it when its trainer starts), for :class:`MlflowRunLink`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperatorLink

from verl_pipeline.trackers import (
    LOGGER_KEY,
    Tracker,
    TrackerEnv,
    chosen_trackers,
    exposure_problem,
    logger_backends,
    mlflow_run_url,
    tracker_env,
)

if TYPE_CHECKING:
    from verl_pipeline.config import RunSpec

log = logging.getLogger(__name__)


class MlflowRunLink(BaseOperatorLink):
    """``MLflow run``: the run's page on the MLflow server, stored in XCom once the run is found."""

    name = "MLflow run"

    def persist(self, context: Any, url: str) -> None:
        context["ti"].xcom_push(key=self.xcom_key, value=url)

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(key=self.xcom_key, ti_key=ti_key)
        return str(value) if value else ""


def find_connection(conn_id: str) -> Any | None:
    """The Airflow connection ``conn_id``, None when there is none."""
    from airflow.sdk import BaseHook
    from airflow.sdk.exceptions import AirflowNotFoundException

    try:
        return BaseHook.get_connection(conn_id)
    except AirflowNotFoundException:
        return None


def run_tracker_env(spec: RunSpec) -> TrackerEnv:
    """The variables of the run's trackers (``trainer.logger``) from their connections, each secret
    registered with Airflow's masker; ConfigError for a missing connection or field."""
    from airflow.sdk.log import mask_secret

    env = tracker_env(logger_backends(spec.verl.get(LOGGER_KEY)), spec.trackers, find_connection)
    for name in env.secret:
        mask_secret(env.values[name])  # redacted should any library ever print it
    return env


def check_tracker_connections(spec: RunSpec) -> None:
    """Fail before any cluster starts when a tracker of the run has no usable connection."""
    env = run_tracker_env(spec)
    if env.values:
        log.info("Trackers of run %s: %s", spec.run_name, env.shown())


def job_tracker_env(spec: RunSpec, handle: Any) -> dict[str, str]:
    """The tracker variables for a job on ``handle``'s cluster (refused on an auth-disabled Jobs API)."""
    env = run_tracker_env(spec)
    problem = exposure_problem(env, handle.auth_mode, dashboard_url=handle.dashboard_url)
    if problem is not None:
        raise problem
    return env.values


def persist_tracker_links(context: Any, spec: RunSpec) -> str | None:
    """Look up the run's MLflow run (experiment = ``trainer.project_name``, run = ``trainer.experiment_name``)
    and store its page for :class:`MlflowRunLink`; the URL, or None when the run uses no MLflow or
    the server does not know the run yet."""
    from verl_pipeline.trainer.render import tracker_names

    if Tracker.MLFLOW not in chosen_trackers(logger_backends(spec.verl.get(LOGGER_KEY))):
        return None
    project, experiment = tracker_names(spec)
    url = mlflow_run_url(run_tracker_env(spec), experiment_name=project, run_name=experiment)
    if url:
        MlflowRunLink().persist(context, url)
        log.info("MLflow run of %s: %s", spec.run_name, url)
    return url


__all__ = ["MlflowRunLink", "check_tracker_connections", "find_connection", "job_tracker_env",
           "persist_tracker_links", "run_tracker_env"]
