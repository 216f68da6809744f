from __future__ import annotations

import pytest

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer import scaling
from verl_pipeline.trainer.scaling import Hardware, ModelFacts

QWEN_7B = ModelFacts(params_b=7.6, hidden_size=3584, num_layers=28, num_attention_heads=28)
QWEN_32B = ModelFacts(params_b=32.8, hidden_size=5120, num_layers=64, num_attention_heads=40)
H100 = Hardware(gpu_memory_gb=80, cpus_per_node=96, infiniband=True, ib_hcas=("mlx5_0", "mlx5_1"), nccl_proto="Simple")
L4 = Hardware(gpu_memory_gb=24, cpus_per_node=48)


@pytest.mark.parametrize(("mem", "util"), [(16, 0.8), (24, 0.8), (40, 0.85), (48, 0.85), (80, 0.9), (141, 0.95)])
def test_memory_utilization_by_gpu_memory(mem: float, util: float) -> None:
    assert scaling.memory_utilization(mem)[0] == util


def test_rollout_tp_from_model_size_and_gpu_memory() -> None:
    assert scaling.rollout_tp(QWEN_7B, H100, 8)[0] == 1
    assert scaling.rollout_tp(QWEN_7B, L4, 4)[0] == 2
    assert scaling.rollout_tp(QWEN_32B, H100, 8)[0] == 4
    assert scaling.rollout_tp(QWEN_32B, L4, 8)[0] == 8
    tp, why = scaling.rollout_tp(QWEN_32B, H100, 2)
    assert tp is None and "need tp >= 3" in why
    assert scaling.min_gpus_per_node(QWEN_32B, H100) == 4
    # A large model gets TP >= 2 even when one GPU would hold its weights.
    big_gpu = Hardware(gpu_memory_gb=192, cpus_per_node=None)
    assert scaling.rollout_tp(QWEN_32B, big_gpu, 8)[0] == 2
    # TP also divides the attention heads: 28 heads never get 8.
    assert 28 % scaling.rollout_tp(ModelFacts(60, 1, 1, 28), big_gpu, 8)[0] == 0  # type: ignore[operator]


