"""Every model profile x nnodes x GPUs per node composes with verl's own Hydra config and passes
verl's own validation (validate_config + the actor/critic/rollout dataclass checks), in one Hydra
session so the whole matrix takes about a minute."""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

import pytest

from tests.trainer.nodes.probed import h200
from verl_pipeline import steps
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec, list_profiles
from verl_pipeline.trainer.nodes.attention import ACTOR_ATTN_OVERRIDE
from verl_pipeline.trainer.nodes.decisions import decide_for_spec
from verl_pipeline.trainer.nodes.fastpath import ACTOR_TOKENS_KEY, DYNAMIC_BSZ_KEY, FUSED_KERNELS_KEY, AttentionPath
from verl_pipeline.trainer.render import job_settings
from verl_pipeline.trainer.validate import session

NNODES = (1, 2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = (1, 2, 4, 8)
#: The matrix's target: 80 GB GPUs, 64 CPUs per node (configs/clusters/gpu-address.yaml).
CLUSTER = "gpu-address"
#: Where the model does not fit, and why (anything else that does not fit fails the test).
EXPECTED_UNFIT = {("qwen2.5-32b-grpo", 1), ("qwen2.5-32b-grpo", 2)}


@pytest.fixture(scope="module")
def hydra_session() -> Iterator[None]:
    with session():
        yield


@pytest.mark.parametrize("model_profile", list_profiles("models"))
def test_profile_composes_and_passes_verl_validation_at_every_shape(model_profile: str, hydra_session: None) -> None:
    unfit: dict[tuple[str, int], str] = {}
    failures: list[str] = []
    t0 = time.monotonic()
    for g in GPUS_PER_NODE:
        first_tbs = None
        for nnodes in NNODES:
            try:
                spec = build_run_spec({"nnodes": nnodes, "n_gpus_per_node": g}, run_name="matrix",
                                      model_profile=model_profile, cluster_profile=CLUSTER)
            except ConfigError as e:
                if "does not fit" in e.rule:
                    unfit[(model_profile, g)] = str(e)
                    break
                failures.append(f"{nnodes}x{g}: {e}")
                continue
            s = spec.verl
            gpus = nnodes * g
            n = int(s.get("actor_rollout_ref.rollout.n", 1))
            tbs = int(s["data.train_batch_size"])
            mini = int(s["actor_rollout_ref.actor.ppo_mini_batch_size"])
            micro = int(s["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"])
            tp = int(s["actor_rollout_ref.rollout.tensor_model_parallel_size"])
            first_tbs = first_tbs or tbs
            # The rules' own invariants, independent of verl.
            assert tbs == first_tbs * nnodes, f"{nnodes}x{g}: batch does not grow linearly ({tbs})"
            assert (tbs * n) % gpus == 0 and (mini * n) % gpus == 0 and tbs % mini == 0
            assert ((mini * n) // gpus) % micro == 0
            assert g % tp == 0
            assert 0.1 <= float(s["actor_rollout_ref.rollout.gpu_memory_utilization"]) <= 0.95
            try:
                out = steps.validate_spec_with_verl(spec)
            except ConfigError as e:
                failures.append(f"{nnodes}x{g}: verl rejected: {e}")
                continue
            assert out["n_gpus"] == gpus
            assert out["use_critic"] == (s.get("algorithm.adv_estimator") == "gae")
    assert not failures, "\n".join(failures)
    expected = {k for k in EXPECTED_UNFIT if k[0] == model_profile}
    assert set(unfit) == expected, f"models that do not fit: {unfit}"
    for reason in unfit.values():
        assert "n_gpus_per_node >= 4" in reason  # the rejection says what would fit
    print(f"{model_profile}: {len(NNODES) * len(GPUS_PER_NODE)} shapes in {time.monotonic() - t0:.1f}s; "
          f"skipped (does not fit): {sorted(unfit)}")


def test_large_models_get_tensor_parallelism_and_offload_where_memory_is_short() -> None:
    key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    big = build_run_spec({"nnodes": 1, "n_gpus_per_node": 8}, run_name="m", model_profile="qwen2.5-32b-grpo",
                         cluster_profile=CLUSTER)
    assert big.verl[key] >= 2
    assert big.verl["actor_rollout_ref.actor.fsdp_config.param_offload"] is True  # 32B on 8 GPUs
    wide = build_run_spec({"nnodes": 32, "n_gpus_per_node": 8}, run_name="m", model_profile="qwen2.5-32b-grpo",
                          cluster_profile=CLUSTER)
    assert wide.verl["actor_rollout_ref.actor.fsdp_config.param_offload"] is False  # sharded over 256 GPUs
    small = build_run_spec({"nnodes": 1, "n_gpus_per_node": 8}, run_name="m", model_profile="qwen2.5-0.5b-ppo",
                           cluster_profile=CLUSTER)
    assert small.verl[key] == 1
    # Same 7B model on 24 GB GPUs needs TP where 80 GB does not.
    on_l4 = build_run_spec({"nnodes": 2, "n_gpus_per_node": 4}, run_name="m", model_profile="qwen2.5-7b-grpo",
                           cluster_profile="l4-24g")
    on_h100 = build_run_spec({"nnodes": 2, "n_gpus_per_node": 4}, run_name="m", model_profile="qwen2.5-7b-grpo",
                             cluster_profile="h100-ib")
    assert on_l4.verl[key] == 2 and on_h100.verl[key] == 1
    assert on_l4.verl["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.8
    assert on_h100.verl["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.65  # 17 GB of state stays


def test_global_batch_reaches_1024_at_scale() -> None:
    for model_profile in ("qwen2.5-0.5b-ppo", "qwen2.5-7b-grpo", "qwen2.5-32b-grpo"):
        spec = build_run_spec({"nnodes": 32, "n_gpus_per_node": 8}, run_name="m", model_profile=model_profile,
                              cluster_profile=CLUSTER)
        assert spec.verl["data.train_batch_size"] >= 1024, model_profile
        assert math.log2(spec.verl["data.train_batch_size"]).is_integer()


@pytest.mark.parametrize(("model_profile", "flash_attn"), [
    ("tiny-grpo", True), ("tiny-ppo", True), ("qwen2.5-0.5b-grpo", True), ("qwen2.5-0.5b-ppo", True),
    # Without flash-attn only critic-free profiles run (the probe refuses a critic): SDPA + fused kernels.
    ("tiny-grpo", False), ("qwen2.5-0.5b-grpo", False),
])
def test_verl_accepts_the_job_as_decided_for_an_h200_with_and_without_flash_attn(
        model_profile: str, flash_attn: bool, hydra_session: None) -> None:
    spec = build_run_spec({"profile": "gpu-acceptance", "model_profile": model_profile}, run_name="decided")
    settings = job_settings(spec, train_files="/d/train.parquet", val_files="/d/val.parquet", model_path="/m")
    decision = decide_for_spec(spec, settings, h200(flash_attn=flash_attn))
    if flash_attn:
        assert decision.attention is AttentionPath.FLASH
        assert decision.settings[ACTOR_ATTN_OVERRIDE] == "flash_attention_2"
        assert decision.settings[DYNAMIC_BSZ_KEY] is True and decision.settings[ACTOR_TOKENS_KEY] >= 2 * (
            settings["data.max_prompt_length"] + settings["data.max_response_length"])
        assert FUSED_KERNELS_KEY not in decision.settings
    else:
        assert decision.attention is AttentionPath.SDPA
        assert decision.settings == {ACTOR_ATTN_OVERRIDE: "sdpa", FUSED_KERNELS_KEY: True}
    steps.validate_spec_with_verl(spec, decision=decision)  # raises ConfigError if verl refused it
