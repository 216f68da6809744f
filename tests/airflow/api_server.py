"""Airflow's API server parts that serve this project's plugin app, in-process: the plugin loaded from the
repo's plugins/ and mounted by Airflow's ``init_plugins``, the configured (simple) auth manager and its
JWTs, and DAG runs with XCom in the metadata DB, made as the DAG processor, a trigger and a task do."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

DAG_FILE = """
from airflow.sdk import DAG
from airflow.providers.standard.operators.empty import EmptyOperator

with DAG(dag_id={dag_id!r}, schedule=None, catchup=False):
    EmptyOperator(task_id={task_id!r})
"""


@contextmanager
def repo_plugins(monkeypatch: Any) -> Iterator[None]:
    """Airflow's plugin manager reading the repo's plugins/ (as the stack's api-server does); its
    caches are cleared before and after, so other tests see their own plugins folder again."""
    from airflow import plugins_manager, settings

    caches = [plugins_manager._get_plugins, plugins_manager.get_fastapi_plugins,
              plugins_manager._get_ui_plugins, plugins_manager._get_extra_operators_links_plugins,
              plugins_manager.get_flask_plugins]
    monkeypatch.setattr(settings, "PLUGINS_FOLDER", str(REPO / "plugins"))
    for c in caches:
        c.cache_clear()
    try:
        yield
    finally:
        for c in caches:
            c.cache_clear()


@contextmanager
def served_plugins() -> Iterator[Any]:
    """A test client of an app with the plugins mounted (``init_plugins``, as ``create_app`` calls it)
    and the configured auth manager (``init_auth_manager``)."""
    from airflow.api_fastapi.app import init_auth_manager, init_plugins, purge_cached_app
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    app = FastAPI()
    init_plugins(app)
    init_auth_manager(app)
    try:
        with TestClient(app) as client:
            yield client
    finally:
        purge_cached_app()


def jwt(role: str | None) -> str:
    """A JWT of the simple auth manager for a user with ``role`` (None: a user without a role)."""
    from airflow.api_fastapi.app import get_auth_manager
    from airflow.api_fastapi.auth.managers.simple.user import SimpleAuthManagerUser

    return str(get_auth_manager().generate_jwt(SimpleAuthManagerUser(username=f"u-{role}", role=role)))


def dag_run(tmp_path: Path, dag_id: str, task_id: str) -> str:
    """A DAG ``dag_id`` with one task ``task_id``, parsed from a file and written as the DAG processor
    does, and a run of it created as a trigger does; returns the run id (Airflow's form, with ``:`` and
    ``+`` that need quoting in URLs)."""
    from airflow.dag_processing.bundles.manager import DagBundlesManager
    from airflow.dag_processing.dagbag import DagBag, sync_bag_to_db
    from airflow.serialization.serialized_objects import DagSerialization
    from airflow.utils.state import DagRunState
    from airflow.utils.types import DagRunTriggeredByType, DagRunType

    dag_file = tmp_path / "dags" / f"{dag_id}.py"
    dag_file.parent.mkdir(exist_ok=True)
    dag_file.write_text(DAG_FILE.format(dag_id=dag_id, task_id=task_id))
    DagBundlesManager().sync_bundles_to_db()
    bag = DagBag(dag_folder=str(dag_file))
    assert bag.import_errors == {}
    sync_bag_to_db(bag, "dags-folder", None)
    now = datetime.now(timezone.utc)
    run_id = f"manual__{now.isoformat()}"
    scheduler_dag = DagSerialization.deserialize_dag(DagSerialization.serialize_dag(bag.dags[dag_id]))
    scheduler_dag.create_dagrun(run_id=run_id, run_after=now, run_type=DagRunType.MANUAL,
                                triggered_by=DagRunTriggeredByType.TEST, state=DagRunState.RUNNING)
    return run_id


def set_xcom(dag_id: str, run_id: str, task_id: str, key: str, value: Any) -> None:
    """An XCom as the task runner's push stores it."""
    from airflow.models.xcom import XComModel

    XComModel.set(key, value, dag_id=dag_id, task_id=task_id, run_id=run_id)