def test_batch_sizes_scale_linearly_and_stay_divisible() -> None:
    settings = {"actor_rollout_ref.rollout.n": 5, "algorithm.adv_estimator": "grpo",
                "actor_rollout_ref.actor.use_kl_loss": True}
    base = {"train_batch_size_per_node": 100, "ppo_mini_batch_size_per_node": 30, "max_micro_batch_size_per_gpu": 4}
    sizes = []
    for nnodes in (1, 2, 4, 32):
        d = scaling.derive(settings, base, QWEN_7B, H100, nnodes=nnodes, n_gpus_per_node=8, explicit=set())
        s = d.settings
        tbs, mini = s["data.train_batch_size"], s["actor_rollout_ref.actor.ppo_mini_batch_size"]
        micro = s["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
        assert (tbs * 5) % (8 * nnodes) == 0 and (mini * 5) % (8 * nnodes) == 0 and tbs % mini == 0
        assert (mini * 5 // (8 * nnodes)) % micro == 0 and micro <= 4
        assert "critic.ppo_mini_batch_size" not in s  # GRPO: no critic
        assert s["actor_rollout_ref.ref.fsdp_config.param_offload"] in (True, False)  # KL loss: a reference
        sizes.append(tbs)
    assert sizes == [104, 208, 416, 104 * 32]  # 100 per node rounded up to a multiple of 8


def test_offload_switches_on_when_state_does_not_fit() -> None:
    ppo = {"algorithm.adv_estimator": "gae"}
    one = scaling.derive(ppo, {"train_batch_size_per_node": 64}, QWEN_7B, H100, nnodes=1, n_gpus_per_node=4,
                         explicit=set())
    many = scaling.derive(ppo, {"train_batch_size_per_node": 64}, QWEN_7B, H100, nnodes=4, n_gpus_per_node=4,
                          explicit=set())
    # 7.6B x 16 B x 2 (critic) / 4 GPUs = 61 GB > 40 GB; over 16 GPUs 15 GB fits.
    assert one.settings["actor_rollout_ref.actor.fsdp_config.param_offload"] is True
    assert one.settings["critic.fsdp.optimizer_offload"] is True
    assert many.settings["actor_rollout_ref.actor.fsdp_config.param_offload"] is False
    rule = next(r for r in one.rules if r.key == "actor_rollout_ref.actor.fsdp_config.param_offload")
    assert "x 2 (critic)" in rule.rule and "> 35% of 80 GB" in rule.rule


def test_explicit_values_win_and_are_reported() -> None:
    key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    d = scaling.derive({key: 0.7}, {"train_batch_size_per_node": 8}, QWEN_7B, H100, nnodes=1, n_gpus_per_node=1,
                       explicit={key})
    assert d.settings[key] == 0.7
    rule = next(r for r in d.rules if r.key == key)
    assert rule.overridden and "would give 0.9" in rule.text()


def test_required_cpus_counts_bundles_and_transfer_queue() -> None:
    need, why = scaling.required_cpus(16, {})
    assert need == 3 * 16 + 8 + 2 and "TransferQueue" in why
    assert scaling.required_cpus(1, {"transfer_queue.backend.SimpleStorage.num_data_storage_units": 2})[0] == 7


def test_nccl_environment_from_the_cluster_profile() -> None:
    assert scaling.nccl_env(H100, debug=False) == {"NCCL_IB_HCA": "mlx5_0,mlx5_1", "NCCL_PROTO": "Simple"}
    assert scaling.nccl_env(L4, debug=False) == {}
    assert scaling.nccl_env(L4, debug=True) == {"NCCL_DEBUG": "INFO"}


def test_model_facts_are_required_and_positive() -> None:
    with pytest.raises(ConfigError, match="num_attention_heads"):
        ModelFacts.from_profile({"params_b": 1, "hidden_size": 1, "num_layers": 1}, "m")
    with pytest.raises(ConfigError, match="must be positive"):
        ModelFacts.from_profile({"params_b": -1, "hidden_size": 1, "num_layers": 1, "num_attention_heads": 1}, "m")
    with pytest.raises(ConfigError, match="must be a number"):
        ModelFacts.from_profile({"params_b": "big", "hidden_size": 1, "num_layers": 1, "num_attention_heads": 1}, "m")


def test_every_derived_key_has_a_rule_in_the_spec() -> None:
    spec = build_run_spec({"nnodes": 4, "n_gpus_per_node": 8}, run_name="r", model_profile="qwen2.5-32b-grpo",
                          cluster_profile="h100-ib")
    for key in ("data.train_batch_size", "actor_rollout_ref.actor.ppo_mini_batch_size",
                "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu",
                "actor_rollout_ref.rollout.tensor_model_parallel_size",
                "actor_rollout_ref.rollout.gpu_memory_utilization",
                "actor_rollout_ref.actor.fsdp_config.param_offload"):
        assert key in spec.verl and spec.derived[key].startswith(repr(spec.verl[key]))


def test_params_are_estimated_from_the_shape_when_the_profile_omits_them() -> None:
    facts = ModelFacts.from_profile({"hidden_size": 5120, "num_layers": 64, "num_attention_heads": 40}, "m")
    assert facts.estimated and facts.params_b == pytest.approx(20.1, abs=0.1)  # 12 x 64 x 5120^2
    given = ModelFacts.from_profile({"params_b": 32.8, "hidden_size": 5120, "num_layers": 64,
                                     "num_attention_heads": 40}, "m")
    assert not given.estimated and given.params_b == 32.8


# -- placement: separate (rollout on its own GPU pool) ----------------------------------------------
@pytest.mark.parametrize(("nnodes", "g", "train", "rollout"), [
    (1, 8, (1, 4), (1, 4)), (4, 8, (2, 8), (2, 8)), (5, 8, (3, 8), (2, 8)), (32, 8, (16, 8), (16, 8)),
    (1, 2, (1, 1), (1, 1)),
])
def test_split_pools_gives_rollout_half_the_nodes(nnodes: int, g: int, train: tuple[int, int],
                                                  rollout: tuple[int, int]) -> None:
    split = scaling.split_pools(nnodes, g, {})
    assert (split.train_nnodes, split.train_gpus_per_node) == train
    assert (split.rollout_nnodes, split.rollout_gpus_per_node) == rollout
    assert split.reason


def test_split_pools_explicit_rollout_pool_wins_and_bad_splits_name_the_key() -> None:
    split = scaling.split_pools(4, 8, {scaling.ROLLOUT_NODES_KEY: 1})
    assert (split.train_nnodes, split.rollout_nnodes) == (3, 1) and "set explicitly" in split.reason
    split = scaling.split_pools(1, 8, {scaling.ROLLOUT_GPUS_KEY: 2})
    assert (split.train_gpus_per_node, split.rollout_gpus_per_node) == (6, 2)
    for nnodes, g, settings, key in ((1, 1, {}, "placement"), (4, 8, {scaling.ROLLOUT_NODES_KEY: 4}, "rollout.nnodes"),
                                     (1, 8, {scaling.ROLLOUT_GPUS_KEY: 8}, "rollout.n_gpus_per_node")):
        with pytest.raises(ConfigError) as err:
            scaling.split_pools(nnodes, g, settings)
        assert key in err.value.key and err.value.fix


def test_separate_placement_sizes_batches_for_the_training_pool_and_sets_verls_keys() -> None:
    colocated = build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib"}, run_name="r")
    spec = build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib", "placement": "separate"},
                          run_name="r")
    assert (spec.nnodes, spec.n_gpus_per_node, spec.n_gpus) == (4, 8, 32)  # the cluster asked for
    assert (spec.train_nnodes, spec.train_gpus) == (2, 16)
    v = spec.verl
    assert v["data.train_batch_size"] == colocated.verl["data.train_batch_size"] // 2  # 2 training nodes, not 4
    assert v["trainer.v1.trainer_mode"] == "separate_async" and v["actor_rollout_ref.hybrid_engine"] is False
    assert (v["actor_rollout_ref.rollout.nnodes"], v["actor_rollout_ref.rollout.n_gpus_per_node"]) == (2, 8)
    assert v["actor_rollout_ref.rollout.checkpoint_engine.backend"] == "nccl"
    sync = v["trainer.v1.separate_async.parameter_sync_step"]
    assert sync * v["actor_rollout_ref.actor.ppo_mini_batch_size"] == v["data.train_batch_size"]
    assert "half of 4 nodes" in spec.derived["actor_rollout_ref.rollout.nnodes"]
    from verl_pipeline.trainer.render import job_settings

    rendered = job_settings(spec, train_files="/d/t.parquet", val_files="/d/v.parquet", model_path="/m")
    assert (rendered["trainer.nnodes"], rendered["trainer.n_gpus_per_node"]) == (2, 8)  # the training pool


def test_a_parameter_sync_step_that_breaks_verls_rule_is_refused() -> None:
    with pytest.raises(ConfigError, match="parameter_sync_step"):
        build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib", "placement": "separate"},
                       run_name="r", overrides={"trainer.v1.separate_async.parameter_sync_step": 3})
    with pytest.raises(ConfigError, match="placement"):
        build_run_spec({"placement": "split"}, run_name="r")


