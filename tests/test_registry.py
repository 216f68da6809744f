"""The model registry: the run profile's setting naming the registered model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.registry import RegistrySettings
from verl_pipeline.spec import RunSpec
from verl_pipeline.trackers import Tracker, TrackerSettings


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
