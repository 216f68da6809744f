"""A cluster backend's profile settings, read from the backend's own dataclass fields.

Each setting is declared once, on its field: ``nodes: int = field(default=1, metadata=setting(ge=1))``.
The field holds the default, its annotation the type, and :func:`setting`'s keywords the bounds, the
choices, an example for the fix and, for a value that is not a plain scalar (a list, a mapping, a
path, a nested object), a small parser of its own. :func:`read_settings` walks ``dataclasses.fields`` of the
backend: a key the profile leaves out keeps the field's default (so does null, where the field may
be empty: optional values, lists, mappings), a key no field reads is refused naming the known ones,
and every refusal is a :class:`ConfigError` naming ``cluster.<key>``, the value and a line to copy.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from collections.abc import Callable, Collection, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

from verl_pipeline import auth
from verl_pipeline.cluster.base import COMMON_SETTINGS, ClusterBackend
from verl_pipeline.exceptions import ConfigError

B = TypeVar("B", bound=ClusterBackend)
_METADATA_KEY = "verl_pipeline.setting"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclasses.dataclass(frozen=True)
class Key:
    """The profile setting being read, as a parser sees it."""

    #: What every refusal names: ``cluster.<key>`` or ``cluster.<section>.<key>``.
    path: str
    #: The profile's name for it.
    name: str
    #: The field's default.
    default: Any

    def refuse(self, value: Any, rule: str, example: object) -> ConfigError:
        return ConfigError(self.path, value, rule, f"{self.name}: {example}")


#: A dedicated reader of one setting: (the key, the profile's value, never None) -> the field's value.
Parser = Callable[[Key, Any], Any]


@dataclasses.dataclass(frozen=True)
class Setting:
    """How a profile sets one field (the field's ``metadata``; made by :func:`setting`)."""

    key: str | None
    section: str | None
    ge: float | None
    gt: float | None
    le: float | None
    pattern: re.Pattern[str] | None
    choices: tuple[str, ...]
    example: str | None
    rule: str | None
    parse: Parser | None


def setting(
    *,
    key: str | None = None,
    section: str | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    pattern: re.Pattern[str] | None = None,
    choices: tuple[str, ...] = (),
    example: str | None = None,
    rule: str | None = None,
    parse: Parser | None = None,
) -> dict[str, Setting]:
    """The ``metadata`` of a backend field a cluster profile sets: ``field(default=1, metadata=setting(ge=1))``.

    ``key``: the profile's name when it is not the field's; ``section``: the profile mapping it sits
    in (``rayjob: {backoff_limit: 0}``). ``ge``/``gt``/``le`` bound a number, ``pattern`` (whole
    match) and ``choices`` a text; ``example`` is the fix's value when the default is none to copy;
    ``rule`` says what the value must be when the type and bounds say it badly. ``parse`` reads a
    value that is not a plain ``bool``/``int``/``float``/``str``/``Enum``.
    """
    return {_METADATA_KEY: Setting(key, section, ge, gt, le, pattern, choices, example, rule, parse)}


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    key: str
    setting: Setting
    #: The annotation, ``None`` taken out of an optional one.
    type: Any
    optional: bool
    default: Any

    def at(self) -> Key:
        s = self.setting
        return Key(f"cluster.{s.section}.{self.key}" if s.section else f"cluster.{self.key}", self.key, self.default)


@functools.cache
def _fields(cls: type[ClusterBackend]) -> tuple[_Field, ...]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every backend is a dataclass
        s = f.metadata.get(_METADATA_KEY)
        if s is None:
            continue
        tp = hints[f.name]
        args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else (tp,)
        base = next(a for a in args if a is not type(None))
        if s.parse is None and base not in (bool, int, float, str) and not (
            isinstance(base, type) and issubclass(base, Enum)
        ):
            raise TypeError(f"{cls.__name__}.{f.name}: a {tp} setting needs parse=")
        default = f.default_factory() if callable(f.default_factory) else f.default
        out.append(_Field(f.name, s.key or f.name, s, base, type(None) in args, default))
    return tuple(out)


def known_keys(cls: type[ClusterBackend], also: Collection[str] = ()) -> list[str]:
    """Every top-level key a profile of this backend may set (besides ``backend``), sorted."""
    return sorted({f.setting.section or f.key for f in _fields(cls)} | set(COMMON_SETTINGS) | set(also))


def read_settings(cls: type[B], spec: Mapping[str, Any], *, also: Collection[str] = ()) -> B:
    """``cls`` built from a cluster profile's ``cluster`` section, each setting checked against its field.

    ``also``: keys this backend accepts that no field reads (:data:`COMMON_SETTINGS` and ``backend``
    always are).
    """
    fields = _fields(cls)
    _refuse_unknown({k: v for k, v in spec.items() if k != "backend"}, known_keys(cls, also), "cluster",
                    f"the {cls.kind} backend")
    sources: dict[str | None, Mapping[str, Any]] = {None: spec}
    for section in {s for f in fields if (s := f.setting.section) is not None}:
        sources[section] = _section(spec.get(section), section, [f for f in fields if f.setting.section == section],
                                    cls.kind)
    values: dict[str, Any] = {}
    for f in fields:
        source = sources[f.setting.section]
        value = source.get(f.key)
        if f.key not in source or (value is None and (f.optional or f.setting.parse is not None)):
            continue  # the field's default
        values[f.name] = f.setting.parse(f.at(), value) if f.setting.parse else _scalar(f, value)
    return cls(**values)


def _refuse_unknown(given: Mapping[str, Any], known: list[str], path: str, owner: str) -> None:
    for key, value in given.items():
        if key not in known:
            raise ConfigError(f"{path}.{key}", value, f"unknown setting of {owner}", f"use one of {known}")


def _section(value: Any, name: str, fields: list[_Field], kind: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        example = ", ".join(f"{f.key}: {_yaml(f.default)}" for f in fields)
        raise ConfigError(f"cluster.{name}", value, "must be a mapping", f"{name}: {{{example}}}")
    _refuse_unknown(value, sorted(f.key for f in fields), f"cluster.{name}", f"the {kind} backend's {name}")
    return value


def _scalar(f: _Field, value: Any) -> Any:
    s, tp, key = f.setting, f.type, f.at()
    example = s.example if s.example is not None else _yaml(f.default)
    if isinstance(tp, type) and issubclass(tp, Enum):
        choices = [m.value for m in tp]
        if value in choices:
            return tp(value)
        raise key.refuse(value, s.rule or f"must be {_either(choices)}", example)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise key.refuse(value, s.rule or "must be true or false", example)
    if tp is str:
        # A whole number is text too: YAML reads ``account: 1234`` as one.
        text = str(value) if isinstance(value, str | int) and not isinstance(value, bool) else None
        if text is not None and (s.pattern is None or s.pattern.fullmatch(text)) and (
            not s.choices or text in s.choices
        ):
            return text
        what = (f"must be {_either(s.choices)}" if s.choices
                else f"must match {s.pattern.pattern}" if s.pattern else "must be text")
        raise key.refuse(value, s.rule or what, example)
    number = not isinstance(value, bool) and isinstance(value, int if tp is int else int | float)
    if number and (s.ge is None or value >= s.ge) and (s.gt is None or value > s.gt) and (
        s.le is None or value <= s.le
    ):
        return tp(value)
    raise key.refuse(value, s.rule or f"must be {'an integer' if tp is int else 'a number'}{_bounds(s)}", example)


def _bounds(s: Setting) -> str:
    if s.ge is not None and s.le is not None:
        return f" between {s.ge:g} and {s.le:g}"
    parts = [f"{op} {bound:g}" for op, bound in ((">=", s.ge), (">", s.gt), ("<=", s.le)) if bound is not None]
    return " " + " and ".join(parts) if parts else ""


def _either(choices: Collection[str]) -> str:
    *rest, last = [str(c) for c in choices]
    return f"{', '.join(rest)} or {last}" if rest else last


def _yaml(value: Any) -> str:
    """``value`` as a profile would spell it."""
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# -- parsers shared by several backends ------------------------------------------------------------
def absolute_path(*, rule: str = "must be an absolute path", example: str = "/shared/...") -> Parser:
    """A parser of a path on this machine: ``~`` expanded, then it must be absolute."""

    def parse(key: Key, value: Any) -> str:
        path = Path(value).expanduser() if isinstance(value, str) and value else None
        if path is None or not path.is_absolute():
            raise key.refuse(value, rule, example)
        return str(path)

    return parse


def environment(*, auth_fix: str) -> Parser:
    """A parser of environment variables for the Ray nodes: names to values (a value is kept as its text).

    Ray's auth variables (``RAY_AUTH_*``) are refused: the backend sets them, and a token there would
    be written in clear where the nodes' environment is (a script, a manifest). ``auth_fix``: how this
    backend's profile sets Ray's auth instead (the refusal's fix).
    """

    def parse(key: Key, value: Any) -> dict[str, str]:
        if not isinstance(value, Mapping) or not all(isinstance(k, str) and _ENV_NAME.fullmatch(k) for k in value):
            raise key.refuse(value, "must map environment variable names to values", "{NCCL_DEBUG: WARN}")
        for name in value:
            if name.startswith(auth.AUTH_VAR_PREFIX):
                raise ConfigError(f"{key.path}.{name}", "***", "Ray's auth is set by the pipeline, not by env",
                                  f"remove it; {auth_fix}")
        return {str(k): str(v) for k, v in value.items()}

    return parse
