"""Every DAG file imports cleanly, fast, without heavy modules, and is wired as documented."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DAG_FILES = sorted((REPO / "dags").glob("*.py"))


@pytest.fixture(scope="module")
def dagbag():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags"))


def test_no_import_errors(dagbag) -> None:  # type: ignore[no-untyped-def]
    assert dagbag.import_errors == {}
    assert "verl_ppo" in dagbag.dags


@pytest.mark.parametrize("path", DAG_FILES, ids=[p.name for p in DAG_FILES])
def test_dag_file_does_not_import_heavy_modules(path: Path) -> None:
    code = (
        "import sys, runpy; runpy.run_path(sys.argv[1]);"
        "heavy=[m for m in ('ray','torch','verl','transformers','datasets') if m in sys.modules];"
        "print(','.join(heavy)); sys.exit(1 if heavy else 0)"
    )
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True)
    assert r.returncode == 0, f"{path.name} imports {r.stdout.strip()} at parse time: {r.stderr[-500:]}"


def test_verl_ppo_shape(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["verl_ppo"]
    assert {"verl", "ray"} <= set(dag.tags)
    assert dag.doc_md and "preflight" in dag.doc_md
    order = ["provision_ray_cluster", "preprocess_data", "plan_models", "prefetch_model", "submit_verl_job",
             "wait_for_verl_job", "teardown_ray_cluster"]
    # The run report runs after the wait, beside the teardown (tests/dags/test_report_task.py).
    assert [t.task_id for t in dag.topological_sort()
            if t.task_id not in ("report_run", "export_model", "evaluate_model")] == order
    # The trained model's export runs after the wait (it reads files only); its evaluation is a job on the
    # run's cluster, so the teardown waits for it.
    assert dag.get_task("export_model").upstream_task_ids == {"wait_for_verl_job"}
    assert dag.get_task("evaluate_model").upstream_task_ids == {"export_model"}
    assert dag.get_task("teardown_ray_cluster").upstream_task_ids == {"provision_ray_cluster", "wait_for_verl_job",
                                                                      "evaluate_model"}
    assert "evaluate_model" in dag.get_task("report_run").upstream_task_ids
    for up, down in itertools.pairwise(order):
        assert down in dag.get_task(up).downstream_task_ids
    teardown = dag.get_task("teardown_ray_cluster")
    assert teardown.is_teardown and dag.get_task("provision_ray_cluster").is_setup
    for t in dag.tasks:
        if t.task_id != "teardown_ray_cluster":
            assert t.retries >= 2 and t.retry_exponential_backoff
    assert dag.max_active_runs == 4 and not dag.catchup  # several experiments at once (the default)
    params = dag.params
    for key in ("profile", "model_profile", "cluster_profile", "data_source", "model_source", "nnodes",
                "n_gpus_per_node", "total_training_steps", "mode", "verl_overrides"):
        assert key in params
        assert params.get_param(key).description
    assert dag.get_task("wait_for_verl_job").execution_timeout is None
    # The prefetch is mapped over the run's distinct models, as planned by plan_models.
    from airflow.sdk.definitions.mappedoperator import MappedOperator

    prefetch = dag.get_task("prefetch_model")
    assert isinstance(prefetch, MappedOperator)
    assert "plan_models" in prefetch.upstream_task_ids


def test_max_active_runs_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_pipeline.airflow.params import MAX_ACTIVE_RUNS_ENV, max_active_runs
    from verl_pipeline.exceptions import ConfigError

    monkeypatch.setenv(MAX_ACTIVE_RUNS_ENV, "9")
    assert max_active_runs() == 9
    for bad in ("0", "many", "-2"):
        monkeypatch.setenv(MAX_ACTIVE_RUNS_ENV, bad)
        with pytest.raises(ConfigError, match=MAX_ACTIVE_RUNS_ENV):
            max_active_runs()
