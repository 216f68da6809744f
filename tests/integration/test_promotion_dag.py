"""The retraining DAG end to end on CPU with a model that was trained: the stand-in trainer saves real FSDP
checkpoints (``+fake.real_fsdp``), the export merges them, ``evaluate_model`` scores the trained, base and
champion models in a Ray job (transformers: a smoke evaluation) and ``publish_run`` decides with the rule.

A published run of the tiny model is the champion; the DAG's run is judged against it (and the base) on the
held-out rows its profile names (``evaluation.data``), and ``latest`` moves exactly when the rule says so."""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.evaluation.runs import published_run, verl_rows
from tests.faults.conftest import FAKE_TRAINER, write_fault_configs
from verl_pipeline import runs
from verl_pipeline.promotion import PromotionRule, decide
from verl_pipeline.rundir import RunDir
from verl_pipeline.scores import Evaluation, Role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1200)]

PROFILE = "promote-example"


@pytest.fixture
def promote_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: Path) -> Path:
    cfg = write_fault_configs(tmp_path)
    prof = yaml.safe_load((cfg / "profiles" / "repeat-digit.yaml").read_text())
    prof.update(cluster_profile="local-1node", trainer_command=[sys.executable, str(FAKE_TRAINER)],
                retrain={"schedule": "0 3 * * 1", "on_data_update": False},
                evaluation={"sample": 3, "max_new_tokens": 4,
                            "data": str(verl_rows(tmp_path / "held-out.parquet", n=4))})
    prof["data"].update(train_size=40, val_size=10)
    prof["trainer"]["total_training_steps"] = 2
    prof["verl"]["trainer"].update(save_freq=2, test_freq=-1, val_before_train=False)
    prof["verl"]["+fake"] = {"step_seconds": 0.2, "real_fsdp": True}
    (cfg / "profiles" / f"{PROFILE}.yaml").write_text(yaml.safe_dump(prof))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def _dag() -> Any:
    from verl_pipeline.airflow.retrain import build_retrain_dag, retrain_schedule

    sched = retrain_schedule(PROFILE)
    assert sched is not None
    dag = build_retrain_dag(sched)
    for task in dag.tasks:
        task.retry_delay = timedelta(seconds=1)
        task.retry_exponential_backoff = False
    dag.get_task("wait_for_verl_job").poll_interval = 0.5
    return dag


def _states(dr: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}


def _published(dr: Any) -> dict[str, Any]:
    from airflow.models.xcom import XComModel
    from airflow.utils.session import create_session

    with create_session() as session:
        row = session.execute(XComModel.get_many(key="return_value", run_id=dr.run_id, dag_ids=dr.dag_id,
                                                 task_ids="publish_run").with_only_columns(XComModel.value)).first()
    assert row is not None, _states(dr)
    value = row[0]
    return value if isinstance(value, dict) else __import__("json").loads(value)


def test_a_trained_run_is_evaluated_and_promoted_only_as_the_rule_says(promote_env: Path,
                                                                    tiny_model_path: Path) -> None:
    champion_run = published_run(promote_env, tiny_model_path, run_key="champion", data_hash=None, profile=PROFILE)
    dr = _dag().test(run_conf={})
    states = _states(dr)
    assert str(dr.state) == "success", states
    assert states["export_model"] == "success" and states["evaluate_model"] == "success", states
    pub = _published(dr)
    run = Path(pub["run_dir"])
    ev = Evaluation.from_dict(RunDir(run).evaluation() or {})
    assert ev.smoke and set(ev.models) == {Role.TRAINED, Role.BASE, Role.CHAMPION}, ev.errors
    assert ev.data_path == str(promote_env.parent / "held-out.parquet")  # the held-out rows, not data.val_files
    assert all(s.n == 3 for s in ev.models.values())
    champion = ev.score(Role.CHAMPION)
    assert champion is not None and champion.run_dir == str(champion_run.resolve())
    expected = decide(PromotionRule(), ev, champion_run=str(champion_run.resolve()))
    assert (pub["promoted"], pub["verdict"]["kind"]) == (expected.promoted, expected.kind.value)
    assert runs.latest_run(promote_env, PROFILE) == (run if expected.promoted else champion_run).resolve()
    assert RunDir(run).promotion() == pub["verdict"]
    assert runs.read_manifest(run).promotion == pub["verdict"]
    report = (RunDir(run).report_dir / "report.html").read_text()
    assert "<h2>Evaluation</h2>" in report and expected.line() in report.replace("&#x27;", "'")
