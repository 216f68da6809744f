"""Which attention the actor (and reference) model runs in verl, and which need flash-attn.

A fact both the scaling rules (fused log-prob kernels where flash-attn is absent) and the environment
checks (which packages the nodes need) read; pure, no imports beyond the standard library.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: verl's default attention implementation for the actor, reference and rollout model config
#: (``verl/workers/config/model.py``: ``override_config.get("attn_implementation", "flash_attention_2")``).
VERL_DEFAULT_ATTN = "flash_attention_2"
#: The attention implementations that need flash-attn (and so bring its cross-entropy kernel, which verl
#: uses for log-probs): attn_implementation -> (module transformers looks for, pip distribution).
FLASH_IMPLS = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}
ACTOR_ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"


def actor_attn_implementation(settings: Mapping[str, Any]) -> str:
    """The actor's (and reference's) attention implementation: the override, else verl's default."""
    for prefix in ("", "+", "++"):
        value = settings.get(prefix + ACTOR_ATTN_KEY)
        if value:
            return str(value)
    block = settings.get("actor_rollout_ref.model.override_config")
    if isinstance(block, Mapping) and block.get("attn_implementation"):
        return str(block["attn_implementation"])
    return VERL_DEFAULT_ATTN


__all__ = ["ACTOR_ATTN_KEY", "FLASH_IMPLS", "VERL_DEFAULT_ATTN", "actor_attn_implementation"]
