"""The retraining DAG factory: schedule from the profile (cron OR data Asset), no overlap, no catch-up."""

from __future__ import annotations

import itertools
import shutil
from datetime import timedelta
from pathlib import Path

import pytest

from verl_pipeline.airflow.assets import preprocessed_data_asset, preprocessed_data_uri
from verl_pipeline.airflow.retrain import (
    RetrainSchedule,
    build_retrain_dag,
    first_run_rule,
    retrain_schedule,
    retrain_schedules,
)
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import RunDir

REPO = Path(__file__).resolve().parents[2]
ORDER = ["provision_ray_cluster", "preprocess_data", "plan_models", "prefetch_model", "submit_verl_job",
         "wait_for_verl_job", "teardown_ray_cluster"]


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


def test_task_order_publish_beside_teardown(dagbag) -> None:  # type: ignore[no-untyped-def]
    dag = dagbag.dags["verl_retrain__smoke"]
    for up, down in itertools.pairwise(ORDER):
        assert down in dag.get_task(up).downstream_task_ids
    # Publishing reads the run's files: it never holds the cluster up, and teardown never waits for it.
    # publish_run decides only after the trained model was exported and evaluated:
    # wait -> export_model -> evaluate_model -> publish_run -> report_run.
    assert "export_model" in dag.get_task("wait_for_verl_job").downstream_task_ids
    assert "evaluate_model" in dag.get_task("export_model").downstream_task_ids
    assert "publish_run" in dag.get_task("evaluate_model").downstream_task_ids
    assert "report_run" in dag.get_task("publish_run").downstream_task_ids
    assert "publish_run" not in dag.get_task("teardown_ray_cluster").upstream_task_ids
    assert "export_model" not in dag.get_task("teardown_ray_cluster").upstream_task_ids
    assert dag.get_task("teardown_ray_cluster").is_teardown
    assert str(dag.get_task("publish_run").trigger_rule) in ("all_done", "TriggerRule.ALL_DONE")
    # The consumer must not produce its own trigger: the only outlet is the trained model's alias, on the
    # publish task (which adds an event for a promoted run only).
    from verl_pipeline.airflow.assets import TRAINED_MODEL_ALIAS

    assert [(t.task_id, [o.name for o in t.outlets]) for t in dag.tasks if t.outlets] == [
        ("publish_run", [TRAINED_MODEL_ALIAS])]
    param = dag.params.get_param("profile")
    assert param.value == "smoke" and param.schema["enum"] == ["smoke"]
    assert dag.params.get_param("promote_anyway").value is False


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
    _smoke_with_retrain(tmp_path, monkeypatch, section)
    with pytest.raises(ConfigError) as e:
        retrain_schedule("smoke")
    assert e.value.key == f"profiles/smoke.{key}"
    assert e.value.fix


@pytest.mark.integration
def _recorded(storage: Path) -> list[str]:
    """The run directories with a manifest (a recorded run)."""
    return sorted(d.name for d in (storage / "runs").iterdir() if RunDir(d).manifest_file.is_file())


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
    before = _recorded(storage)

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
    assert RunDir(good).manifest_file.is_file()
    assert _recorded(storage) == before  # nothing recorded, nothing deleted


# -- when a newly unpaused retraining DAG first runs -------------------------------------------------
# The clock is an argument here: the scheduler's own timetable code (the serialized DAG's timetable, as
# the scheduler decodes it) is asked for the first run at fixed instants of the week, so these cases
# hold whatever day CI runs on.
MONDAY_TICK = "2026-11-30T03:00:00+00:00"  # `0 3 * * 1` ticks on Mondays 03:00 UTC
NEXT_TICK = "2026-12-07T03:00:00+00:00"


def _first_run(monkeypatch: pytest.MonkeyPatch, sched: RetrainSchedule, now: str) -> str:
    import pendulum
    from airflow.serialization.decoders import decode_timetable
    from airflow.serialization.encoders import encode_timetable
    from airflow.timetables import trigger
    from airflow.timetables.base import TimeRestriction

    dag = build_retrain_dag(sched)
    timetable = decode_timetable(encode_timetable(dag.timetable))
    monkeypatch.setattr(trigger, "utcnow", lambda: pendulum.parse(now))
    info = timetable.next_dagrun_info(last_automated_data_interval=None,
                                      restriction=TimeRestriction(earliest=None, latest=None, catchup=False))
    assert info is not None
    return str(info.run_after.isoformat())


