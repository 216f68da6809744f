"""A LoRA run's trained adapter merged into the weights verl's merger wrote beside it.

verl 0.9.1's merger (``model_merger/base_model_merger.py``, ``save_lora_adapter``) splits a LoRA actor's state
dict: the ``lora_A``/``lora_B`` tensors go to ``<target>/lora_adapter/`` (``adapter_model.safetensors``, keys
``base_model.model.<module>.lora_{A,B}.weight``, and a PEFT ``adapter_config.json`` with ``r`` and
``lora_alpha`` from the checkpoint's ``lora_train_meta.json``), the frozen base weights to the top level. A model
published from the top level alone would be the base model.

:func:`merge_lora_adapter` adds each adapter into its base weight the way PEFT's ``merge_and_unload`` does
(``W += (B @ A) x lora_alpha / r``, in fp32 and rounded once to the weight's dtype, as PEFT does with the
adapter in fp32, its default on loading; ``alpha / sqrt(r)`` with rsLoRA), one shard in memory at a time, keeps
``lora_adapter/`` beside the merged weights, and refuses an adapter that changes no weight (every ``lora_B``
zero, or ``lora_alpha`` 0): its export would be the base model. What PEFT's merge would do differently (DoRA,
per-module rank or alpha patterns, embedding or bias adapters) is refused, naming what.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError

#: Where verl's merger writes the trained adapter, inside the merged model's directory.
ADAPTER_DIR = "lora_adapter"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: An adapter tensor's key: the adapted module (as the base model names it) and the matrix.
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<matrix>[AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoraMerge:
    """What merging the adapter did (the export manifest's ``files.lora``)."""

    rank: int
    alpha: float
    scaling: float
    #: Base weights the adapter adapts, and how many of them the merge changed.
    adapted: int
    changed: int
    #: The largest change of one element (the merged weight's dtype).
    max_abs_change: float
    target_modules: list[str]
    #: The adapter, kept beside the merged weights (relative to the model directory).
    adapter: str = ADAPTER_DIR

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _adapter_config(adapter_dir: Path) -> dict[str, Any]:
    path = adapter_dir / ADAPTER_CONFIG
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ModelError(f"{path}: cannot read the LoRA adapter's config ({e})") from None
    if not isinstance(config, dict):
        raise ModelError(f"{path}: not a JSON object")
    unsupported = [name for name, value in (("use_dora", config.get("use_dora")),
                                            ("rank_pattern", config.get("rank_pattern")),
                                            ("alpha_pattern", config.get("alpha_pattern"))) if value]
    if str(config.get("peft_type", "LORA")).upper() != "LORA" or unsupported:
        raise ModelError(f"{path}: a {config.get('peft_type')} adapter with {', '.join(unsupported) or 'its type'} is "
                         "not merged here (plain LoRA only): publish the base model with the adapter instead "
                         "(export: false, and load both with PEFT)")
    return config


def scaling_of(config: dict[str, Any], where: Path) -> tuple[int, float, float]:
    """``(r, lora_alpha, scaling)`` of an adapter config; ModelError when the adapter would change nothing."""
    try:
        rank, alpha = int(config["r"]), float(config["lora_alpha"])
    except (KeyError, TypeError, ValueError):
        raise ModelError(f"{where}: the adapter config lacks a numeric r and lora_alpha") from None
    if rank <= 0:
        raise ModelError(f"{where}: r={rank}: a LoRA adapter's rank is positive")
    if alpha == 0:
        raise ModelError(f"{where}: lora_alpha=0 scales the adapter to nothing, so the merged model would be the "
                         "base (verl's merger writes 0 when the checkpoint has no lora_train_meta.json): set "
                         "lora_alpha in the adapter config to the run's actor_rollout_ref.model.lora_alpha and export "
                         "again")
    return rank, alpha, alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def _pairs(adapter_dir: Path) -> dict[str, dict[str, Any]]:
    """The adapter's (A, B) tensors by the base weight they adapt (``<module>.weight``)."""
    from safetensors.torch import load_file

    path = adapter_dir / ADAPTER_WEIGHTS
    if not path.is_file():
        raise ModelError(f"{adapter_dir} has no {ADAPTER_WEIGHTS}: not an adapter verl's merger wrote")
    pairs: dict[str, dict[str, Any]] = {}
    for key, tensor in load_file(str(path)).items():
        m = _KEY.match(key)
        if m is None:
            raise ModelError(f"{path}: tensor {key!r} is not a lora_A/lora_B weight of a linear layer (embedding, "
                             "bias or DoRA adapters are not merged here)")
        pairs.setdefault(f"{m['module']}.weight", {})[m["matrix"]] = tensor
    incomplete = sorted(k for k, v in pairs.items() if set(v) != {"A", "B"})
    if incomplete:
        raise ModelError(f"{path}: {incomplete[0]} has only lora_{''.join(pairs[incomplete[0]])} (A and B needed)")
    if not pairs:
        raise ModelError(f"{path}: the adapter has no tensors")
    return pairs


def merge_lora_adapter(model_dir: Path) -> LoraMerge | None:
    """Merge ``model_dir/lora_adapter`` into ``model_dir``'s safetensors in place (None: no adapter there).

    ModelError when the adapter names a weight the model lacks, is of a kind not merged here, or changes no
    weight of the model."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    adapter_dir = model_dir / ADAPTER_DIR
    if not adapter_dir.is_dir():
        return None
    config = _adapter_config(adapter_dir)
    rank, alpha, scale = scaling_of(config, adapter_dir / ADAPTER_CONFIG)
    transpose = bool(config.get("fan_in_fan_out"))
    pairs = _pairs(adapter_dir)
    left, changed, biggest = set(pairs), 0, 0.0
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            metadata = f.metadata()
            if not left & set(f.keys()):
                continue
        tensors = load_file(str(shard))
        for key in sorted(left & set(tensors)):
            weight = tensors[key]
            a, b = pairs[key]["A"].to(torch.float32), pairs[key]["B"].to(torch.float32)
            delta = (b @ a) * scale
            delta = delta.T if transpose else delta
            if delta.shape != weight.shape:
                raise ModelError(f"{adapter_dir}: the adapter of {key} makes {tuple(delta.shape)}, the weight in "
                                 f"{shard.name} is {tuple(weight.shape)}: an adapter of another model")
            merged = (weight.to(torch.float32) + delta).to(weight.dtype)  # added in fp32, rounded once
            if not torch.equal(merged, weight):
                changed += 1
                biggest = max(biggest, float((merged.float() - weight.float()).abs().max()))
            tensors[key] = merged.contiguous()
            left.discard(key)
        part = shard.with_name(f".{shard.name}.merged")
        save_file(tensors, str(part), metadata=metadata)
        os.replace(part, shard)
    if left:
        raise ModelError(f"{adapter_dir}: the adapter adapts {len(left)} weight(s) the model in {model_dir} lacks "
                         f"(e.g. {sorted(left)[0]}): an adapter of another model")
    if changed == 0:
        raise ModelError(f"{adapter_dir}: the LoRA adapter changes no weight of the model (every lora_B is zero: "
                         "an adapter that never trained), so the export would be the base model")
    targets = config.get("target_modules") or []
    return LoraMerge(rank=rank, alpha=alpha, scaling=scale, adapted=len(pairs), changed=changed,
                     max_abs_change=biggest,
                     target_modules=sorted([targets] if isinstance(targets, str) else targets))


__all__ = ["ADAPTER_CONFIG", "ADAPTER_DIR", "ADAPTER_WEIGHTS", "LoraMerge", "merge_lora_adapter", "scaling_of"]
