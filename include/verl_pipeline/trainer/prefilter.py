"""Filter once: skip verl's ``filter_overlong_prompts`` when preprocessing already did the same filter.

verl's ``RLHFDataset`` tokenizes every prompt through the chat template at each trainer start (every
attempt of a run) to drop those longer than ``data.max_prompt_length``. Preprocessing already
dropped them with the model's tokenizer and records how (``length_filter`` in the data's
``stats.json``: the tokenizer's digest and the limit). When that record matches the run — same
tokenizer files, a limit no larger than the run's, nothing that changes what verl's template renders
(template kwargs, tools, another prompt column, a custom chat template or dataset class) — verl would drop nothing,
so the pipeline renders ``data.filter_overlong_prompts=false``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError

FILTER_KEY = "data.filter_overlong_prompts"
#: verl settings that change the text verl's filter measures, so a preprocessing record cannot stand in.
#: Tools: verl's filter renders the tool schemas into every prompt; ``data.tool_config_path`` and
#: ``data.function_tool_path`` default to the rollout's ``multi_turn`` keys (verl 0.9.1,
#: ``trainer/config/data/legacy_data.yaml``), which is where a tool-calling run sets them. A custom
#: dataset class (``data.custom_cls.path``) may filter otherwise.
TEMPLATE_KEYS = ("data.apply_chat_template_kwargs", "data.tool_config_path", "data.function_tool_path",
                 "actor_rollout_ref.rollout.multi_turn.tool_config_path",
                 "actor_rollout_ref.rollout.multi_turn.function_tool_path", "data.custom_cls.path",
                 "actor_rollout_ref.model.custom_chat_template")


def filter_already_done(length_filter: Any, settings: dict[str, Any], tokenizer_digest: str | None) -> str | None:
    """Why verl's filter would drop nothing (the rule to show), or None when verl must run it."""
    if not settings.get(FILTER_KEY, True):
        return None  # off already
    if not isinstance(length_filter, dict) or not length_filter.get("tokenizer_digest") or not tokenizer_digest:
        return None
    if length_filter["tokenizer_digest"] != tokenizer_digest:
        return None
    limit = settings.get("data.max_prompt_length")
    done = length_filter.get("max_prompt_length")
    if limit is None or done is None or int(done) > int(limit):
        return None
    if str(settings.get("data.prompt_key", "prompt")) != "prompt" or any(settings.get(k) for k in TEMPLATE_KEYS):
        return None
    return (f"false — preprocessing already dropped prompts over {done} tokens with this model's tokenizer "
            f"({tokenizer_digest}); verl would re-tokenize the whole dataset at every trainer start to drop none")


#: The files that decide token counts: preprocessing's length filter is valid for the same digest of them.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                    "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model")


def tokenizer_digest(path: str) -> str:
    """A hash of the files that decide token counts (vocabulary, merges, chat template, config)."""
    h = hashlib.sha256()
    root = Path(path)
    found = False
    for name in _TOKENIZER_FILES:
        f = root / name
        if f.is_file():
            found = True
            h.update(name.encode() + b"\0" + f.read_bytes())
    if not found:
        raise ConfigError("data.tokenizer", path, "has no tokenizer files", "a model directory with tokenizer.json")
    return h.hexdigest()[:16]


def model_tokenizer_digest(model_path: str) -> str | None:
    """The digest of the tokenizer files in ``model_path``; None when it is not a readable directory here."""
    try:
        return tokenizer_digest(model_path)
    except (ConfigError, OSError):
        return None


__all__ = ["FILTER_KEY", "filter_already_done", "model_tokenizer_digest", "tokenizer_digest"]
