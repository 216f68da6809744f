"""The run profile's ``promotion:`` rule, and the one function that decides with it (:func:`decide`).

A retraining run becomes the profile's champion (``latest/<profile>``, the trained-model Asset event with
``promoted: true``, the registry's ``champion`` alias) only when its exported model beats, on the same
evaluation rows and by more than the rule's margins, the base model it started from and the current
champion (:mod:`verl_pipeline.scores`). A tie is no win.

.. code-block:: yaml

    promotion:
      metric: mean_reward           # or pass_rate (share of rows scoring 1)
      min_gain_over_base: 0.0       # the trained model must score more than the base + this; null: not compared
      min_gain_over_champion: 0.0   # ... more than the champion + this; null: not compared
      without_champion: promote     # the first run: promote when it beats the base, or hold
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from verl_pipeline.exceptions import ConfigError, section_of
from verl_pipeline.scores import Evaluation, Metric, Role

#: The run profile's section and its keys.
SECTION = "promotion"
_KEYS = ("metric", "min_gain_over_base", "min_gain_over_champion", "without_champion")
_EXAMPLE = "promotion: {metric: mean_reward, min_gain_over_base: 0.0, min_gain_over_champion: 0.0}"


class WithoutChampion(str, Enum):
    """What the first run of a profile (no champion yet) does."""

    PROMOTE = "promote"
    HOLD = "hold"


class VerdictKind(str, Enum):
    """Why a run was or was not promoted."""

    WIN = "win"
    NO_GAIN_OVER_BASE = "no_gain_over_base"
    NO_GAIN_OVER_CHAMPION = "no_gain_over_champion"
    NO_CHAMPION_HOLD = "no_champion_hold"
    CHAMPION_NOT_SCORED = "champion_not_scored"
    NO_EVALUATION = "no_evaluation"
    FORCED = "forced"
    #: The run profile turned the evaluation off: promoted without comparison.
    UNCHECKED = "unchecked"


@dataclass(frozen=True)
class PromotionRule:
    metric: Metric = Metric.MEAN_REWARD
    #: The least the trained model must score above the base (exclusive); None: not compared.
    min_gain_over_base: float | None = 0.0
    #: The least the trained model must score above the champion (exclusive); None: not compared.
    min_gain_over_champion: float | None = 0.0
    without_champion: WithoutChampion = WithoutChampion.PROMOTE

    def __post_init__(self) -> None:  # from a frozen spec's strings
        object.__setattr__(self, "metric", Metric(self.metric))
        object.__setattr__(self, "without_champion", WithoutChampion(self.without_champion))

    def describe(self) -> str:
        def over(what: str, gain: float | None) -> str:
            return f"not compared with the {what}" if gain is None else f"more than the {what} + {gain:g}"

        return (f"{self.metric.value}: {over('base', self.min_gain_over_base)}, "
                f"{over('champion', self.min_gain_over_champion)}; without a champion: {self.without_champion.value}")

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "metric": self.metric.value, "without_champion": self.without_champion.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> PromotionRule:
        return cls(**(data or {}))

    @classmethod
    def from_profile(cls, section: Any, profile: str) -> PromotionRule:
        """The rule of a run profile's ``promotion:`` section (absent: the defaults)."""
        where = f"profiles/{profile}.{SECTION}"
        section = section_of(section, where, _KEYS, what="promotion setting", example=_EXAMPLE)
        if section is None:
            return cls()
        out: dict[str, Any] = {}
        if "metric" in section:
            out["metric"] = _choice(Metric, section["metric"], f"{where}.metric", "metric: mean_reward")
        for key in ("min_gain_over_base", "min_gain_over_champion"):
            if key in section:
                out[key] = _gain(section[key], f"{where}.{key}")
        if "without_champion" in section:
            out["without_champion"] = _choice(WithoutChampion, section["without_champion"],
                                              f"{where}.without_champion", "without_champion: promote")
        return cls(**out)


