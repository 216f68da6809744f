"""Which attention the actor (and reference) model runs in verl, and which need flash-attn.

A fact the fast-path decision (:mod:`verl_pipeline.trainer.nodes.fastpath`: flash-attn where every GPU node
has it, SDPA and fused log-prob kernels where not) and the environment checks (which packages the
nodes need) both read; pure, no imports beyond the standard library and the override reader.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from verl_pipeline.trainer.overrides import spelled

#: verl's default attention implementation for the actor, reference and rollout model config
#: (``verl/workers/config/model.py``: ``override_config.get("attn_implementation", "flash_attention_2")``).
VERL_DEFAULT_ATTN = "flash_attention_2"
#: PyTorch's own attention: what the actor runs where flash-attn is missing.
SDPA = "sdpa"
#: The attention implementations that need flash-attn (and so bring its cross-entropy kernel, which verl
#: uses for log-probs): attn_implementation -> (module transformers looks for, pip distribution).
FLASH_IMPLS = {
    "flash_attention_2": ("flash_attn", "flash-attn"),
    "flash_attention_3": ("flash_attn_interface", "flash-attn-3"),
}
ACTOR_ATTN_KEY = "actor_rollout_ref.model.override_config.attn_implementation"
#: How the pipeline writes the key: verl's ``override_config`` is an empty mapping, so Hydra needs ``+``.
ACTOR_ATTN_OVERRIDE = "+" + ACTOR_ATTN_KEY
#: The override that lets the actor run without flash-attn (what an error or a form tells the user to set).
SDPA_OVERRIDE = f"{ACTOR_ATTN_OVERRIDE}={SDPA}"


def explicit_attn_implementation(settings: Mapping[str, Any]) -> str | None:
    """The actor's attention as the run's settings set it (any spelling), None when they leave it to verl."""
    found = spelled(settings, ACTOR_ATTN_KEY)
    return str(found.value) if found is not None and found.value else None


def actor_attn_implementation(settings: Mapping[str, Any]) -> str:
    """The actor's (and reference's) attention implementation: the settings', else verl's default."""
    return explicit_attn_implementation(settings) or VERL_DEFAULT_ATTN


__all__ = ["ACTOR_ATTN_KEY", "ACTOR_ATTN_OVERRIDE", "FLASH_IMPLS", "SDPA", "SDPA_OVERRIDE", "VERL_DEFAULT_ATTN",
           "actor_attn_implementation", "explicit_attn_implementation"]
