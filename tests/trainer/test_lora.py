"""A LoRA run is sized for its adapter: gradients and Adam for the adapter only, the base frozen, no reference copy."""

from __future__ import annotations

from pathlib import Path

from verl_pipeline.profiles import build_run_spec
from verl_pipeline.spec import ModelFacts
from verl_pipeline.trainer.lora import DECODER_LINEARS, adapter
from verl_pipeline.trainer.modelfacts import facts_for, read_config
from verl_pipeline.trainer.scaling import train_state_gb

OFFLOAD = "actor_rollout_ref.actor.fsdp_config.param_offload"
RANK = "actor_rollout_ref.model.lora_rank"


def test_the_adapter_is_as_large_as_peft_makes_it(tiny_model_path: Path) -> None:
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    facts = facts_for({}, "tiny", read_config(tiny_model_path))
    for targets in ("all-linear", ["q_proj", "v_proj"]):
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16),
                               LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, target_modules=targets))
        trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
        sized = adapter({RANK: 8, "actor_rollout_ref.model.target_modules": targets}, facts)
        assert sized is not None and round(sized.params_b * 1e9) == trained, targets
    everything = adapter({RANK: 8}, facts)  # verl's default target_modules: all-linear
    assert everything is not None and everything.modules == DECODER_LINEARS and everything.assumed == ""
    assert adapter({RANK: 0}, facts) is None and adapter({}, facts) is None


def test_excluded_and_unknown_modules() -> None:
    facts = ModelFacts(params_b=7.6, hidden_size=3584, num_layers=28, num_attention_heads=28)
    some = adapter({RANK: 16, "actor_rollout_ref.model.exclude_modules": ["down_proj", "up_proj", "gate_proj"]},
                   facts)
    assert some is not None and some.modules == ("q_proj", "k_proj", "v_proj", "o_proj")
    assumed = adapter({RANK: 16}, facts)
    assert assumed is not None and "intermediate_size 14336 assumed" in assumed.assumed
    other = adapter({RANK: 16, "actor_rollout_ref.model.target_modules": ["c_attn"]}, facts)
    assert other is not None and other.modules == DECODER_LINEARS and "c_attn counted as every decoder linear" in \
        other.assumed


def test_a_32b_lora_run_is_not_offloaded_where_its_full_fine_tune_is() -> None:
    params = {"model_profile": "qwen2.5-32b-grpo", "cluster_profile": "h100-ib", "nnodes": 1}
    full = build_run_spec(params, run_name="lora/full")
    lora = build_run_spec(params, run_name="lora/r8", overrides={RANK: 8})
    assert full.verl[OFFLOAD] is True and lora.verl[OFFLOAD] is False
    rule = lora.derived[OFFLOAD]
    assert "actor: 32.8B frozen x 4 B (fp32 weights, no gradients or Adam) + LoRA rank 8 on q_proj" in rule
    assert "x 16 B/param; the reference is the actor without its adapter (no copy) / 8 GPU(s)) <= 35% of 80 GB" in rule
    # 32.8B x 4 B / 8 GPUs = 16.4 GB and the adapter's state: a fifth of the full fine-tune's with its reference.
    facts = full.model_facts
    assert facts is not None
    sized = adapter({RANK: 8}, facts)
    assert sized is not None and 0.03 < sized.params_b < 0.2
    assert abs(train_state_gb(facts, 8, critic=False, ref=True, actor_lora=sized) - (32.8 * 4 + sized.params_b * 16)
               / 8) < 1e-9
    assert train_state_gb(facts, 8, critic=False, ref=True) == (32.8 * 16 + 32.8 * 2) / 8


def test_a_lora_actor_beside_a_fully_trained_critic() -> None:
    spec = build_run_spec({"model_profile": "qwen2.5-7b-ppo", "cluster_profile": "h100-ib", "nnodes": 1},
                          run_name="lora/ppo", overrides={RANK: 32})
    rule = spec.derived[OFFLOAD]
    assert "actor: 7.6B frozen x 4 B" in rule and "; critic: 7.6B x 16 B/param" in rule
    both = build_run_spec({"model_profile": "qwen2.5-7b-ppo", "cluster_profile": "h100-ib", "nnodes": 1},
                          run_name="lora/ppo-both", overrides={RANK: 32, "critic.model.lora_rank": 32})
    assert "; critic: 7.6B frozen x 4 B" in both.derived[OFFLOAD]
