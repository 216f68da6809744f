"""The run's frozen spec: written and read back field by field, and the files earlier releases wrote still load."""

from __future__ import annotations

import json
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from verl_pipeline.constants import Mode, Placement, WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import DataSource, ModelSource, RunSpec, _encode

#: run_spec.json files written by the release at 626f96e (the first that froze a run's spec): the
#: embedded default, and a run using every kind of field (critic and reward models with file patterns,
#: separate pools, a shared cluster's pool, InfiniBand, watch and tracker settings, merge on resize).
EARLIER = Path(__file__).parent / "run_specs"


@pytest.mark.parametrize("name", ["626f96e-smoke", "626f96e-rich"])
def test_a_spec_an_earlier_release_froze_loads_and_writes_back_unchanged(name: str, tmp_path: Path) -> None:
    written = json.loads((EARLIER / f"{name}.json").read_text())
    run_dir = RunDir(tmp_path)
    run_dir.save_spec(written)
    spec = RunSpec.load(run_dir)
    again = spec.to_dict()
    # Every field the file held is read and written back as it was; fields added since take their defaults.
    added = {f.name: _encode(f.default_factory() if f.default is MISSING else f.default)  # type: ignore[misc]
             for f in fields(RunSpec) if f.name not in written}
    assert {k: v for k, v in again.items() if k in written} == {**written, "model_facts": again["model_facts"]}
    assert {k: again[k] for k in added} == added
    if written.get("model_facts"):  # facts a model profile has had to give since are None in an older file
        assert {k: v for k, v in again["model_facts"].items() if k in written["model_facts"]} == written["model_facts"]
    assert RunSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


def test_every_kind_of_field_is_read_back_as_its_type() -> None:
    spec = RunSpec.from_dict(json.loads((EARLIER / "626f96e-rich.json").read_text()))
    assert spec.model == ModelSource("hf", "Qwen/Qwen2.5-0.5B-Instruct", "main")
    assert spec.model.allow_patterns == ("*.json", "*.safetensors", "tokenizer*")
    assert spec.critic_model == ModelSource("hf", "Qwen/Qwen2.5-0.5B", "main")
    assert spec.reward_model == ModelSource("builtin", "tiny-qwen2")
    assert spec.data == DataSource("hf", "hf://openai/gsm8k?config=main")
    assert spec.mode is Mode.AUTO and spec.placement is Placement.SEPARATE
    assert spec.on_world_size_change is WorldSizeChange.MERGE and spec.export_model is False
    assert spec.storage_root == Path("/shared") and spec.shared_roots == ("/shared",)
    assert spec.hardware is not None and spec.hardware.ib_hcas == ("mlx5_0", "mlx5_1")
    assert spec.pools is not None and spec.pools.train_nnodes == 1
    assert spec.watch.stall_timeout_s == 2700.0 and spec.trackers.conn_ids == {"mlflow": "mlflow_team"}
    assert spec.admission is not None and spec.admission.slots == 16
    assert spec.trainer_command == ("python", "-m", "verl.trainer.main_ppo")
    assert spec.verl["actor_rollout_ref.actor.optim.lr"] == 1e-6


def test_a_field_an_older_file_lacks_takes_its_default_and_a_required_one_is_named(tmp_path: Path) -> None:
    written = json.loads((EARLIER / "626f96e-smoke.json").read_text())
    defaulted = [f.name for f in fields(RunSpec) if f.name in ("admission", "watch", "export_model")]
    older = {k: v for k, v in written.items() if k not in defaulted}
    spec = RunSpec.from_dict(older)
    assert spec.admission is None and spec.export_model is True
    run_dir = RunDir(tmp_path)
    run_dir.save_spec({k: v for k, v in written.items() if k != "nnodes"})
    with pytest.raises(ConfigError, match=r"run_spec\.json.*cannot be read.*nnodes"):
        RunSpec.load(run_dir)
