"""The cluster policy puts a run on a shared cluster in its pool: real task instances, a real metadata DB."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import write_pooled_cluster
from verl_pipeline.airflow.policy import task_instance_mutation_hook

REPO = Path(__file__).resolve().parents[2]
POOL = "shared_h100_test"


@pytest.fixture
def pooled_dag(own_configs: Path, airflow_db: Path) -> Any:
    """verl_ppo (serialized, as the scheduler holds it) with a cluster profile ``shared`` naming a pool."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    write_pooled_cluster(own_configs, POOL)
    bag = DagBag(dag_folder=str(REPO / "dags" / "verl_ppo.py"))
    assert bag.import_errors == {}
    yield DagSerialization.from_dict(DagSerialization.to_dict(bag.dags["verl_ppo"]))
    _delete_pool()


def _delete_pool() -> None:
    from airflow.models.pool import Pool
    from airflow.utils.session import create_session

    with create_session() as session:
        session.query(Pool).filter(Pool.pool == POOL).delete()


def _pool() -> Any:
    from airflow.models.pool import Pool

    return Pool.get_pool(POOL)


def _ti(dag: Any, task_id: str, conf: dict[str, Any] | None) -> tuple[Any, Any]:
    from airflow.models.dagrun import DagRun
    from airflow.models.taskinstance import TaskInstance

    run = DagRun(dag_id=dag.dag_id, run_id="manual__policy", conf=conf, run_type="manual")
    return TaskInstance(dag.get_task(task_id), run_id=run.run_id, dag_version_id=None), run


def test_a_shared_clusters_run_waits_in_its_pool_with_a_slot_per_gpu(pooled_dag: Any) -> None:
    _delete_pool()
    ti, run = _ti(pooled_dag, "wait_for_verl_job", {"cluster_profile": "shared", "n_gpus_per_node": 4})
    assert (ti.pool, ti.pool_slots) == ("default_pool", 1)
    task_instance_mutation_hook(ti, dag_run=run)
    assert (ti.pool, ti.pool_slots) == (POOL, 4)
    pool = _pool()
    # Created on first use: the cluster's GPUs (expected_gpus), counting the deferred wait.
    assert (pool.slots, pool.include_deferred) == (8, True)


def test_an_existing_pool_is_never_changed_only_warned_about(pooled_dag: Any,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    from airflow.models.pool import Pool

    Pool.create_or_update_pool(POOL, slots=2, description="sized by an admin", include_deferred=False)
    ti, run = _ti(pooled_dag, "wait_for_verl_job", {"cluster_profile": "shared", "n_gpus_per_node": 4})
    with caplog.at_level(logging.WARNING, logger="verl_pipeline.airflow.policy"):
        task_instance_mutation_hook(ti, dag_run=run)
    assert (ti.pool, ti.pool_slots) == (POOL, 4)
    assert (_pool().slots, _pool().include_deferred) == (2, False)
    assert "does not count deferred tasks" in caplog.text and "--include-deferred" in caplog.text
    assert "has 2 slots and a run needs 4" in caplog.text


@pytest.mark.parametrize("task_id,conf", [
    ("wait_for_verl_job", {}),                                   # the default cluster is the run's own
    ("wait_for_verl_job", {"cluster_profile": "gpu-address"}),   # shared, but no pool named
    ("submit_verl_job", {"cluster_profile": "shared"}),          # only the wait task holds the slots
    ("wait_for_verl_job", {"cluster_profile": "shared", "nnodes": 4, "n_gpus_per_node": 8}),  # invalid
    ("wait_for_verl_job", {"profile": "no-such-profile"}),       # invalid: its provision task says so
])
def test_other_tasks_and_runs_keep_their_pool_and_nothing_raises(pooled_dag: Any, task_id: str,
                                                                 conf: dict[str, Any]) -> None:
    _delete_pool()
    ti, run = _ti(pooled_dag, task_id, conf)
    task_instance_mutation_hook(ti, dag_run=run)
    assert (ti.pool, ti.pool_slots) == ("default_pool", 1)
    assert _pool() is None


def test_without_the_run_the_hook_leaves_the_task_instance_alone(pooled_dag: Any) -> None:
    ti, _ = _ti(pooled_dag, "wait_for_verl_job", {"cluster_profile": "shared"})
    task_instance_mutation_hook(ti, dag_run=None)  # Airflow's first call, from TaskInstance()
    assert (ti.pool, ti.pool_slots) == ("default_pool", 1)


def test_the_image_installs_the_policy_as_airflow_local_settings() -> None:
    import runpy

    settings = runpy.run_path(str(REPO / "docker" / "airflow_local_settings.py"))
    assert settings["task_instance_mutation_hook"] is task_instance_mutation_hook
    dockerfile = (REPO / "docker" / "airflow.Dockerfile").read_text()
    assert "docker/airflow_local_settings.py /opt/airflow/config/" in dockerfile
