"""The whole DAG with ``dag.test()`` against a real local Ray cluster (embedded default, preflight)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.conftest import ray_processes
from verl_pipeline.cluster.local import LocalBackend
from verl_pipeline.data.preprocess import ROW_SCHEMA
from verl_pipeline.profiles import build_run_spec

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _dag() -> Any:
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "verl_ppo.py"))
    assert bag.import_errors == {}
    return bag.dags["verl_ppo"]


def _xcom(dag_run: Any, task_id: str) -> Any:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.scalars(
            XComModel.get_many(run_id=dag_run.run_id, dag_ids=dag_run.dag_id, task_ids=task_id, key="return_value")
        ).first()
        return None if row is None else XComModel.deserialize_value(row)


def _states(dag_run: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dag_run.get_task_instances()}


def test_dag_runs_end_to_end_in_preflight(airflow_db: Path, tiny_model_path: Path,
                                          capfd: pytest.CaptureFixture[str]) -> None:
    from omegaconf import OmegaConf
    from verl.utils import hf_tokenizer
    from verl.utils.dataset.rl_dataset import RLHFDataset

    dag = _dag()
    dr = dag.test(run_conf={"total_training_steps": 3})
    states = _states(dr)
    assert str(dr.state) == "success", states
    # A preflight run trains nothing: there is no model to export (the task says so and is skipped).
    assert states.pop("export_model") == "skipped"
    assert states.pop("evaluate_model") == "skipped"  # nor one to evaluate
    assert set(states.values()) == {"success"}
    # A run that went well says nothing alarming: no error for an extra link's XCom never stored, no failed
    # log read of a job Ray had not placed yet (the state API's 500). Only these two: a busy machine may
    # time out a read now and then, which the waiter rightly warns of and retries.
    printed = capfd.readouterr()
    alarms = ("XCom not found", "/api/v0/logs/file")
    assert [ln for ln in (printed.out + printed.err).splitlines() if any(a in ln for a in alarms)] == []

    cluster = _xcom(dr, "provision_ray_cluster")
    data = _xcom(dr, "preprocess_data")
    models = _xcom(dr, "prefetch_model")
    sub = _xcom(dr, "submit_verl_job")
    waited = _xcom(dr, "wait_for_verl_job")
    teardown = _xcom(dr, "teardown_ray_cluster")

    # Data: verl's exact row schema, readable by verl's RLHFDataset with the model's tokenizer.
    for key in ("train_path", "val_path"):
        assert pq.read_schema(data[key]).equals(ROW_SCHEMA)
    ds = RLHFDataset(data_files=[data["train_path"]], tokenizer=hf_tokenizer(models["actor"]["path"]),
                     config=OmegaConf.create({"max_prompt_length": 256, "cache_dir": str(airflow_db / "rlhf")}))
    assert len(ds) == data["counts"]["train_rows"] > 0

    # The job: submitted in preflight (the cluster has no GPUs), SUCCEEDED, all ground truths scored 1.0.
    assert sub["mode"] == "preflight" and sub["action"] == "submitted"
    # The environment probe ran first (XCom and the run dir): it reports what a GPU run would miss.
    env = sub["environment"]
    assert env["mode"] == "preflight" and not env["enforced"] and [n["answered"] for n in env["nodes"]] == [True]
    assert any("No module named 'vllm'" in p for p in env["problems"])
    assert json.loads((Path(sub["run_dir"]) / "environment.json").read_text())["problems"] == env["problems"]
    assert waited["status"] == "SUCCEEDED" and waited["job_id"] == sub["submission_id"]
    pre = waited["preflight"]
    assert pre["ok"] is True and pre["all_ground_truths_score_1"] is True
    assert pre["checks"] == {"verl_config": True, "data": True, "reward": True, "generation": True}
    assert pre["scored"] == {"train": data["counts"]["train_rows"], "val": data["counts"]["val_rows"]}
    summary = json.loads((Path(sub["run_dir"]) / "preflight.json").read_text())
    assert summary["checks"]["verl_config"]["n_gpus"] == 1
    job = json.loads((Path(sub["run_dir"]) / "job.json").read_text())
    assert "trainer.total_training_steps=3" in job["overrides"]
    # The run report (task report_run): no steps, the checks preflight ran, found through its XCom.
    report = _xcom(dr, "report_run")
    assert report["report_dir"] == str(Path(sub["run_dir"]) / "report") and report["steps_done"] == 0
    html = Path(report["html"]).read_text()
    assert "No training steps: this was a preflight run" in html and "Preflight checks" in html
    checks = json.loads((Path(report["report_dir"]) / "report.json").read_text())["checks"]
    assert {c["name"]: c["ok"] for c in checks} == pre["checks"]

    # Teardown: every process the local backend started is gone.
    assert teardown["stopped_processes"] > 0
    assert ray_processes(cluster["extra"]["temp_dir"]) == []

    # The preprocessed data is an Asset event of the run's profile (what retraining DAGs wait for).
    from airflow.models.asset import AssetEvent, AssetModel
    from airflow.utils.session import create_session
    from sqlalchemy import select

    from verl_pipeline.airflow.assets import preprocessed_data_uri

    with create_session() as session:
        events = session.scalars(
            select(AssetEvent).join(AssetModel, AssetEvent.asset_id == AssetModel.id)
            .where(AssetModel.uri == preprocessed_data_uri("smoke"), AssetEvent.source_run_id == dr.run_id)
        ).all()
        assert len(events) == 1 and events[0].extra["train_path"] == data["train_path"]


def test_the_example_task_passes_its_preflight_through_the_dag(airflow_db: Path, tiny_model_path: Path) -> None:
    """The shipped example task: its reward file ships with the job (the probe runs with the job's
    runtime_env before the job does) and scores every ground truth of both splits 1.0."""
    dr = _dag().test(run_conf={"profile": "repeat-digit", "cluster_profile": "local-cpu", "mode": "preflight"})
    assert str(dr.state) == "success", _states(dr)
    sub = _xcom(dr, "submit_verl_job")
    run_dir = Path(sub["run_dir"])
    job = json.loads((run_dir / "job.json").read_text())
    assert "reward.custom_reward_function.path=reward.py" in job["overrides"]
    assert job["runtime_env"]["working_dir"] == str(run_dir / "job_files")
    assert (run_dir / "job_files" / "reward.py").is_file()
    reward = json.loads((run_dir / "preflight.json").read_text())["checks"]["reward"]
    assert reward["all_ground_truths_score_1"] and reward["val"]["scored"] == 10
    assert reward["train"]["answer_form"] == "{ground_truth}" and reward["train"]["not_one"] == 0


def test_invalid_params_fail_before_any_cluster_starts(airflow_db: Path) -> None:
    dag = _dag()
    dr = dag.test(run_conf={"data_source": "/does/not/exist.jsonl"})
    states = _states(dr)
    assert str(dr.state) == "failed"
    assert states["provision_ray_cluster"] == "failed"
    assert states["teardown_ray_cluster"] == "success"
    for task in ("preprocess_data", "prefetch_model", "submit_verl_job", "wait_for_verl_job"):
        assert states[task] == "upstream_failed"
    # Nothing ran, so there is no run to report; the skipped report does not make the run a success.
    assert states["report_run"] == "skipped"
    spec = build_run_spec({}, run_name=f"verl_ppo/{dr.run_id}")
    temp_dir = LocalBackend.from_spec(spec.cluster).temp_dir_for(spec.cluster_name)
    assert not temp_dir.exists()
    assert ray_processes(str(temp_dir)) == []
