"""The user's trackers: ``trainer.logger`` kept (plus what the pipeline reads), credentials from connections."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.trackers import (
    Tracker,
    TrackerEnv,
    TrackerSettings,
    connection_env,
    exposure_problem,
    logger_backends,
    supported_backends,
    tracker_env,
)
from verl_pipeline.trainer.render import render_job


def _conn(**fields: Any) -> SimpleNamespace:
    base = {"conn_type": "http", "host": None, "port": None, "schema": None, "login": None, "password": None}
    return SimpleNamespace(**{**base, **fields})


def test_the_backends_are_those_of_the_installed_verl() -> None:
    # verl 0.9.1's Tracking.supported_backend, read from its module without importing torch.
    assert {"console", "file", "wandb", "mlflow", "tensorboard", "swanlab", "clearml"} <= set(supported_backends())
    assert "neptune" not in supported_backends()


@pytest.mark.parametrize(("value", "expected"), [
    (None, ["console", "file"]),
    (["console", "wandb"], ["console", "wandb", "file"]),
    ("mlflow", ["mlflow", "console", "file"]),
    (["file", "tensorboard", "console"], ["file", "tensorboard", "console"]),
])
def test_the_users_list_is_kept_and_the_pipelines_backends_added(value: Any, expected: list[str]) -> None:
    assert logger_backends(value) == expected


def test_an_unknown_tracker_is_one_line_naming_key_value_and_fix() -> None:
    with pytest.raises(ConfigError) as e:
        logger_backends(["console", "neptune"])
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("trainer.logger=['console', 'neptune']: ")
    assert "'neptune'" in msg and "fix: use only wandb, mlflow" in msg


def test_render_keeps_the_users_trackers_from_set_and_from_the_form() -> None:
    for params, overrides in (({}, {"trainer.logger": ["console", "wandb"]}),
                              ({"verl_overrides": ["trainer.logger=[console,wandb]"]}, None)):
        spec = build_run_spec(params, run_name="verl_ppo/manual__trackers", overrides=overrides)
        job = render_job(spec, mode=Mode.TRAIN, train_files="/d/t.parquet", val_files="/d/v.parquet",
                         model_path="/m/a")
        assert job.settings["trainer.logger"] == ["console", "wandb", "file"]
        assert "trainer.logger=[console,wandb,file]" in job.overrides
        assert "['console', 'wandb', 'file']" in job.derived["trainer.logger"]


def test_an_unknown_tracker_fails_the_spec_before_any_cluster() -> None:
    with pytest.raises(ConfigError, match=r"^trainer.logger=\['neptune'\]: verl's Tracking does not support"):
        build_run_spec({"verl_overrides": ["trainer.logger=[neptune]"]}, run_name="verl_ppo/manual__bad")


def test_profile_names_the_connections(tmp_path: Path) -> None:
    assert TrackerSettings.from_profile(None, "p").conn_id(Tracker.MLFLOW) == "mlflow_default"
    s = TrackerSettings.from_profile({"mlflow": {"conn_id": "team_mlflow"}}, "p")
    assert s.conn_id(Tracker.MLFLOW) == "team_mlflow" and s.conn_id(Tracker.WANDB) == "wandb_default"
    for bad, key in (({"neptune": {"conn_id": "x"}}, "profiles/p.trackers.neptune"),
                     ({"mlflow": {"conn_id": ""}}, "profiles/p.trackers.mlflow.conn_id"),
                     ({"mlflow": "team_mlflow"}, "profiles/p.trackers.mlflow")):
        with pytest.raises(ConfigError) as e:
            TrackerSettings.from_profile(bad, "p")
        assert e.value.key == key


def test_wandb_connection_gives_the_api_key_and_base_url() -> None:
    env = connection_env(Tracker.WANDB, _conn(password="k3y", host="wandb.example.com"), "wandb_default")
    assert env.values == {"WANDB_API_KEY": "k3y", "WANDB_BASE_URL": "https://wandb.example.com"}
    assert env.shown() == {"WANDB_API_KEY": "***", "WANDB_BASE_URL": "https://wandb.example.com"}
    assert "k3y" not in repr(env)
    assert connection_env(Tracker.WANDB, _conn(password="k3y"), "w").values == {"WANDB_API_KEY": "k3y"}
    with pytest.raises(ConfigError, match=r"^connections.w.password=None: W&B needs its API key"):
        connection_env(Tracker.WANDB, _conn(host="x"), "w")


def test_mlflow_connection_gives_uri_and_login() -> None:
    env = connection_env(Tracker.MLFLOW, _conn(host="127.0.0.1", port=5000, login="u", password="p"), "m")
    assert env.values == {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000", "MLFLOW_TRACKING_USERNAME": "u",
                          "MLFLOW_TRACKING_PASSWORD": "p"}
    assert env.secret == {"MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"}
    https = connection_env(Tracker.MLFLOW, _conn(host="mlflow.example.com", schema="https"), "m")
    assert https.values == {"MLFLOW_TRACKING_URI": "https://mlflow.example.com"}
    url_host = connection_env(Tracker.MLFLOW, _conn(host="https://ml.example.com/prefix/", port=8443), "m")
    assert url_host.values["MLFLOW_TRACKING_URI"] == "https://ml.example.com:8443/prefix"
    with pytest.raises(ConfigError, match=r"^connections.m.host='\*\*\*': credentials in the address"):
        connection_env(Tracker.MLFLOW, _conn(host="https://u:secret@ml.example.com"), "m")
    with pytest.raises(ConfigError, match=r"^connections.m.host=None: MLflow needs"):
        connection_env(Tracker.MLFLOW, _conn(), "m")


def test_only_chosen_trackers_are_looked_up_and_a_missing_one_is_one_line() -> None:
    asked: list[str] = []

    def lookup(conn_id: str) -> Any:
        asked.append(conn_id)
        return _conn(host="127.0.0.1", port=5000) if conn_id == "team_mlflow" else None

    settings = TrackerSettings({"mlflow": "team_mlflow"})
    assert tracker_env(["console", "file"], settings, lookup) == TrackerEnv()
    assert asked == []
    env = tracker_env(["console", "mlflow", "file"], settings, lookup)
    assert env.values == {"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"} and asked == ["team_mlflow"]
    with pytest.raises(ConfigError) as e:
        tracker_env(["wandb", "console", "file"], settings, lookup)
    msg = str(e.value)
    assert msg.startswith("trackers.wandb.conn_id='wandb_default': no such Airflow connection") and "\n" not in msg
    assert "fix: create the connection 'wandb_default'" in msg


def test_credentials_are_refused_for_an_auth_disabled_jobs_api() -> None:
    secret = TrackerEnv({"WANDB_API_KEY": "k"}, frozenset({"WANDB_API_KEY"}))
    assert exposure_problem(secret, "token", dashboard_url="http://10.0.0.5:8265") is None
    assert exposure_problem(TrackerEnv({"MLFLOW_TRACKING_URI": "http://m"}), "disabled", dashboard_url="x") is None
    problem = exposure_problem(secret, "disabled", dashboard_url="http://10.0.0.5:8265")
    assert problem is not None and problem.key == "cluster.auth_mode"
    assert "WANDB_API_KEY" in str(problem) and "k'" not in str(problem)


def test_spec_records_the_connection_ids_not_their_values() -> None:
    spec = build_run_spec({}, run_name="verl_ppo/manual__ids")
    assert json.dumps(spec.to_dict())  # JSON-able: it is written to run_spec.json
    assert spec.to_dict()["trackers"] == {}


def test_credentials_travel_by_a_private_file_that_the_setup_hook_loads(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os
    import stat

    from verl_pipeline.trackers import ENV_FILE_VAR, SETUP_HOOK, load_env_file, with_secret_env

    base = {"env_vars": {"VERL_FILE_LOGGER_PATH": "/r/metrics-a1.jsonl"}, "py_modules": ["/pkg"]}
    values = {"MLFLOW_TRACKING_URI": "http://m:5000", "MLFLOW_TRACKING_PASSWORD": "vpcanary-pw"}
    env = with_secret_env(base, values, directory=tmp_path / "run" / "secrets", name="job-a1.json")
    path = Path(env["env_vars"][ENV_FILE_VAR])
    assert "vpcanary-pw" not in json.dumps(env) and base["env_vars"] == {"VERL_FILE_LOGGER_PATH": "/r/metrics-a1.jsonl"}
    assert env["worker_process_setup_hook"] == SETUP_HOOK and env["py_modules"] == ["/pkg"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    # Ray imports the hook by its dotted name in each worker: it must be this function.
    module, _, func = SETUP_HOOK.rpartition(".")
    assert getattr(__import__(module, fromlist=[func]), func) is load_env_file
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    monkeypatch.setenv(ENV_FILE_VAR, str(path))
    load_env_file()
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "vpcanary-pw"
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD")


def test_a_tracker_without_its_connection_fails_the_provision_task_before_any_cluster(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from verl_pipeline.airflow.operators import ProvisionRayClusterOperator

    class Dag:
        dag_id = "verl_ppo"

    monkeypatch.delenv("AIRFLOW_CONN_WANDB_DEFAULT", raising=False)
    ctx = {"params": {"verl_overrides": ["trainer.logger=[console,wandb]"]}, "run_id": "manual__no_conn",
           "dag": Dag()}
    with pytest.raises(AirflowFailException) as e:
        ProvisionRayClusterOperator(task_id="provision_ray_cluster", validate_with_verl=False).execute(ctx)
    msg = str(e.value)
    assert msg.startswith("ConfigError: trackers.wandb.conn_id='wandb_default': no such Airflow connection")
    assert "\n" not in msg
    spec = build_run_spec(ctx["params"], run_name="verl_ppo/manual__no_conn")
    assert not (spec.run_dir / "cluster.json").exists()  # nothing was provisioned
