"""The retraining DAG factory: schedule from the profile (cron OR data Asset), no overlap, no catch-up."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path

import pytest

from verl_pipeline.airflow.assets import preprocessed_data_asset, preprocessed_data_uri
from verl_pipeline.airflow.retrain import RetrainSchedule, build_retrain_dag, retrain_schedule, retrain_schedules
from verl_pipeline.exceptions import ConfigError

REPO = Path(__file__).resolve().parents[2]
ORDER = ["provision_ray_cluster", "preprocess_data", "plan_models", "prefetch_model", "submit_verl_job",
         "wait_for_verl_job", "publish_run", "teardown_ray_cluster"]


@pytest.fixture(scope="module")
def dagbag():  # type: ignore[no-untyped-def]
    from airflow.dag_processing.dagbag import DagBag

    return DagBag(dag_folder=str(REPO / "dags" / "verl_retrain.py"))


def test_one_retraining_dag_per_profile_that_asks(dagbag) -> None:  # type: ignore[no-untyped-def]
    assert dagbag.import_errors == {}
    expected = {s.dag_id for s in retrain_schedules()}
    assert "verl_retrain__smoke" in expected
    assert set(dagbag.dags) == expected


def test_schedule_is_cron_or_data_asset(dagbag) -> None:  # type: ignore[no-untyped-def]
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    dag = dagbag.dags["verl_retrain__smoke"]
    tt = dag.timetable
    assert isinstance(tt, AssetOrTimeSchedule)
    assert isinstance(tt.timetable, CronTriggerTimetable)
    assert tt.timetable.expression == retrain_schedule("smoke").cron  # type: ignore[union-attr]
    uris = {a.uri for a in tt.asset_condition.iter_assets().values()} if hasattr(
        tt.asset_condition, "iter_assets") else {a.uri for a in tt.asset_condition.objects}
    assert uris == {preprocessed_data_uri("smoke")} == {"verl-pipeline://preprocessed-data/smoke"}
    assert dag.max_active_runs == 1 and dag.catchup is False
    assert "retrain" in dag.tags


def test_task_order_publish_before_teardown(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["verl_retrain__smoke"]
    assert [t.task_id for t in dag.topological_sort()] == ORDER
    for up, down in itertools.pairwise(ORDER):
        assert down in dag.get_task(up).downstream_task_ids
    assert dag.get_task("teardown_ray_cluster").is_teardown
    assert str(dag.get_task("publish_run").trigger_rule) in ("all_done", "TriggerRule.ALL_DONE")
    # The consumer must not produce its own trigger.
    assert not any(t.outlets for t in dag.tasks)
    param = dag.params.get_param("profile")
    assert param.value == "smoke" and param.schema["enum"] == ["smoke"]


def test_cron_only_when_data_updates_are_off() -> None:
    from airflow.sdk import CronTriggerTimetable

    dag = build_retrain_dag(RetrainSchedule("smoke", "@weekly", on_data_update=False))
    assert isinstance(dag.timetable, CronTriggerTimetable)


def test_asset_identity_is_stable() -> None:
    a = preprocessed_data_asset("gsm8k-qwen2.5-0.5b-ppo")
    assert a.uri == "verl-pipeline://preprocessed-data/gsm8k-qwen2-5-0-5b-ppo"
    assert a.name == "verl_preprocessed_data__gsm8k_qwen2_5_0_5b_ppo"


@pytest.mark.parametrize(
    ("section", "key"),
    [
        ("retrain: {schedule: '61 3 * * 1'}", "retrain.schedule"),
        ("retrain: {schedule: '@fortnightly'}", "retrain.schedule"),
        ("retrain: {schedule: ''}", "retrain.schedule"),
        ("retrain: {schedule: '0 3 * * 1', on_data_update: 'yes'}", "retrain.on_data_update"),
        ("retrain: {schedule: '0 3 * * 1', every: 2}", "retrain.every"),
        ("retrain: weekly", "retrain"),
    ],
)
def test_bad_retrain_section_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str,
                                             key: str) -> None:
    cfg = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg)
    text = (cfg / "profiles" / "smoke.yaml").read_text().split("retrain:")[0]
    (cfg / "profiles" / "smoke.yaml").write_text(text + section + "\n")
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    with pytest.raises(ConfigError) as e:
        retrain_schedule("smoke")
    assert e.value.key == f"profiles/smoke.{key}"
    assert e.value.fix


@pytest.mark.integration
def test_failed_run_is_not_published_and_latest_stays(airflow_db: Path, tmp_path: Path) -> None:
    """A real ``dag.test()`` of the retraining DAG whose run fails: publish_run fails, latest is kept."""
    import os

    from verl_pipeline import runs

    storage = Path(os.environ["VERL_PIPELINE_HOME"])
    good = storage / "runs" / "previous-good-run"
    (storage / "checkpoints" / "previous-good-run").mkdir(parents=True, exist_ok=True)
    runs.record_run(run_dir=good, run_key="previous-good-run", run_name="verl_retrain__smoke/earlier",
                    profile="smoke", status=runs.RunStatus.SUCCEEDED,
                    checkpoint_dir=storage / "checkpoints" / "previous-good-run")
    runs.promote(storage, "smoke", good)
    before = [m.run_key for m in runs.list_runs(storage)]

    from airflow.dag_processing.dagbag import DagBag

    dag = DagBag(dag_folder=str(REPO / "dags" / "verl_retrain.py")).dags["verl_retrain__smoke"]
    dr = dag.test(run_conf={"data_source": "builtin:nope"})
    states = {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}
    assert str(dr.state) == "failed", states
    # The failed setup takes its whole scope down, publish_run included: nothing is published.
    assert states["provision_ray_cluster"] == "failed", states
    assert states["publish_run"] in ("failed", "upstream_failed"), states
    assert states["teardown_ray_cluster"] == "success", states
    assert runs.latest_run(storage, "smoke") == good.resolve()
    assert (good / runs.MANIFEST).is_file()
    assert [m.run_key for m in runs.list_runs(storage)] == before  # nothing recorded, nothing deleted
