from __future__ import annotations

from pathlib import Path

import pytest

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec, list_profiles
from verl_pipeline.spec import ModelSource


def test_default_profile_resolves() -> None:
    spec = build_run_spec({}, run_name="verl_ppo/r1")
    assert spec.profile == "smoke"
    assert spec.mode is Mode.AUTO
    assert spec.model == ModelSource("builtin", "tiny-qwen2")
    assert spec.cluster["backend"] == "local"
    assert spec.checkpoint_dir.is_absolute()
    assert spec.verl["data.train_batch_size"] == 16


def test_every_profile_resolves() -> None:
    for name in list_profiles():
        spec = build_run_spec({"profile": name}, run_name="r")
        assert spec.profile == name


def test_params_override_profile_and_scale_batches() -> None:
    spec = build_run_spec({"nnodes": 4, "n_gpus_per_node": 8, "total_training_steps": 9, "mode": "preflight"},
                          run_name="r")
    assert (spec.nnodes, spec.n_gpus_per_node, spec.total_training_steps, spec.mode) == (4, 8, 9, Mode.PREFLIGHT)
    assert spec.verl["data.train_batch_size"] == 64
    assert spec.verl["actor_rollout_ref.actor.ppo_mini_batch_size"] == 32
    assert "4 node(s)" in spec.derived["data.train_batch_size"]


def test_run_dirs_are_per_run() -> None:
    a = build_run_spec({}, run_name="verl_ppo/run-a")
    b = build_run_spec({}, run_name="verl_ppo/run-b")
    assert a.checkpoint_dir != b.checkpoint_dir
    assert a.run_dir != b.run_dir


BAD = [
    ({"profile": "nope"}, "profile", "no such profile"),
    ({"profile": "../etc/passwd"}, "profile", "is not a profile name"),
    ({"nnodes": 0}, "nnodes", "between 1 and 1024"),
    ({"nnodes": "two"}, "nnodes", "must be an integer"),
    ({"n_gpus_per_node": 17}, "n_gpus_per_node", "between 1 and 16"),
    ({"total_training_steps": 0}, "total_training_steps", "between 1"),
    ({"mode": "fast"}, "mode", "unknown mode"),
    ({"model_source": "builtin:gpt5"}, "model_source", "unknown built-in model"),
    ({"model_source": "hf://not a repo"}, "model_source", "is not a hub reference"),
    ({"model_source": "relative/model"}, "model_source", "absolute directory"),
    ({"data_source": "builtin:nope"}, "data_source", "unknown built-in data source"),
    ({"data_source": "/does/not/exist.jsonl"}, "data_source", "no such file"),
    ({"data_source": "data.jsonl"}, "data_source", "absolute path"),
    ({"n_gpus_per_node": 17}, "n_gpus_per_node", "between 1 and 16"),
    ({"learning_rate": 1}, "learning_rate", "not a parameter of this pipeline"),
]


