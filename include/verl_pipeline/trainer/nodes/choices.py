"""A rule's value meets the user's: the user's wins, however it is written, and the record says both.

The decisions made at submit for the nodes (:mod:`verl_pipeline.trainer.nodes.decisions`) each set a verl
key unless the run's settings already set it — bare, ``+key``, ``++key`` or inside a whole section
given as one value (:func:`verl_pipeline.trainer.overrides.spelled`) — and record either the value and
its reason, or the user's value with what the rule would have chosen (a
:class:`~verl_pipeline.trainer.scaling.Rule` either way, as the scaling rules record theirs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_pipeline.trainer.overrides import spelled
from verl_pipeline.trainer.scaling import Rule


@dataclass
class Choices:
    """What the decisions set (``updates``) and why (``rules``), given the run's ``settings``."""

    settings: Mapping[str, Any]
    updates: dict[str, Any] = field(default_factory=dict)
    rules: list[Rule] = field(default_factory=list)

    def explicit(self, key: str) -> bool:
        return spelled(self.settings, key) is not None

    def set(self, key: str, value: Any, why: str, *, write_as: str | None = None) -> Any:
        """Set ``key`` (written as ``write_as``: ``+key`` for a key verl's YAML lacks) unless the settings
        set it; returns the value the job gets."""
        found = spelled(self.settings, key)
        if found is not None:
            self.rules.append(Rule(found.spelling, found.value,
                                   f"set explicitly; the rule would give {value!r} ({why})", overridden=True))
            return found.value
        name = write_as or key
        self.updates[name] = value
        self.rules.append(Rule(name, value, why))
        return value

    def note(self, key: str, value: Any, why: str) -> None:
        """Record a value the job gets without setting it (verl's default, the user's, or the environment's)."""
        self.rules.append(Rule(key, value, why))


__all__ = ["Choices"]
