"""Known-bad configurations: each is rejected on the Airflow side, before any cluster, with a message
naming the key, the value, the rule and a value that would pass (and, where the fix is one
``key=value``, that value does pass)."""

from __future__ import annotations

import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline import steps
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.trainer.validate import VerlConfigError

PPO = ("qwen2.5-0.5b-ppo", "gpu-address")
GRPO = ("qwen2.5-0.5b-grpo", "gpu-address")
AT_1X8 = {"nnodes": 1, "n_gpus_per_node": 8}


@dataclass
class Bad:
    name: str
    key: str
    rule: str
    profiles: tuple[str, str] = PPO
    params: dict[str, Any] = field(default_factory=lambda: dict(AT_1X8))
    overrides: dict[str, Any] = field(default_factory=dict)
    #: (kind, name, dotted path, value) edits to a copy of configs/ before resolving.
    edits: tuple[tuple[str, str, str, Any], ...] = ()
    #: Caught by verl's own checks (compose + validate) rather than the project's.
    by_verl: bool = False


TABLE = [
    Bad("batch not divisible by GPUs", "data.train_batch_size", "must be divisible by nnodes x n_gpus_per_node",
        params={"nnodes": 3, "n_gpus_per_node": 5}, overrides={"data.train_batch_size": 48}),
    Bad("GRPO with one response per prompt", "actor_rollout_ref.rollout.n", "needs n >= 2", GRPO,
        overrides={"actor_rollout_ref.rollout.n": 1}),
    Bad("mini-batch larger than the batch", "actor_rollout_ref.actor.ppo_mini_batch_size",
        "must be between 1 and data.train_batch_size", overrides={"actor_rollout_ref.actor.ppo_mini_batch_size": 4096}),
    Bad("mini-batch x n not split over GPUs", "actor_rollout_ref.actor.ppo_mini_batch_size", "must split evenly",
        GRPO, overrides={"actor_rollout_ref.actor.ppo_mini_batch_size": 12}),
    Bad("micro batch not dividing the per-GPU mini-batch", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
        "must divide the per-GPU mini-batch", overrides={"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 3}),
    Bad("critic micro batch", "critic.ppo_micro_batch_size_per_gpu", "must divide the per-GPU mini-batch",
        overrides={"critic.ppo_micro_batch_size_per_gpu": 5}),
    Bad("TP not dividing GPUs per node", "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "must divide n_gpus_per_node", overrides={"actor_rollout_ref.rollout.tensor_model_parallel_size": 3}),
    Bad("TP not dividing attention heads", "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "num_attention_heads (28)", ("qwen2.5-7b-grpo", "gpu-address"),
        overrides={"actor_rollout_ref.rollout.tensor_model_parallel_size": 8}),
    Bad("TP too small for 32B weights", "actor_rollout_ref.rollout.tensor_model_parallel_size", "do not fit",
        ("qwen2.5-32b-grpo", "gpu-address"), overrides={"actor_rollout_ref.rollout.tensor_model_parallel_size": 1}),
    Bad("32B on 2 GPUs per node", "actor_rollout_ref.rollout.tensor_model_parallel_size", "the model does not fit",
        ("qwen2.5-32b-grpo", "gpu-address"), params={"nnodes": 4, "n_gpus_per_node": 2}),
    Bad("gpu_memory_utilization too high", "actor_rollout_ref.rollout.gpu_memory_utilization",
        "between 0.1 and 0.95", overrides={"actor_rollout_ref.rollout.gpu_memory_utilization": 0.99}),
    Bad("GAE without a critic", "critic.enable", "gae advantages need a critic", overrides={"critic.enable": False}),
    Bad("checkpoints never saved", "trainer.save_freq", "never save", overrides={"trainer.save_freq": 0}),
    Bad("too few CPUs per node for the GPU bundles", "clusters/gpu-address.hardware.cpus_per_node",
        "3 CPUs per GPU", edits=(("clusters", "gpu-address", "hardware.cpus_per_node", 16),)),
    Bad("too few CPUs for TransferQueue's storage actors", "clusters/gpu-address.hardware.cpus_per_node",
        "TransferQueue storage actors", params={"nnodes": 1, "n_gpus_per_node": 4},
        edits=(("clusters", "gpu-address", "hardware.cpus_per_node", 14),)),
    Bad("checkpoints outside the shared mount", "clusters/gpu-address.storage.checkpoints",
        "is not under a shared mount", edits=(("clusters", "gpu-address", "storage.checkpoints", "/local/ckpt"),)),
    Bad("relative storage path", "clusters/gpu-address.storage.data", "must be absolute",
        edits=(("clusters", "gpu-address", "storage.data", "data"),)),
    Bad("model shape unknown", "models/qwen2.5-0.5b-ppo.model.hidden_size", "is required",
        edits=(("models", "qwen2.5-0.5b-ppo", "model.hidden_size", None),)),
    Bad("InfiniBand without HCAs", "clusters/gpu-address.network.ib_hcas", "InfiniBand needs the HCAs",
        edits=(("clusters", "gpu-address", "network.infiniband", True),)),
    Bad("GPU memory unknown", "clusters/gpu-address.hardware.gpu_memory_gb", "is required",
        edits=(("clusters", "gpu-address", "hardware.gpu_memory_gb", None),)),
    # verl's own checks, turned into ConfigErrors naming the key verl names.
    Bad("both micro batch spellings", "actor_rollout_ref.actor.ppo_micro_batch_size", "You have set both",
        overrides={"actor_rollout_ref.actor.ppo_micro_batch_size": 8}, by_verl=True),
    Bad("unknown loss aggregation", "actor_rollout_ref.actor.loss_agg_mode", "Invalid loss_agg_mode",
        overrides={"actor_rollout_ref.actor.loss_agg_mode": "mean"}, by_verl=True),
    Bad("sampled validation at temperature 0", "actor_rollout_ref.rollout.temperature",
        "temperature should be greater than 0",
        overrides={"actor_rollout_ref.rollout.val_kwargs.do_sample": True, "actor_rollout_ref.rollout.temperature": 0},
        by_verl=True),
    Bad("misspelt verl key", "actor_rollout_ref.actor.ppo_mini_batchsize", "could not compose",
        overrides={"actor_rollout_ref.actor.ppo_mini_batchsize": 8}, by_verl=True),
]


def _edited_configs(tmp_path: Path, edits: tuple[tuple[str, str, str, Any], ...]) -> Path:
    root = tmp_path / "configs"
    shutil.copytree(configs_dir(), root)
    for kind, name, dotted, value in edits:
        path = root / kind / f"{name}.yaml"
        data = yaml.safe_load(path.read_text())
        *parents, leaf = dotted.split(".")
        node = data
        for p in parents:
            node = node.setdefault(p, {})
        if value is None:
            node.pop(leaf, None)
        else:
            node[leaf] = value
        path.write_text(yaml.safe_dump(data))
    return root


def _resolve(case: Bad, overrides: dict[str, Any]) -> None:
    spec = build_run_spec(case.params, run_name="bad", model_profile=case.profiles[0],
                          cluster_profile=case.profiles[1], overrides=overrides)
    if case.by_verl:
        steps.validate_spec_with_verl(spec)


def test_table_is_large_enough() -> None:
    assert len(TABLE) >= 15
    assert len({c.name for c in TABLE}) == len(TABLE)


@pytest.mark.parametrize("case", TABLE, ids=[c.name for c in TABLE])
def test_known_bad_configuration_is_rejected(case: Bad, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if case.edits:
        monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(_edited_configs(tmp_path, case.edits)))
    with pytest.raises(ConfigError) as err:
        _resolve(case, dict(case.overrides))
    e = err.value
    assert isinstance(e, VerlConfigError) == case.by_verl, e
    assert e.key == case.key, str(e)
    assert case.rule in e.rule, str(e)
    message = str(e)
    assert message.startswith(f"{e.key}="), message  # key and value first
    assert e.fix, f"no value that would pass: {message}"
    # A one-key fix is applied and must then pass.
    m = re.fullmatch(r"([\w.]+)=(\S+)", e.fix)
    if m and not case.edits:
        fixed = {**case.overrides, m.group(1): yaml.safe_load(m.group(2))}
        if m.group(1) in ("actor_rollout_ref.actor.ppo_micro_batch_size", "critic.ppo_micro_batch_size"):
            fixed[m.group(1)] = None
        _resolve(case, fixed)


def test_verl_rejection_names_the_value_that_was_set() -> None:
    case = next(c for c in TABLE if c.name == "unknown loss aggregation")
    with pytest.raises(VerlConfigError) as err:
        _resolve(case, dict(case.overrides))
    assert err.value.value == "mean"
    assert "verl rejected the configuration" in err.value.rule


def test_an_outdated_key_names_the_key_verl_has_now() -> None:
    """The seed article's key (written for an older verl) fails naming where verl 0.9.1 keeps it."""
    from verl_pipeline.trainer.validate import compose, session

    with session(), pytest.raises(VerlConfigError) as err:
        compose(["critic.model.fsdp_config.optimizer_offload=true"])
    assert err.value.key == "critic.model.fsdp_config.optimizer_offload"
    assert err.value.fix is not None and "critic.fsdp.optimizer_offload" in err.value.fix