@pytest.mark.parametrize("nnodes", [1, 4, 32])
def test_verl_accepts_the_separate_placement_at_every_documented_shape(nnodes: int) -> None:
    from verl_pipeline import steps

    spec = build_run_spec({"model_profile": "qwen2.5-7b-grpo", "cluster_profile": "h100-ib", "placement": "separate",
                           "nnodes": nnodes}, run_name="r")
    assert steps.validate_spec_with_verl(spec)["n_gpus"] == spec.train_gpus


@pytest.mark.parametrize(("mem", "resident", "util"), [
    (139.8, 8.8, 0.8),   # the 0.5B GRPO profile on one H200: 0.95 ran out of memory at step 2's rollout
    (80, 17.1, 0.65),    # 7B GRPO on 8 x 80 GB, not offloaded: verl's own examples run 0.6
    (80, 0.0, 0.9),      # offloaded: the tier
    (24, 0.0, 0.8),
])
def test_vllm_share_leaves_room_for_the_training_state(mem: float, resident: float, util: float) -> None:
    assert scaling.rollout_memory_utilization(mem, resident)[0] == util


QWEN_05B = ModelFacts(params_b=0.49, hidden_size=896, num_layers=24, num_attention_heads=14, num_key_value_heads=2)
H200 = Hardware(gpu_memory_gb=140, cpus_per_node=16)


