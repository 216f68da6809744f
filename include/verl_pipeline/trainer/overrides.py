"""The one place that turns settings into verl Hydra overrides and a shell-safe entrypoint."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from verl_pipeline.exceptions import ConfigError

_KEY = re.compile(r"^\+{0,2}[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
# Values Hydra's override grammar reads as a plain (unquoted) primitive, unchanged.
_PLAIN = re.compile(r"^[A-Za-z0-9_./\-+@:]+$")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


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
    """``{"a": {"b": 1}}`` → ``{"a.b": 1}``. Lists and scalars are leaves.

    A Hydra append may be written at any level of a profile's ``verl:`` section:
    ``{"a": {"+b": 1}}`` and ``{"+a": {"b": 1}}`` both give ``{"+a.b": 1}``."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        full = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, full))
        else:
            out[_hoist_append(full)] = value
    return out


@dataclass(frozen=True)
class Spelled:
    """Where a run's settings set one verl key: the key as written there, and the value."""

    #: ``a.b.c``, ``+a.b.c``, ``++a.b.c``, or the section that holds it (``a.b``, given as one value).
    spelling: str
    value: Any


#: How Hydra lets an override be written: the bare key, ``+key`` (append) and ``++key`` (append or set).
SPELLINGS = ("", "+", "++")


def spelled(settings: Mapping[str, Any], key: str) -> Spelled | None:
    """The value ``settings`` gives the dotted ``key`` however the user wrote it — bare, ``+key``,
    ``++key``, or inside a whole section given as one value (``{"a.b": {"c": 1}}`` or
    ``{"+a": {"b": {"+c": 1}}}`` for ``a.b.c``) — or None when it is not set. The one reading of
    "did the user set this key", for every rule that keeps the user's value."""
    parts = key.split(".")
    for depth in range(len(parts), 0, -1):
        head, rest = ".".join(parts[:depth]), parts[depth:]
        for plus in SPELLINGS:
            if plus + head not in settings:
                continue
            found, value = True, settings[plus + head]
            for part in rest:
                inner = value if isinstance(value, Mapping) else {}
                name = next((k for k in inner if str(k).lstrip("+") == part), None)
                if name is None:
                    found = False
                    break
                value = inner[name]
            if found:
                return Spelled(plus + head, value)
    return None


def spellings(key: str) -> tuple[str, ...]:
    """The ways a plain key may be written among a run's settings (:data:`SPELLINGS`): as is, as Hydra's
    append (``+key``) and as its add-or-override (``++key``)."""
    return tuple(plus + key for plus in SPELLINGS)


def _hoist_append(key: str) -> str:
    parts = key.split(".")
    plus = max((len(p) - len(p.lstrip("+")) for p in parts), default=0)
    return "+" * plus + ".".join(p.lstrip("+") for p in parts) if plus else key


def parse_overrides(items: Iterable[str], *, field: str = "--set") -> dict[str, Any]:
    """``["a.b=8", "+c.d=[x,y]"]`` → ``{"a.b": 8, "+c.d": ["x", "y"]}``: values read as YAML
    scalars/lists, as Hydra reads them. The CLI's ``--set`` and the DAG's ``verl_overrides`` param.

    A whole section given as one override (``trainer={logger:[wandb]}``) is read key by key
    (``{"trainer.logger": ["wandb"]}``), as Hydra merges it into verl's section: each key then meets the
    same key of the profiles and the pipeline, and the user's wins over theirs, as for ``trainer.logger=``.
    Later items win over earlier ones, key by key."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        if not isinstance(item, str):
            raise ConfigError(field, item, "each override must be a string KEY=VALUE",
                              '"actor_rollout_ref.rollout.n=4"')
        if not item.strip():
            continue  # a blank line, e.g. the form's trailing newline
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(field, item, "must be KEY=VALUE (or +KEY=VALUE to append a key)",
                              "actor_rollout_ref.rollout.n=4")
        if not _KEY.match(key):
            raise ConfigError(field, item, f"{key!r} is not a verl config key (dotted identifiers, + to append)",
                              "actor_rollout_ref.actor.optim.lr=1e-6")
        if raw.lstrip().startswith("{"):
            value = _hydra_mapping(key, raw, field=field, item=item)
        else:
            try:
                value = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                value = raw
            # YAML 1.1 reads 1e-6 as a string; Hydra (and so verl) reads it as a float.
            value = float(value) if isinstance(value, str) and _FLOAT.fullmatch(value.strip()) else value
        for flat, leaf in flatten({key: value}).items():
            if not _KEY.match(flat):
                raise ConfigError(field, item, f"{flat!r} is not a verl config key (dotted identifiers)",
                                  "trainer={logger:[console,wandb],val_before_train:false}")
            out[flat] = leaf
    return out


def _hydra_mapping(key: str, raw: str, *, field: str, item: str) -> Any:
    """A ``{k:v,...}`` value read by Hydra's own grammar, as verl will read it (YAML would take ``{a:b}``
    for a key ``"a:b"`` without a value)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    try:
        return OverridesParser.create().parse_override(f"{key.lstrip('+')}={raw}").value()
    except HydraException as e:
        raise ConfigError(field, item, f"Hydra cannot read the value: {e}",
                          "trainer={logger:[console,wandb],val_before_train:false}") from None


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
