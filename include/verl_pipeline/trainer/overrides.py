"""The one place that turns settings into verl Hydra overrides and a shell-safe entrypoint."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from typing import Any

from verl_pipeline.exceptions import ConfigError

_KEY = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Values Hydra's override grammar reads as a plain (unquoted) primitive, unchanged.
_PLAIN = re.compile(r"^[A-Za-z0-9_./\-+@:]+$")


def hydra_value(value: Any) -> str:
    """Render one value in Hydra's override grammar, quoting strings that need it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ",".join(f"{k}:{hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    if _PLAIN.match(text) and text.lower() not in ("null", "true", "false") and not _looks_numeric(text):
        return text
    # Hydra keeps a backslash literal unless it precedes a quote (or ends the string): only then
    # are backslashes doubled, and the quote itself escaped.
    escaped = re.sub(r"(\\*)'", lambda m: m.group(1) * 2 + "\\'", text)
    escaped = re.sub(r"(\\+)$", lambda m: m.group(1) * 2, escaped)
    return f"'{escaped}'"


def _looks_numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``. Lists and scalars are leaves."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, full))
        else:
            out[full] = value
    return out


def render_overrides(settings: Mapping[str, Any]) -> list[str]:
    """``{"data.train_batch_size": 8, …}`` → ``["data.train_batch_size=8", …]`` (sorted, validated)."""
    out = []
    for key in sorted(settings):
        if not _KEY.match(key):
            raise ConfigError(key, settings[key], "is not a valid verl config key (dotted identifiers only)",
                              "e.g. actor_rollout_ref.rollout.n")
        out.append(f"{key}={hydra_value(settings[key])}")
    return out


def entrypoint(command: Iterable[str], overrides: Iterable[str]) -> str:
    """A shell command line (Ray runs entrypoints through a shell): every word quoted."""
    return shlex.join([*command, *overrides])
