"""The fast-path decision case by case, and the dynamic-batch token budgets (pure functions)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer.nodes.probed import h200, probe_node
from verl_pipeline.spec import ModelFacts
from verl_pipeline.trainer.nodes import fastpath
from verl_pipeline.trainer.nodes.attention import ACTOR_ATTN_KEY, ACTOR_ATTN_OVERRIDE
from verl_pipeline.trainer.nodes.choices import Choices
from verl_pipeline.trainer.nodes.facts import NodeFacts
from verl_pipeline.trainer.nodes.fastpath import (
    ACTOR_TOKENS_KEY,
    CRITIC_FORWARD_TOKENS_KEY,
    CRITIC_TOKENS_KEY,
    DYNAMIC_BSZ_KEY,
    FUSED_KERNELS_KEY,
    REF_LOG_PROB_TOKENS_KEY,
    ROLLOUT_LOG_PROB_TOKENS_KEY,
    SUM_PI_SQUARED_KEY,
    AttentionPath,
    BudgetInputs,
    budget_inputs,
    bytes_per_token,
    decide_fast_path,
    token_budget,
)

QWEN_05B = ModelFacts(params_b=0.49, hidden_size=896, num_layers=24, num_attention_heads=14, vocab_size=151936)
#: The settings of the 0.5B GRPO profile on one H200 as far as the budgets read them.
GRPO = {"algorithm.adv_estimator": "grpo", "actor_rollout_ref.actor.use_kl_loss": True,
        "data.max_prompt_length": 512, "data.max_response_length": 1024, "data.train_batch_size": 128,
        "actor_rollout_ref.actor.ppo_mini_batch_size": 64, "actor_rollout_ref.rollout.n": 5,
        "trainer.nnodes": 1, "trainer.n_gpus_per_node": 1}
PPO = {**{k: v for k, v in GRPO.items() if k != "actor_rollout_ref.actor.use_kl_loss"},
       "algorithm.adv_estimator": "gae", "actor_rollout_ref.rollout.n": 1, "data.max_response_length": 512}


def _decide(settings: dict[str, Any], nodes: NodeFacts, model: ModelFacts | None = QWEN_05B,
            memory: float = 139.8) -> tuple[AttentionPath, Choices]:
    c = Choices(settings)
    return decide_fast_path(c, nodes, model, memory), c


def test_flash_attn_on_every_gpu_node_takes_verls_fast_path() -> None:
    path, c = _decide(GRPO, h200())
    assert path is AttentionPath.FLASH
    assert c.updates[ACTOR_ATTN_OVERRIDE] == "flash_attention_2"
    assert c.updates["actor_rollout_ref.model.use_remove_padding"] is True
    assert "critic.model.use_remove_padding" not in c.updates  # GRPO has no critic
    assert c.updates[DYNAMIC_BSZ_KEY] is True
    assert c.updates["actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"] is True
    assert c.updates["actor_rollout_ref.ref.log_prob_use_dynamic_bsz"] is True  # KL loss: a reference
    budgets = {k: c.updates[k] for k in (ACTOR_TOKENS_KEY, ROLLOUT_LOG_PROB_TOKENS_KEY, REF_LOG_PROB_TOKENS_KEY)}
    assert all(v >= 2 * (512 + 1024) for v in budgets.values())
    assert budgets[ROLLOUT_LOG_PROB_TOKENS_KEY] == budgets[REF_LOG_PROB_TOKENS_KEY] > budgets[ACTOR_TOKENS_KEY]
    # The fused kernels stay verl's default beside flash-attn's cross-entropy, and the record says why.
    assert FUSED_KERNELS_KEY not in c.updates
    assert any(r.key == FUSED_KERNELS_KEY and "Triton cross-entropy" in r.rule for r in c.rules)
    why = next(r.rule for r in c.rules if r.key == ACTOR_ATTN_OVERRIDE)
    assert "flash-attn 2.8.3.post2 imports and runs on every GPU node" in why and "test-probe-1" in why


def test_a_critic_gets_packing_and_budgets_of_its_own_on_the_fast_path() -> None:
    _, c = _decide(PPO, h200(), memory=79.2)  # an H100: the actor's update is bound by memory there
    assert c.updates["critic.model.use_remove_padding"] is True and c.updates["critic.use_dynamic_bsz"] is True
    assert REF_LOG_PROB_TOKENS_KEY not in c.updates  # no KL: no reference
    # No logits: the critic's budgets are larger than the actor's, up to its share of the batch.
    assert c.updates[CRITIC_TOKENS_KEY] > c.updates[ACTOR_TOKENS_KEY]
    assert c.updates[CRITIC_TOKENS_KEY] == 64 * 1024  # the whole per-GPU mini-batch: 64 prompts x 1 x 1024
    assert c.updates[CRITIC_FORWARD_TOKENS_KEY] == 128 * 1024


@pytest.mark.parametrize(("nodes", "said"), [
    (h200(flash_attn=False), "No module named 'flash_attn'"),
    (h200(flash_attn="broken"), "imports, but does not run on the GPU: RuntimeError: CUDA error: no kernel image"),
    (NodeFacts.from_probe([probe_node(), probe_node(flash_attn=False, node_id="b" * 56, ip="10.0.0.8")],
                          source="probe job p"), "10.0.0.8"),
    (NodeFacts.from_probe([probe_node(), {**probe_node(node_id="c" * 56), "facts": None}], source="probe job p"),
     "1 GPU node(s) did not answer"),
])
def test_a_gpu_node_without_a_usable_flash_attn_keeps_sdpa_and_fused_kernels(nodes: NodeFacts, said: str) -> None:
    path, c = _decide(GRPO, nodes)
    assert path is AttentionPath.SDPA
    assert c.updates == {ACTOR_ATTN_OVERRIDE: "sdpa", FUSED_KERNELS_KEY: True}
    assert said in next(r.rule for r in c.rules if r.key == ACTOR_ATTN_OVERRIDE)


def test_without_a_gpu_node_nothing_is_decided() -> None:
    cpu = NodeFacts.from_probe([{**probe_node(), "gpus": 0.0}], source="probe job cpu")
    for nodes in (NodeFacts(), cpu):
        path, c = _decide(GRPO, nodes)
        assert path is AttentionPath.UNDECIDED and c.updates == {}
        assert [r.key for r in c.rules] == [ACTOR_ATTN_KEY] and "decided at submit" in c.rules[0].rule
    # An attention the run sets is known without a probe: sdpa gets the fused kernels.
    path, c = _decide({**GRPO, ACTOR_ATTN_OVERRIDE: "sdpa"}, NodeFacts())
    assert path is AttentionPath.SET and c.updates == {FUSED_KERNELS_KEY: True}


@pytest.mark.parametrize("spelling", [
    {ACTOR_ATTN_KEY: "sdpa"}, {ACTOR_ATTN_OVERRIDE: "sdpa"}, {"++" + ACTOR_ATTN_KEY: "sdpa"},
    {"actor_rollout_ref.model.override_config": {"attn_implementation": "sdpa"}},
    {"actor_rollout_ref.model": {"override_config": {"+attn_implementation": "sdpa"}}},
])
def test_the_users_attention_wins_in_any_spelling(spelling: dict[str, Any]) -> None:
    path, c = _decide({**GRPO, **spelling}, h200())
    assert path is AttentionPath.SET
    assert c.updates == {FUSED_KERNELS_KEY: True}  # sdpa on nodes with flash-attn: no fast path, fused kernels
    kept = next(r for r in c.rules if r.overridden)
    assert kept.value == "sdpa" and "the rule would give 'flash_attention_2'" in kept.rule


def test_the_users_fast_path_settings_win() -> None:
    _, c = _decide({**GRPO, "+" + DYNAMIC_BSZ_KEY: False}, h200())
    assert DYNAMIC_BSZ_KEY not in c.updates and ACTOR_TOKENS_KEY not in c.updates  # no budgets for no dynamic batches
    assert any(r.overridden and r.key == "+" + DYNAMIC_BSZ_KEY for r in c.rules)
    _, c = _decide({**GRPO, "actor_rollout_ref.actor": {"ppo_max_token_len_per_gpu": 4096},
                    "actor_rollout_ref.model.use_remove_padding": False}, h200())
    assert ACTOR_TOKENS_KEY not in c.updates and c.updates[DYNAMIC_BSZ_KEY] is True
    assert "actor_rollout_ref.model.use_remove_padding" not in c.updates
    kept = {r.key for r in c.rules if r.overridden}
    assert kept == {"actor_rollout_ref.actor", "actor_rollout_ref.model.use_remove_padding"}
    # The fused kernels: a user's value is kept, and verl's refusal beside calculate_sum_pi_squared is honoured.
    for key in (FUSED_KERNELS_KEY, "++" + FUSED_KERNELS_KEY):
        _, c = _decide({**GRPO, key: False}, h200(flash_attn=False))
        assert FUSED_KERNELS_KEY not in c.updates
        assert any(r.overridden and "would give True" in r.text() for r in c.rules)
    _, c = _decide({**GRPO, SUM_PI_SQUARED_KEY: True}, h200(flash_attn=False))
    assert FUSED_KERNELS_KEY not in c.updates


def test_token_budgets_are_at_least_twice_a_sequence_and_at_most_the_gpus_share() -> None:
    inputs = BudgetInputs(prompt=256, response=128, mini_samples_per_gpu=8, batch_samples_per_gpu=16,
                          gpu_memory_gb=139.8, resident_gb=0.0,
                          model=ModelFacts(0.0004, 128, 2, 2, vocab_size=843))
    per_token = bytes_per_token(inputs.model, logits=fastpath.LOGIT_BYTES_UPDATE, update=True)
    assert per_token == 4 * 843 + (2 * 2 + 34) * 128
    value, why = token_budget(inputs, samples_per_gpu=8, per_token=per_token)
    assert value == 8 * 384 and "the per-GPU share bounds it" in why  # the tiny model: its whole mini-batch
    value, _ = token_budget(inputs, samples_per_gpu=1, per_token=per_token)
    assert value == 2 * 384  # a GPU's share below two sequences: verl's floor
    # Without the vocabulary the logits cannot be sized: the floor, and the record says what to set.
    value, why = token_budget(inputs, samples_per_gpu=8, per_token=None)
    assert value == 768 and "model.vocab_size" in why


def test_token_budgets_follow_the_gpus_memory() -> None:
    big = budget_inputs(GRPO, QWEN_05B, 139.8)
    assert big.mini_samples_per_gpu == 320 and big.batch_samples_per_gpu == 640 and big.sequence == 1536
    assert 8 < big.resident_gb < 9  # 0.49B x 16 B + the bf16 reference, on one GPU
    update = bytes_per_token(QWEN_05B, logits=fastpath.LOGIT_BYTES_UPDATE, update=True)
    on_h200, why = token_budget(big, samples_per_gpu=320, per_token=update)
    on_l4, _ = token_budget(budget_inputs(GRPO, QWEN_05B, 24.0), samples_per_gpu=320, per_token=update)
    assert on_h200 % fastpath.BUDGET_STEP == 0 and "memory bounds it" in why
    assert 3072 <= on_l4 < on_h200 < 320 * 1536
    # Offloaded training state frees the GPU for activations; so does a smaller vocabulary.
    offloaded = budget_inputs({**GRPO, "actor_rollout_ref.actor.fsdp_config.param_offload": True}, QWEN_05B, 139.8)
    assert offloaded.resident_gb == 0.0
    assert token_budget(offloaded, samples_per_gpu=320, per_token=update)[0] >= on_h200
    # Without gradient checkpointing every layer's activations are kept: fewer tokens fit.
    assert bytes_per_token(QWEN_05B, logits=0, update=True, checkpointing=False) > \
        bytes_per_token(QWEN_05B, logits=0, update=True)


def test_the_05b_budgets_on_an_h100_are_the_ones_its_gpu_run_measured() -> None:
    # One H100 (79.2 GB as probed): the budgets the 0.5B GRPO job ran with on 2026-12-05, peaking at 22.47 GiB
    # allocated; 12 and 8 bytes per vocabulary entry had given 17,408 and 26,624 (13.49 GiB).
    _, c = _decide(GRPO, h200(), memory=79.2)
    assert c.updates[ACTOR_TOKENS_KEY] == 49152
    assert c.updates[ROLLOUT_LOG_PROB_TOKENS_KEY] == c.updates[REF_LOG_PROB_TOKENS_KEY] == 52224
    # 4 bytes per entry against the 2 measured for the update: its budget's logits, at the measured rate,
    # take at most half the memory the rule gave the activations.
    inputs = budget_inputs(GRPO, QWEN_05B, 79.2)
    measured = c.updates[ACTOR_TOKENS_KEY] * 2 * 151936 / 2**30
    assert measured <= inputs.activation_gb / 2


@pytest.mark.parametrize("spelling", [{"actor_rollout_ref.actor.entropy_coeff": 0.01},
                                      {"actor_rollout_ref.actor": {"entropy_coeff": "1e-3"}}])
def test_an_entropy_bonus_sizes_the_updates_temporaries_too(spelling: dict[str, Any]) -> None:
    _, plain = _decide(GRPO, h200(), memory=79.2)
    _, bonus = _decide({**GRPO, **spelling}, h200(), memory=79.2)
    assert bonus.updates[ACTOR_TOKENS_KEY] < plain.updates[ACTOR_TOKENS_KEY]
    assert bonus.updates[ROLLOUT_LOG_PROB_TOKENS_KEY] == plain.updates[ROLLOUT_LOG_PROB_TOKENS_KEY]
    said = next(r.text() for r in bonus.rules if r.key == ACTOR_TOKENS_KEY)
    assert "entropy_coeff is not 0" in said
    # A zero bonus, however written, is none.
    _, zero = _decide({**GRPO, "actor_rollout_ref.actor.entropy_coeff": "0.0"}, h200(), memory=79.2)
    assert zero.updates[ACTOR_TOKENS_KEY] == plain.updates[ACTOR_TOKENS_KEY]
