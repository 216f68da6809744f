"""Every pipeline DAG writes the run report after the wait, beside the teardown, whatever happened."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dags():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    out = {}
    for name in ("verl_ppo.py", "verl_retrain.py"):
        bag = DagBag(dag_folder=str(REPO / "dags" / name))
        assert bag.import_errors == {}
        out.update(bag.dags)
    return out


def test_report_runs_after_the_wait_for_every_outcome_without_deciding_the_run(dags) -> None:  # type: ignore[no-untyped-def]
    from airflow.sdk import TriggerRule

    assert {"verl_ppo", "verl_retrain__smoke"} <= set(dags)
    for dag in dags.values():
        report = dag.get_task("report_run")
        assert report.upstream_task_ids >= {"wait_for_verl_job"}, dag.dag_id
        assert report.trigger_rule == TriggerRule.ALL_DONE
        # Beside the teardown: the cluster never waits for the report.
        assert "report_run" not in dag.get_task("teardown_ray_cluster").upstream_task_ids
        # Ignored for the DAG run's state (a teardown that does not fail the run): the wait decides.
        assert report.is_teardown and not report.on_failure_fail_dagrun