@pytest.mark.parametrize(
    ("run_immediately", "now", "first"),
    [
        # Airflow's default: the past tick only within max(10% of a week = 16.8 h, 5 min) of it.
        (False, "2026-11-30T03:00:00+00:00", MONDAY_TICK),
        (False, "2026-11-30T19:47:00+00:00", MONDAY_TICK),
        (False, "2026-11-30T19:49:00+00:00", NEXT_TICK),
        (False, "2026-12-01T09:30:00+00:00", NEXT_TICK),   # a Tuesday morning: waits six days
        (False, "2026-12-06T23:59:00+00:00", NEXT_TICK),   # Sunday night
        (True, "2026-11-30T03:00:01+00:00", MONDAY_TICK),
        (True, "2026-12-01T09:30:00+00:00", MONDAY_TICK),
        (True, "2026-12-06T23:59:00+00:00", MONDAY_TICK),
        (timedelta(hours=6), "2026-11-30T08:59:00+00:00", MONDAY_TICK),
        (timedelta(hours=6), "2026-11-30T09:01:00+00:00", NEXT_TICK),
        (timedelta(days=3), "2026-12-02T12:00:00+00:00", MONDAY_TICK),
        (timedelta(days=3), "2026-12-03T03:01:00+00:00", NEXT_TICK),
    ],
)
def test_first_run_after_unpause_follows_run_immediately(
    monkeypatch: pytest.MonkeyPatch, run_immediately: bool | timedelta, now: str, first: str
) -> None:
    sched = RetrainSchedule("smoke", "0 3 * * 1", run_immediately=run_immediately)
    assert _first_run(monkeypatch, sched, now) == first


def test_shipped_profiles_say_when_they_first_run() -> None:
    assert retrain_schedule("smoke").run_immediately is True  # type: ignore[union-attr]
    assert retrain_schedule("gsm8k-qwen2.5-0.5b-ppo").run_immediately is False  # type: ignore[union-attr]
    for sched, words in ((RetrainSchedule("p", "@weekly"), "max(10% of the gap"),
                         (RetrainSchedule("p", "@weekly", run_immediately=True), "runs at once"),
                         (RetrainSchedule("p", "@weekly", run_immediately=timedelta(hours=36)), "1d12h")):
        assert words in first_run_rule(sched)
        assert first_run_rule(sched) in build_retrain_dag(sched).doc_md


@pytest.mark.parametrize(("text", "value"), [("6h", timedelta(hours=6)), ("90m", timedelta(minutes=90)),
                                             ("1d12h", timedelta(hours=36)), (" 45S ", timedelta(seconds=45))])
def test_run_immediately_durations(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
                                   value: timedelta) -> None:
    _smoke_with_retrain(tmp_path, monkeypatch, f"retrain: {{schedule: '@weekly', run_immediately: '{text}'}}")
    assert retrain_schedule("smoke").run_immediately == value  # type: ignore[union-attr]


@pytest.mark.parametrize("value", ["'soon'", "'6 h'", "'0h'", "3600", "''", "[1h]"])
def test_bad_run_immediately_names_the_field(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    _smoke_with_retrain(tmp_path, monkeypatch, f"retrain: {{schedule: '@weekly', run_immediately: {value}}}")
    with pytest.raises(ConfigError) as e:
        retrain_schedule("smoke")
    assert e.value.key == "profiles/smoke.retrain.run_immediately"
    assert e.value.fix and "duration" in e.value.fix


def _smoke_with_retrain(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, section: str) -> None:
    cfg = tmp_path / "configs"
    shutil.copytree(REPO / "configs", cfg)
    text = (cfg / "profiles" / "smoke.yaml").read_text().split("retrain:")[0]
    (cfg / "profiles" / "smoke.yaml").write_text(text + section + "\n")
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