def _seqs(model: ModelFacts, hw: Hardware, replicas: int, tp: int = 1, **settings: object) -> tuple[int | None, str]:
    base: dict[str, object] = {"data.train_batch_size": 128, "actor_rollout_ref.rollout.n": 5,
                               "data.max_prompt_length": 512, "data.max_response_length": 1024,
                               "actor_rollout_ref.rollout.gpu_memory_utilization": 0.8}
    return scaling.rollout_max_num_seqs({**base, **settings}, model, hw, replicas=replicas, tp=tp)


def test_vllm_takes_a_replicas_share_of_the_step_in_one_wave_as_far_as_its_kv_cache_holds_it() -> None:
    # The 0.5B GRPO profile on one H200: 640 sequences in two waves of 320 instead of three at verl's 256 (the
    # KV cache would hold all 640, but a decode batch over 512 runs without vLLM's CUDA graphs).
    value, why = _seqs(QWEN_05B, H200, replicas=1)
    assert value == 320 and "in 2 wave(s) instead of 3 at verl's 256" in why and "12 KiB per token, 2 KV heads" in why
    # 400 sequences fit one wave under 512.
    assert _seqs(QWEN_05B, H200, replicas=1, **{"data.train_batch_size": 80})[0] == 400
    # K and V in bf16: 2 x 2 bytes x 24 layers x 64 head dims x 2 KV heads.
    assert scaling.kv_bytes_per_token(QWEN_05B, 1) == 12288
    # Eight replicas share the step: 80 each, verl's default holds them, nothing is set.
    assert _seqs(QWEN_05B, H200, replicas=8) == (
        None, "80 sequences per replica per step (data.train_batch_size x rollout.n / 8 replica(s) of tp 1) fit "
              "verl's default 256: one wave")
    # A 7B on an 80 GB GPU: the KV cache holds fewer than the step's share, which bounds it (two waves).
    qwen7 = ModelFacts(params_b=7.6, hidden_size=3584, num_layers=28, num_attention_heads=28, num_key_value_heads=4)
    value, why = _seqs(qwen7, H100, replicas=1)
    assert value is not None and 256 < value < 640 and "in 2 wave(s) instead of 3" in why
    # A KV cache of 278 sequences: three waves, as at verl's 256, which stays.
    small = Hardware(gpu_memory_gb=30, cpus_per_node=8)
    value7, why7 = _seqs(ModelFacts(0.49, 896, 24, 14, num_key_value_heads=7), small, replicas=1)
    assert value7 is None and "holds 278 of" in why7 and "3 wave(s) either way" in why7
    # Without num_key_value_heads the KV heads are taken to be the attention heads (7x more here): a smaller bound.
    assert (_seqs(QWEN_7B, H100, replicas=1)[0] or 256) < value
    # Where the KV cache holds no more than 256, verl's default stays; other engines are not vLLM's.
    assert _seqs(QWEN_7B, L4, replicas=1)[0] is None
    assert _seqs(QWEN_05B, H200, replicas=1, **{"actor_rollout_ref.rollout.name": "sglang"})[0] is None


def test_the_profiles_get_max_num_seqs_and_an_explicit_value_wins() -> None:
    def spec(**overrides: object) -> RunSpec:
        return build_run_spec({"model_source": "/m"}, run_name="t/seqs", model_profile="qwen2.5-0.5b-grpo",
                              cluster_profile="local-gpu", overrides=overrides)

    derived = spec()
    assert derived.verl[scaling.MAX_NUM_SEQS_KEY] == 320  # 1 node x 1 GPU, tp 1
    assert "in 2 wave(s) instead of 3" in derived.derived[scaling.MAX_NUM_SEQS_KEY]
    kept = spec(**{scaling.MAX_NUM_SEQS_KEY: 256})
    assert kept.verl[scaling.MAX_NUM_SEQS_KEY] == 256
    assert "[explicit value kept]" in kept.derived[scaling.MAX_NUM_SEQS_KEY]