@pytest.mark.parametrize(("params", "key", "rule"), BAD)
def test_bad_params_are_rejected_with_key_and_rule(params: dict, key: str, rule: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_run_spec(params, run_name="r")
    assert err.value.key == key
    assert rule in str(err.value)


def test_divisibility_error_suggests_a_value_that_passes() -> None:
    with pytest.raises(ConfigError) as err:
        build_run_spec({"n_gpus_per_node": 3}, run_name="r", overrides={"data.train_batch_size": 16})
    assert err.value.key == "data.train_batch_size"
    assert "must be divisible by nnodes x n_gpus_per_node" in err.value.rule
    assert err.value.fix and "data.train_batch_size=" in err.value.fix
    suggested = int(err.value.fix.split("=")[1])
    assert suggested % 3 == 0
    build_run_spec({"n_gpus_per_node": 3}, run_name="r", overrides={"data.train_batch_size": suggested})


def test_odd_gpu_counts_are_made_to_fit_by_the_scaling_rule() -> None:
    spec = build_run_spec({"nnodes": 5, "n_gpus_per_node": 3}, run_name="r")
    assert spec.verl["data.train_batch_size"] == 18 * 5  # 16 per node rounded up to a multiple of 3
    assert "rounded up from 16" in spec.derived["data.train_batch_size"]


def test_directory_data_source_needs_train_jsonl(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"train\.jsonl"):
        build_run_spec({"data_source": str(tmp_path)}, run_name="r")


def test_tensor_parallel_must_divide_gpus_per_node() -> None:
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    with pytest.raises(ConfigError) as err:
        build_run_spec({"n_gpus_per_node": 2}, run_name="r", overrides={key: 4})
    assert err.value.key == key
    assert "[1, 2]" in str(err.value.fix)
    # The tiny model has 2 attention heads: tp 2 divides both.
    spec = build_run_spec({"n_gpus_per_node": 8}, run_name="r", overrides={key: 2})
    assert spec.n_gpus == 8 and spec.verl[key] == 2
    assert "set explicitly" in spec.derived[key]
    with pytest.raises(ConfigError, match="num_attention_heads"):
        build_run_spec({"n_gpus_per_node": 8}, run_name="r", overrides={key: 4})


def test_a_value_the_user_spells_with_plus_signs_wins_over_its_rule() -> None:
    """``++key`` (or ``+key``) for a key a scaling rule sets: the user's value is the one rendered, once."""
    key = "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"
    for spelling in (f"++{key}", f"+{key}"):
        spec = build_run_spec({"n_gpus_per_node": 1}, run_name="r", overrides={spelling: 1})
        assert spec.verl[key] == 1 and spelling not in spec.verl, spelling
        assert "set explicitly" in spec.derived[key]


def test_layers_cluster_then_run_profile_then_params() -> None:
    # gpu-address says 1 x 8; the run profile repeats it; DAG params win over both.
    spec = build_run_spec({"profile": "gsm8k-qwen2.5-0.5b-ppo"}, run_name="r")
    assert (spec.nnodes, spec.n_gpus_per_node) == (1, 8)
    spec = build_run_spec({"profile": "gsm8k-qwen2.5-0.5b-ppo", "nnodes": 4}, run_name="r")
    assert spec.nnodes == 4 and spec.verl["data.train_batch_size"] == 1024
    assert spec.checkpoint_dir.parent == Path("/shared/checkpoints")
    assert spec.data_root == Path("/shared/data") and spec.model_cache == Path("/shared/models")


def test_overrides_are_the_last_layer() -> None:
    spec = build_run_spec({}, run_name="r", overrides={"data.max_prompt_length": 300,
                                                        "actor_rollout_ref.actor.ppo_mini_batch_size": 16})
    assert spec.verl["data.max_prompt_length"] == 300
    assert spec.verl["actor_rollout_ref.actor.ppo_mini_batch_size"] == 16
    assert "the rule would give 8" in spec.derived["actor_rollout_ref.actor.ppo_mini_batch_size"]


# -- layering as named, overrides from the form, typed errors ---------------------------------------
def test_a_named_cluster_profile_brings_its_shape() -> None:
    # smoke's 1 x 1 was written for its own cluster (local-cpu); h100-ib is 4 x 8.
    spec = build_run_spec({}, run_name="r", model_profile="qwen2.5-7b-grpo", cluster_profile="h100-ib")
    assert (spec.nnodes, spec.n_gpus_per_node) == (4, 8)
    # The same through the DAG's params; a shape param still wins over the cluster profile.
    spec = build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib", "nnodes": 2},
                          run_name="r")
    assert (spec.model_profile, spec.cluster_profile, spec.nnodes, spec.n_gpus_per_node) == (
        "qwen2.5-7b-grpo", "h100-ib", 2, 8)
    # Naming the run profile's own cluster keeps the run profile's shape.
    spec = build_run_spec({"cluster_profile": "local-cpu"}, run_name="r")
    assert (spec.nnodes, spec.n_gpus_per_node) == (1, 1)


def test_every_shipped_cluster_profile_renders_out_of_the_box() -> None:
    for name in list_profiles("clusters"):
        spec = build_run_spec({"cluster_profile": name}, run_name="r")
        assert spec.cluster_profile == name and spec.hardware is not None