def _choice(kind: type[Metric] | type[WithoutChampion], value: Any, key: str, fix: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(key, value, "is not one of " + ", ".join(m.value for m in kind), fix) from None


def _gain(value: Any, key: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
        raise ConfigError(key, value, "must be a number of at least 0, or null (not compared)",
                          f"{key.rsplit('.', 1)[1]}: 0.0 (any gain wins; a tie does not)")
    return float(value)


@dataclass(frozen=True)
class Verdict:
    """The rule's decision on one run, with the numbers it compared (``promotion.json``)."""

    promoted: bool
    kind: VerdictKind
    reason: str
    metric: str
    scores: dict[str, float]
    rule: dict[str, Any]
    forced: bool = False
    champion_run: str | None = None

    def line(self) -> str:
        """One line for the task log and the report."""
        return f"{'promoted' if self.promoted else 'not promoted'}: {self.reason}"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "kind": self.kind.value}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Verdict:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        return cls(**{**fields, "kind": VerdictKind(data["kind"])})


def decide(rule: PromotionRule, evaluation: Evaluation | None, *, champion_run: str | None,
           evaluation_error: str | None = None, force: bool = False) -> Verdict:
    """Whether the run is promoted: ``evaluation`` scored its trained model (and the base, and the
    champion of ``champion_run`` when there is one); ``force`` promotes whatever the numbers say (a
    manual override, recorded as such)."""
    scores = {role.value: s.value(rule.metric) for role, s in (evaluation.models if evaluation else {}).items()}

    def verdict(promoted: bool, kind: VerdictKind, reason: str) -> Verdict:
        if force and not promoted:
            promoted, kind, reason = True, VerdictKind.FORCED, f"by hand (a manual override), although {reason}"
        return Verdict(promoted, kind, reason, rule.metric.value, scores, rule.to_dict(), force, champion_run)

    trained = scores.get(Role.TRAINED.value)
    if evaluation is None or trained is None:
        why = evaluation_error or (evaluation.errors.get(Role.TRAINED.value) if evaluation else None)
        return verdict(False, VerdictKind.NO_EVALUATION, f"the trained model was not evaluated ({why or 'no record'})")
    name = rule.metric.value
    if rule.min_gain_over_base is not None:
        base = scores.get(Role.BASE.value)
        if base is None:
            return verdict(False, VerdictKind.NO_EVALUATION,
                           f"the base model was not evaluated ({evaluation.errors.get(Role.BASE.value, 'no score')})")
        if not trained > base + rule.min_gain_over_base:
            return verdict(False, VerdictKind.NO_GAIN_OVER_BASE,
                           f"{name} {trained:.4g} is not above the base's {base:.4g} + {rule.min_gain_over_base:g}")
    if champion_run is None:
        if rule.without_champion is WithoutChampion.HOLD:
            return verdict(False, VerdictKind.NO_CHAMPION_HOLD,
                           "there is no champion yet and the rule says without_champion: hold")
        return verdict(True, VerdictKind.WIN, f"{name} {trained:.4g}; the first champion of this profile")
    if rule.min_gain_over_champion is None:
        return verdict(True, VerdictKind.WIN, f"{name} {trained:.4g} (the champion is not compared)")
    champion = scores.get(Role.CHAMPION.value)
    if champion is None:
        why = evaluation.errors.get(Role.CHAMPION.value, "no score on these rows")
        return verdict(False, VerdictKind.CHAMPION_NOT_SCORED, f"the champion {champion_run} was not scored ({why})")
    margin = rule.min_gain_over_champion
    if not trained > champion + margin:
        return verdict(False, VerdictKind.NO_GAIN_OVER_CHAMPION,
                       f"{name} {trained:.4g} is not above the champion's {champion:.4g} + {margin:g}")
    return verdict(True, VerdictKind.WIN, f"{name} {trained:.4g} beats the champion's {champion:.4g}")


__all__ = ["SECTION", "PromotionRule", "Verdict", "VerdictKind", "WithoutChampion", "decide"]
