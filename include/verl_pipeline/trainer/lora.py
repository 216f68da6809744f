"""A LoRA run's adapter: whether a model trains one, and how large it is (what the memory rules count).

verl 0.9.1's FSDP engine (``workers/engine/fsdp/transformer_impl.py``) wraps a model whose
``lora_rank`` (``actor_rollout_ref.model.lora_rank``, ``critic.model.lora_rank``) is positive with PEFT's
``get_peft_model(LoraConfig(r=lora_rank, lora_alpha=lora_alpha, target_modules=target_modules,
exclude_modules=exclude_modules))``; ``target_modules`` defaults to ``all-linear``: PEFT's every
``nn.Linear`` but the output layer, i.e. in a Qwen2/Llama decoder layer ``q_proj``, ``k_proj``, ``v_proj``,
``o_proj``, ``gate_proj``, ``up_proj`` and ``down_proj``. A targeted linear of ``in`` x ``out`` gains
``lora_A`` (rank x in) and ``lora_B`` (out x rank): ``rank x (in + out)`` trained parameters.

Only those train: gradients and Adam's moments are the adapter's, while the base weights stay frozen in fp32
(verl loads a trained model in ``fsdp_config.model_dtype`` fp32). verl's reference policy of a LoRA run is the
actor with its adapter switched off (``ref_in_actor``): no second copy of the weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_pipeline.spec import ModelFacts

ACTOR_PREFIX = "actor_rollout_ref.model"
CRITIC_PREFIX = "critic.model"
#: verl's default ``target_modules``.
ALL_LINEAR = "all-linear"
#: The linear layers of a Qwen2/Llama-style decoder layer, by the names PEFT matches.
DECODER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class Adapter:
    """A model's LoRA adapter as the memory rules count it."""

    rank: int
    #: Trained parameters, in billions.
    params_b: float
    #: The decoder linears it adapts.
    modules: tuple[str, ...]
    #: What was assumed to size it (empty: nothing).
    assumed: str = ""

    def describe(self) -> str:
        return (f"LoRA rank {self.rank} on {', '.join(self.modules)}: {self.params_b * 1e3:.3g}M adapter parameters"
                + (f" ({self.assumed})" if self.assumed else ""))


def lora_rank(settings: dict[str, Any], prefix: str = ACTOR_PREFIX) -> int:
    """The model's LoRA rank in ``settings`` (0: a full fine-tune)."""
    value = settings.get(f"{prefix}.lora_rank")
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _names(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]


def linear_shapes(model: ModelFacts) -> tuple[dict[str, tuple[int, int]], str]:
    """Each decoder linear's (in, out) features, and what was assumed for them."""
    h = model.hidden_size
    kv = h * (model.num_key_value_heads or model.num_attention_heads) // model.num_attention_heads
    mlp = model.intermediate_size or 4 * h
    assumed = [] if model.intermediate_size else [f"intermediate_size {mlp} assumed (4 x hidden_size)"]
    if model.num_key_value_heads is None:
        assumed.append("as many KV heads as attention heads assumed")
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, mlp), "up_proj": (h, mlp), "down_proj": (mlp, h)}
    return shapes, "; ".join(assumed)


def adapter(settings: dict[str, Any], model: ModelFacts, prefix: str = ACTOR_PREFIX) -> Adapter | None:
    """The adapter the model of ``prefix`` trains (None: it trains every weight)."""
    rank = lora_rank(settings, prefix)
    if rank == 0:
        return None
    targets = _names(settings.get(f"{prefix}.target_modules", ALL_LINEAR))
    excluded = set(_names(settings.get(f"{prefix}.exclude_modules")))
    shapes, assumed = linear_shapes(model)
    known = [t for t in targets if t in shapes]
    if ALL_LINEAR in targets or not known or len(known) < len(targets):
        # all-linear, or names these rules do not know (another architecture's): the upper bound, every linear.
        unknown = [t for t in targets if t != ALL_LINEAR and t not in shapes]
        if unknown:
            assumed = "; ".join(filter(None, [assumed, f"{', '.join(unknown)} counted as every decoder linear"]))
        known = list(DECODER_LINEARS)
    modules = tuple(m for m in DECODER_LINEARS if m in known and m not in excluded)
    per_layer = sum(rank * (shapes[m][0] + shapes[m][1]) for m in modules)
    return Adapter(rank, per_layer * model.num_layers / 1e9, modules, assumed)


__all__ = ["ACTOR_PREFIX", "ALL_LINEAR", "CRITIC_PREFIX", "DECODER_LINEARS", "Adapter", "adapter", "linear_shapes",
           "lora_rank"]