def test_verl_overrides_param_wins_and_appends() -> None:
    spec = build_run_spec({"verl_overrides": [
        "actor_rollout_ref.actor.optim.lr=1e-6", "data.max_prompt_length=300",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa"]}, run_name="r")
    assert spec.verl["actor_rollout_ref.actor.optim.lr"] == 1e-6  # a float, as Hydra reads it
    assert spec.verl["data.max_prompt_length"] == 300
    assert spec.verl["+actor_rollout_ref.model.override_config.attn_implementation"] == "sdpa"
    # The CLI's --set is the same layer, and wins over the param when both name a key.
    spec = build_run_spec({"verl_overrides": ["data.max_prompt_length=300"]}, run_name="r",
                          overrides={"data.max_prompt_length": 200})
    assert spec.verl["data.max_prompt_length"] == 200


@pytest.mark.parametrize(("params", "overrides", "key"), [
    ({"verl_overrides": ["data.train_batch_size=abc"]}, None, "data.train_batch_size"),
    ({}, {"data.train_batch_size": "abc"}, "data.train_batch_size"),
    ({}, {"actor_rollout_ref.rollout.gpu_memory_utilization": "high"},
     "actor_rollout_ref.rollout.gpu_memory_utilization"),
    ({}, {"actor_rollout_ref.rollout.n": True}, "actor_rollout_ref.rollout.n"),
    ({"verl_overrides": ["no equals sign"]}, None, "verl_overrides"),
    ({"verl_overrides": ["bad key!=1"]}, None, "verl_overrides"),
    ({"verl_overrides": "data.train_batch_size=8"}, None, "verl_overrides"),
    ({"cluster_profile": "nope"}, None, "cluster_profile"),
])
def test_badly_typed_values_name_the_key(params: dict, overrides: dict | None, key: str) -> None:
    with pytest.raises(ConfigError) as err:
        build_run_spec(params, run_name="r", overrides=overrides)
    assert key in str(err.value) and err.value.fix
    assert "\n" not in str(err.value)


def test_a_hydra_append_may_sit_at_any_level_of_a_verl_section() -> None:
    from verl_pipeline.trainer.overrides import flatten

    assert flatten({"actor_rollout_ref": {"model": {"override_config": {"+attn_implementation": "sdpa"}}},
                    "+extra": {"a": 1}, "data": {"x": 2}}) == {
        "+actor_rollout_ref.model.override_config.attn_implementation": "sdpa", "+extra.a": 1, "data.x": 2}


def test_an_hdfs_url_without_java_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_pipeline.data.sources import fsspec_filesystem

    monkeypatch.delenv("JAVA_HOME", raising=False)
    with pytest.raises(ConfigError, match=r"hdfs:// needs a Java runtime.*JAVA_HOME"):
        fsspec_filesystem("hdfs://nn/x.jsonl")


def test_closest_keys_prefer_the_same_name_in_the_same_section() -> None:
    from verl_pipeline.trainer.validate import closest_keys

    known = ["actor_rollout_ref.actor.fsdp_config.optimizer_offload",
             "actor_rollout_ref.ref.fsdp_config.optimizer_offload", "critic.fsdp.optimizer_offload",
             "critic.fsdp.param_offload", "data.train_batch_size", "data.gen_batch_size"]
    assert closest_keys("critic.model.fsdp_config.optimizer_offload", known) == ["critic.fsdp.optimizer_offload"]
    assert closest_keys("data.train_batchsize", known)[0] == "data.train_batch_size"
    assert closest_keys("trainer.zzz", known) == []


def test_warm_caches_and_validation_on_resume_are_profile_settings(own_configs: Path) -> None:
    import yaml

    spec = build_run_spec({"cluster_profile": "gpu-address"}, run_name="caches")
    assert spec.warm_caches and spec.cache_root == Path("/shared/caches") and not spec.validate_on_resume
    cluster = own_configs / "clusters" / "gpu-address.yaml"
    prof = yaml.safe_load(cluster.read_text())
    where = "clusters/gpu-address"
    for change, key in (({"runtime": {**prof["runtime"], "warm_caches": "no"}}, f"{where}.runtime.warm_caches"),
                        ({"storage": {**prof["storage"], "caches": "caches"}}, f"{where}.storage.caches"),
                        ({"storage": {**prof["storage"], "caches": "/elsewhere/caches"}}, f"{where}.storage.caches")):
        cluster.write_text(yaml.safe_dump({**prof, **change}))
        with pytest.raises(ConfigError) as err:
            build_run_spec({"cluster_profile": "gpu-address"}, run_name="caches")
        assert err.value.key == key and "\n" not in str(err.value)
    cluster.write_text(yaml.safe_dump({**prof, "runtime": {**prof["runtime"], "warm_caches": False}}))
    assert not build_run_spec({"cluster_profile": "gpu-address"}, run_name="caches").warm_caches
    run = own_configs / "profiles" / "smoke.yaml"
    run.write_text(run.read_text() + "validate_on_resume: true\n")
    resumed = build_run_spec({}, run_name="resume")
    assert resumed.validate_on_resume and type(resumed).from_dict(resumed.to_dict()).validate_on_resume
    run.write_text(run.read_text().replace("validate_on_resume: true", "validate_on_resume: 1"))
    with pytest.raises(ConfigError, match=r"profiles/smoke\.validate_on_resume"):
        build_run_spec({}, run_name="resume")
