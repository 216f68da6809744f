"""The model's size facts: its profile's, checked against and completed from the model's own ``config.json``.

The scaling rules size parallelism, offload, the KV cache and a LoRA adapter from a few facts of the
actor's model (:class:`~verl_pipeline.spec.ModelFacts`). A model profile gives them; where the model itself
is on this machine its ``config.json`` is read too:

- at provision (:func:`facts_for`), for a local directory and the built-in model: a fact the profile gives
  that the config contradicts is refused in one line naming both values; a fact the profile leaves out is
  taken from the config (``params_b`` is then estimated from the config's whole shape);
- after the prefetch, for any model (:func:`check_prefetched`): a contradiction is refused the same way,
  before the job is submitted; a fact the frozen spec lacks is said in one line each (the rules assumed a
  value; the model profile should give it).

Reads one JSON file; no heavy imports.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.spec import ModelFacts

#: Each fact the rules read, and the config.json key that holds it (transformers' names).
CONFIG_KEYS = {
    "hidden_size": "hidden_size",
    "num_layers": "num_hidden_layers",
    "num_attention_heads": "num_attention_heads",
    "num_key_value_heads": "num_key_value_heads",
    "vocab_size": "vocab_size",
    "intermediate_size": "intermediate_size",
}
#: What the rules assume for a fact neither the profile nor a config gives.
_ASSUMED = {
    "num_key_value_heads": "as many as the attention heads",
    "vocab_size": "the token budgets stay at verl's floor",
    "intermediate_size": "4 x hidden_size",
}


def read_config(model_dir: str | Path) -> tuple[dict[str, Any], str] | None:
    """The model's ``config.json`` (a multimodal model's ``text_config``: the language model's) and its path;
    None when the directory or the file is not on this machine."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(str(path), None, f"the model's config.json cannot be read: {e}",
                          "a model directory whose config.json is valid JSON") from None
    if not isinstance(config, dict):
        raise ConfigError(str(path), type(config).__name__, "the model's config.json is not a JSON object",
                          "a model directory whose config.json is valid JSON")
    text = config.get("text_config")
    if "hidden_size" not in config and isinstance(text, dict):
        config = text
    return config, str(path)


def config_facts(config: dict[str, Any]) -> dict[str, int]:
    """The facts a config gives (positive integers only), by the names :class:`ModelFacts` uses."""
    out = {}
    for name, key in CONFIG_KEYS.items():
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = value
    return out


def estimate_params_b_from_config(config: dict[str, Any]) -> float | None:
    """A dense decoder's parameters from its config, in billions: embeddings (twice when the output layer is not
    tied to them) plus each layer's attention (q and o: h x h; k and v: h x the KV width) and gated MLP (three
    h x intermediate matrices). None when the config lacks the shape."""
    f = config_facts(config)
    if not {"hidden_size", "num_layers", "num_attention_heads", "vocab_size"} <= set(f):
        return None
    h, layers = f["hidden_size"], f["num_layers"]
    kv_width = h * f.get("num_key_value_heads", f["num_attention_heads"]) // f["num_attention_heads"]
    mlp = f.get("intermediate_size", 4 * h)
    tied = bool(config.get("tie_word_embeddings", False))
    per_layer = 2 * h * h + 2 * h * kv_width + 3 * h * mlp
    return (f["vocab_size"] * h * (1 if tied else 2) + layers * per_layer) / 1e9


def _contradiction(profile: str, name: str, given: Any, value: int, where: str) -> ConfigError:
    return ConfigError(f"models/{profile}.model.{name}", given,
                       f"contradicts the model's own {where}: {CONFIG_KEYS[name]}={value}",
                       f"{name}: {value} in the model profile (or leave it out: it is then taken from config.json), "
                       "or the model this profile describes")


def _given(section: dict[str, Any], name: str) -> int | None:
    raw = section.get(name)
    try:
        return None if raw is None or isinstance(raw, bool) else int(raw)
    except (TypeError, ValueError):
        return None  # ModelFacts.from_profile names a value that is not a number


def facts_for(section: dict[str, Any], profile: str, config: tuple[dict[str, Any], str] | None) -> ModelFacts:
    """The model profile's facts (``section``: its ``model:`` section) with the model's own config (``config``:
    what :func:`read_config` returned, None when the model is not on this machine): a contradiction refused,
    a fact left out taken from the config."""
    if config is None:
        return ModelFacts.from_profile(section, profile)
    cfg, where = config
    merged = dict(section)
    for name, value in config_facts(cfg).items():
        given = _given(section, name)
        if section.get(name) is None:
            merged[name] = value
        elif given is not None and given != value:
            raise _contradiction(profile, name, section.get(name), value, where)
    facts = ModelFacts.from_profile(merged, profile)
    if section.get("params_b") is None:
        estimate = estimate_params_b_from_config(cfg)
        if estimate is not None:
            facts = replace(facts, params_b=estimate, estimated=True)
    return replace(facts, config_file=where)


def check_prefetched(facts: ModelFacts, config: tuple[dict[str, Any], str], *, profile: str) -> list[str]:
    """Check the run's frozen facts against the prefetched model's config: a contradiction is a ConfigError
    naming both values; returns one line for each fact the frozen facts lack that the config gives."""
    cfg, where = config
    notes = []
    for name, value in config_facts(cfg).items():
        have = getattr(facts, name)
        if have is None:
            notes.append(f"{name}: the model's {where} has {CONFIG_KEYS[name]}={value}; the scaling rules of this "
                         f"run assumed {_ASSUMED[name]} (set {name}: {value} in models/{profile}.yaml)")
        elif have != value:
            raise _contradiction(profile, name, have, value, where)
    return notes


__all__ = ["CONFIG_KEYS", "check_prefetched", "config_facts", "estimate_params_b_from_config", "facts_for",
           "read_config"]
