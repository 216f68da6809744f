"""The run profile's model registry inside Airflow: its server and login from the MLflow connection, checked
by the provision task before any cluster starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from verl_pipeline.profiles import build_run_spec


def _registry_profile(configs: Path, name: str, mlflow: dict[str, object]) -> str:
    prof = yaml.safe_load((configs / "profiles" / "smoke.yaml").read_text())
    prof["trackers"] = {"mlflow": mlflow}
    (configs / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(prof))
    return name


def test_a_registry_without_its_connection_fails_the_provision_task_before_any_cluster(
        own_configs: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from airflow.sdk.exceptions import AirflowFailException

    from verl_pipeline.airflow.operators import ProvisionRayClusterOperator

    class Dag:
        dag_id = "verl_ppo"

    monkeypatch.delenv("AIRFLOW_CONN_MLFLOW_DEFAULT", raising=False)
    profile = _registry_profile(own_configs, "reg-prov", {"registry": {}})
    ctx = {"params": {"profile": profile}, "run_id": "manual__no_registry_conn", "dag": Dag()}
    with pytest.raises(AirflowFailException) as e:
        ProvisionRayClusterOperator(task_id="provision_ray_cluster", validate_with_verl=False).execute(ctx)
    msg = str(e.value)
    assert msg.startswith("ConfigError: trackers.mlflow.conn_id='mlflow_default': no such Airflow connection, and "
                          "the run profile registers its model as 'reg-prov' on MLflow (trackers.mlflow.registry)")
    assert "\n" not in msg
    spec = build_run_spec(ctx["params"], run_name="verl_ppo/manual__no_registry_conn")
    assert not (spec.run_dir / "cluster.json").exists()  # nothing was provisioned


def test_the_registry_registers_on_the_server_of_the_mlflow_connection(
        mlflow_server: str, own_configs: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_pipeline.airflow.tracker_connections import run_registry_env
    from verl_pipeline.registry import register

    assert run_registry_env(build_run_spec({}, run_name="verl_ppo/manual__none")) is None  # no registry named
    port = int(mlflow_server.rsplit(":", 1)[1])
    monkeypatch.setenv("AIRFLOW_CONN_TEAM_MLFLOW", json.dumps({
        "conn_type": "http", "host": "127.0.0.1", "port": port, "login": "alice", "password": "vpcanary-pw"}))
    profile = _registry_profile(own_configs, "reg-conn", {"conn_id": "team_mlflow",
                                                          "registry": {"model_name": "reg-conn-model"}})
    spec = build_run_spec({"profile": profile}, run_name="verl_ppo/manual__registry_conn")
    env = run_registry_env(spec)
    assert env is not None and env.values == {"MLFLOW_TRACKING_URI": mlflow_server, "MLFLOW_TRACKING_USERNAME": "alice",
                                              "MLFLOW_TRACKING_PASSWORD": "vpcanary-pw"}
    assert env.shown()["MLFLOW_TRACKING_PASSWORD"] == "***"

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    assert spec.trackers.registry is not None
    mv = register(env.values["MLFLOW_TRACKING_URI"], name=spec.trackers.registry.model_name, model_dir=model,
                  run_key=spec.run_key, experiment="vp-registry-test",
                  username=env.values["MLFLOW_TRACKING_USERNAME"], password=env.values["MLFLOW_TRACKING_PASSWORD"])
    assert (mv.name, mv.version, mv.tags["run_key"]) == ("reg-conn-model", 1, spec.run_key)
