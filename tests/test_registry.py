"""The model registry: the profile's setting, and each run's model as a version of one registered model on
a real ``mlflow server`` (SQLite store, local artifact root), with the aliases ``challenger`` and ``champion``."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError, ModelError, PipelineError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.registry import (
    CHALLENGER,
    CHAMPION,
    PREVIOUS_CHAMPION_TAG,
    RegistrySettings,
    champion_version,
    promote,
    register,
)
from verl_pipeline.scores import Engine, Evaluation, ModelScore, Role
from verl_pipeline.spec import RunSpec
from verl_pipeline.trackers import Tracker, TrackerSettings

EXPERIMENT = "vp-registry-test"


def _profile(configs: Path, name: str, trackers: dict[str, Any]) -> str:
    prof = yaml.safe_load((configs / "profiles" / "smoke.yaml").read_text())
    prof["trackers"] = trackers
    (configs / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(prof))
    return name


def test_the_profile_names_the_registered_model_and_the_frozen_spec_keeps_it(own_configs: Path) -> None:
    _profile(own_configs, "reg-default", {"mlflow": {"registry": {}}})
    spec = build_run_spec({"profile": "reg-default"}, run_name="verl_ppo/manual__reg")
    assert spec.trackers.registry == RegistrySettings("reg-default")  # the profile's name by default
    assert spec.trackers.conn_id(Tracker.MLFLOW) == "mlflow_default"
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec

    _profile(own_configs, "reg-named", {"mlflow": {"conn_id": "team_mlflow", "registry": {"model_name": "gsm8k-qwen"}}})
    spec = build_run_spec({"profile": "reg-named"}, run_name="verl_ppo/manual__reg")
    assert spec.trackers == TrackerSettings({"mlflow": "team_mlflow"}, RegistrySettings("gsm8k-qwen"))
    assert spec.to_dict()["trackers"] == {"mlflow": {"conn_id": "team_mlflow",
                                                     "registry": {"model_name": "gsm8k-qwen"}}}
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec
    assert build_run_spec({}, run_name="verl_ppo/manual__reg").trackers.registry is None  # no setting, no registry


@pytest.mark.parametrize(("section", "key"), [
    ({"mlflow": {"registry": "gsm8k-qwen"}}, "profiles/p.trackers.mlflow.registry"),
    ({"mlflow": {"registry": {"name": "gsm8k-qwen"}}}, "profiles/p.trackers.mlflow.registry.name"),
    ({"mlflow": {"registry": {"model_name": "team/gsm8k"}}}, "profiles/p.trackers.mlflow.registry.model_name"),
    ({"mlflow": {"registry": {"model_name": ""}}}, "profiles/p.trackers.mlflow.registry.model_name"),
    ({"mlflow": {"registry": {"model_name": 7}}}, "profiles/p.trackers.mlflow.registry.model_name"),
    ({"wandb": {"registry": {}}}, "profiles/p.trackers.wandb"),
    ({"mlflow": {}}, "profiles/p.trackers.mlflow"),
])
def test_a_bad_registry_setting_is_one_line_naming_key_value_and_fix(section: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        TrackerSettings.from_profile(section, "p")
    assert e.value.key == key and e.value.fix
    assert str(e.value).startswith(f"{key}=") and "\n" not in str(e.value)


def test_a_bad_registry_setting_fails_the_profile_load(own_configs: Path) -> None:
    _profile(own_configs, "reg-bad", {"mlflow": {"registry": {"model_name": "a:b"}}})
    with pytest.raises(ConfigError, match=r"^profiles/reg-bad\.trackers\.mlflow\.registry\.model_name='a:b': "):
        build_run_spec({"profile": "reg-bad"}, run_name="verl_ppo/manual__reg")


def _model_dir(root: Path, seed: int) -> Path:
    """A stand-in export: a config.json and a small safetensors file (the registry does not read them)."""
    import numpy as np
    from safetensors.numpy import save_file

    d = root / f"run-{seed}" / "model"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "hidden_size": 8}))
    save_file({"lm_head.weight": np.full((4, 8), seed, dtype=np.float32)}, str(d / "model.safetensors"))
    return d


def _score(reward: float, pass_rate: float) -> ModelScore:
    return ModelScore(path="/m", mean_reward=reward, pass_rate=pass_rate, mean_response_length=12.0, n=32)


def _evaluation() -> Evaluation:
    return Evaluation(data_path="/d/val.parquet", data_hash="evalhash1", split="val", engine=Engine.TRANSFORMERS,
                      sampling={"temperature": 0.0}, models={Role.TRAINED: _score(0.75, 0.5),
                                                             Role.BASE: _score(0.25, 0.125),
                                                             Role.CHAMPION: _score(0.5, 0.375)})


def test_two_runs_give_versions_1_and_2_and_challenger_moves_to_the_newest(mlflow_server: str, tmp_path: Path) -> None:
    first = register(mlflow_server, name="reg-two", model_dir=_model_dir(tmp_path, 1), run_key="run-a",
                     experiment=EXPERIMENT)
    assert (first.name, first.version, first.aliases) == ("reg-two", 1, (CHALLENGER,))
    second = register(mlflow_server, name="reg-two", model_dir=_model_dir(tmp_path, 2), run_key="run-b",
                      experiment=EXPERIMENT)
    assert (second.version, second.aliases) == (2, (CHALLENGER,))
    assert second.run_id != first.run_id

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    assert client.get_model_version("reg-two", "1").aliases == []
    assert client.get_registered_model("reg-two").aliases == {CHALLENGER: "2"}
    # Each version's source holds its own run's files, byte for byte.
    for version, seed in ((first, 1), (second, 2)):
        got = Path(client.download_artifacts(version.run_id, "model", str(tmp_path / f"got-{seed}")))
        want = _model_dir(tmp_path / "again", seed)
        assert sorted(p.name for p in got.iterdir()) == ["config.json", "model.safetensors"]
        assert all((got / n).read_bytes() == (want / n).read_bytes() for n in ("config.json", "model.safetensors"))
        assert version.source == f"{client.get_run(version.run_id).info.artifact_uri}/model"


def test_registering_a_run_again_returns_its_version_and_never_moves_challenger_back(
        mlflow_server: str, tmp_path: Path) -> None:
    model = _model_dir(tmp_path, 1)
    first = register(mlflow_server, name="reg-again", model_dir=model, run_key="run-a", experiment=EXPERIMENT)
    register(mlflow_server, name="reg-again", model_dir=_model_dir(tmp_path, 2), run_key="run-b",
             experiment=EXPERIMENT)
    again = register(mlflow_server, name="reg-again", model_dir=model, run_key="run-a", experiment=EXPERIMENT)
    assert (again.version, again.run_id, again.aliases) == (first.version, first.run_id, ())

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server, registry_uri=mlflow_server)
    assert sorted(v.version for v in client.search_model_versions("name = 'reg-again'")) == ["1", "2"]
    assert client.get_registered_model("reg-again").aliases == {CHALLENGER: "2"}


def test_the_version_carries_the_run_key_data_hash_links_and_the_evaluation(mlflow_server: str, tmp_path: Path) -> None:
    links = {"report": "http://airflow/report/run-e", "Airflow run": "http://airflow/dags/verl_ppo/runs/manual__e"}
    mv = register(mlflow_server, name="reg-tags", model_dir=_model_dir(tmp_path, 1), run_key="run-e",
                  experiment=EXPERIMENT, evaluation=_evaluation(), data_hash="trainhash1", links=links)
    assert mv.tags == {
        "run_key": "run-e", "model_dir": str(tmp_path / "run-1" / "model"), "data_hash": "trainhash1",
        "smoke": "true", "evaluation_data_hash": "evalhash1", "evaluation_split": "val",
        "trained_mean_reward": "0.75", "trained_pass_rate": "0.5", "base_mean_reward": "0.25",
        "base_pass_rate": "0.125", "champion_mean_reward": "0.5", "champion_pass_rate": "0.375",
        "link.report": links["report"], "link.Airflow run": links["Airflow run"]}

    from mlflow.tracking import MlflowClient

    run = MlflowClient(tracking_uri=mlflow_server).get_run(mv.run_id)
    assert run.data.metrics == {"trained_mean_reward": 0.75, "trained_pass_rate": 0.5, "base_mean_reward": 0.25,
                                "base_pass_rate": 0.125, "champion_mean_reward": 0.5, "champion_pass_rate": 0.375}
    assert run.info.run_name == "run-e" and run.info.status == "FINISHED"  # a run made here is ended here


def test_the_model_joins_the_run_the_tracker_logged_the_training_to(mlflow_server: str, tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=mlflow_server)
    experiment_id = client.create_experiment("vp-registry-tracked")
    trained = client.create_run(experiment_id, run_name="run-t")  # as the submit task names it for verl
    client.log_metric(trained.info.run_id, "critic/score/mean", 0.5)
    mv = register(mlflow_server, name="reg-tracked", model_dir=_model_dir(tmp_path, 1), run_key="run-t",
                  experiment="vp-registry-tracked", evaluation=_evaluation())
    assert mv.run_id == trained.info.run_id
    run = client.get_run(trained.info.run_id)
    assert run.data.metrics["critic/score/mean"] == 0.5 and run.data.metrics["trained_mean_reward"] == 0.75
    assert run.info.status == "RUNNING"  # the tracker's run is left as its owner left it


def test_promote_moves_champion_and_records_the_previous_one(mlflow_server: str, tmp_path: Path) -> None:
    for seed, key in ((1, "run-a"), (2, "run-b")):
        register(mlflow_server, name="reg-promote", model_dir=_model_dir(tmp_path, seed), run_key=key,
                 experiment=EXPERIMENT)
    assert champion_version(mlflow_server, name="reg-promote") is None
    assert champion_version(mlflow_server, name="reg-no-such-model") is None

    first = promote(mlflow_server, name="reg-promote", version=1)
    assert first.aliases == (CHAMPION,) and PREVIOUS_CHAMPION_TAG not in first.tags
    second = promote(mlflow_server, name="reg-promote", version=2)
    assert second.aliases == (CHALLENGER, CHAMPION) and second.tags[PREVIOUS_CHAMPION_TAG] == "1"
    champion = champion_version(mlflow_server, name="reg-promote")
    assert champion is not None and champion.version == 2 and champion.tags["run_key"] == "run-b"
    # Promoting the champion again changes nothing: its record of the one before stays.
    assert promote(mlflow_server, name="reg-promote", version=2).tags[PREVIOUS_CHAMPION_TAG] == "1"

    from mlflow.tracking import MlflowClient

    assert MlflowClient(tracking_uri=mlflow_server).get_model_version("reg-promote", "1").aliases == []
    with pytest.raises(PipelineError) as e:
        promote(mlflow_server, name="reg-promote", version=9)
    assert str(e.value).startswith(f"trackers.mlflow: the MLflow server {mlflow_server} could not promote "
                                   "'reg-promote' version 9: ") and "\n" not in str(e.value)
    assert champion_version(mlflow_server, name="reg-promote").version == 2  # type: ignore[union-attr]


def test_the_login_is_set_for_the_call_only(mlflow_server: str, tmp_path: Path,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "ambient")
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    mv = register(mlflow_server, name="reg-login", model_dir=_model_dir(tmp_path, 1), run_key="run-l",
                  experiment=EXPERIMENT, username="alice", password="vpcanary-pw")
    assert mv.version == 1
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "ambient" and "MLFLOW_TRACKING_PASSWORD" not in os.environ


def test_an_unreachable_server_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")
    with socket.socket() as s:  # a port nothing listens on: bound, never listening
        s.bind(("127.0.0.1", 0))
        uri = f"http://127.0.0.1:{s.getsockname()[1]}"
        with pytest.raises(PipelineError) as e:
            register(uri, name="reg-down", model_dir=_model_dir(tmp_path, 1), run_key="run-d", experiment=EXPERIMENT)
        msg = str(e.value)
        assert msg.startswith(f"trackers.mlflow: the MLflow server {uri} could not register the model of run run-d "
                              "as 'reg-down': cannot connect ([Errno 111] Connection refused) ")
        assert "\n" not in msg and msg.endswith("(fix: start the server, or correct the host, port and login of the "
                                                "MLflow connection)")
        with pytest.raises(PipelineError, match=r"could not read the champion of 'reg-down'"):
            champion_version(uri, name="reg-down")


def test_a_folder_without_an_exported_model_is_refused_before_the_server_is_asked(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"holds no exported model \(no config.json\): run run-x cannot be registered"):
        register("http://127.0.0.1:9", name="reg-none", model_dir=tmp_path, run_key="run-x", experiment=EXPERIMENT)
