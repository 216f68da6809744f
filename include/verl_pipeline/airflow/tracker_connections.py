"""The run's trackers inside Airflow: credentials from connections, and the tracker pages of its job.

:func:`check_tracker_connections` runs in the provision task, so a missing connection (of a tracker, or of
the profile's model registry) fails the run before any cluster starts. :func:`job_trackers` is what a submit
passes to the job (``submit_or_reattach(secret_env=trackers.env.values)``) and the run's tracker pages, which
:func:`~verl_pipeline.airflow.links.persist_tracker_links` stores for the task's
:class:`~verl_pipeline.airflow.links.MlflowRunLink` button. :func:`run_registry_env`
is the registry's server and login for :func:`verl_pipeline.registry.register`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from verl_pipeline.airflow.links import MlflowRunLink
from verl_pipeline.trackers import (
    LOGGER_KEY,
    MLFLOW_RUN_VAR,
    Tracker,
    TrackerEnv,
    chosen_trackers,
    exposure_problem,
    logger_backends,
    mlflow_run,
    registry_env,
    tracker_env,
)

if TYPE_CHECKING:
    from verl_pipeline.spec import RunSpec

log = logging.getLogger(__name__)


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


def run_registry_env(spec: RunSpec) -> TrackerEnv | None:
    """The MLflow server and login of the run profile's model registry (``MLFLOW_TRACKING_URI``,
    ``MLFLOW_TRACKING_USERNAME``, ``MLFLOW_TRACKING_PASSWORD``), each secret registered with Airflow's masker;
    None when the profile names no registry, ConfigError for a missing connection or field."""
    from airflow.sdk.log import mask_secret

    env = registry_env(spec.trackers, find_connection)
    if env is not None:
        for name in env.secret:
            mask_secret(env.values[name])  # redacted should any library ever print it
    return env


def check_tracker_connections(spec: RunSpec) -> None:
    """Fail before any cluster starts when a tracker of the run, or its model registry, has no usable connection."""
    env = run_tracker_env(spec)
    if env.values:
        log.info("Trackers of run %s: %s", spec.run_name, env.shown())
    registry, registry_server = spec.trackers.registry, run_registry_env(spec)
    if registry is not None and registry_server is not None:
        log.info("Model registry of run %s: %s on %s", spec.run_name, registry.model_name, registry_server.shown())


@dataclass(frozen=True)
class JobTrackers:
    """What a job's trackers need (``env``, credentials included: pass it to the submit call only) and
    the pages of their runs by link name."""

    env: TrackerEnv
    links: dict[str, str]


def job_trackers(spec: RunSpec, handle: Any) -> JobTrackers:
    """The tracker variables for a job of ``spec`` on ``handle``'s cluster (refused on an auth-disabled
    Jobs API), with the run's MLflow run (found or created, :func:`~verl_pipeline.trackers.mlflow_run`)
    as ``MLFLOW_RUN_ID`` so every attempt logs to it."""
    from verl_pipeline.trainer.render import tracker_names

    env = run_tracker_env(spec)
    problem = exposure_problem(env, handle.auth_mode, dashboard_url=handle.dashboard_url)
    if problem is not None:
        raise problem
    links: dict[str, str] = {}
    if Tracker.MLFLOW in chosen_trackers(logger_backends(spec.verl.get(LOGGER_KEY))):
        project, experiment = tracker_names(spec)
        run = mlflow_run(env, experiment_name=project, run_name=experiment)
        if run is not None:
            env = env.merged(TrackerEnv({MLFLOW_RUN_VAR: run.run_id}))
            links[MlflowRunLink.name] = run.url
            log.info("MLflow run of %s: %s", spec.run_name, run.url)
    return JobTrackers(env, links)


__all__ = ["JobTrackers", "check_tracker_connections", "find_connection", "job_trackers", "run_registry_env",
           "run_tracker_env"]
