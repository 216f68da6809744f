"""The promotion rule: every way a run is or is not promoted, and the profile section's checks."""

from __future__ import annotations

import pytest

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.promotion import PromotionRule, Verdict, VerdictKind, WithoutChampion, decide
from verl_pipeline.scores import Engine, Evaluation, Metric, ModelScore, Role


def score(mean: float, passed: float | None = None) -> ModelScore:
    return ModelScore(path="/m", mean_reward=mean, pass_rate=mean if passed is None else passed,
                      mean_response_length=4.0, n=10)


def evaluation(trained: float | None, base: float | None = 0.2, champion: float | None = None,
               errors: dict[str, str] | None = None) -> Evaluation:
    models = {role: score(v) for role, v in ((Role.TRAINED, trained), (Role.BASE, base), (Role.CHAMPION, champion))
              if v is not None}
    return Evaluation(data_path="/d/val.parquet", data_hash="abc", split="val", engine=Engine.VLLM,
                      sampling={"temperature": 0.0}, models=models, errors=errors or {})


RULE = PromotionRule()


@pytest.mark.parametrize(("trained", "champion", "kind", "promoted"), [
    (0.6, 0.5, VerdictKind.WIN, True),
    (0.4, 0.5, VerdictKind.NO_GAIN_OVER_CHAMPION, False),
    (0.5, 0.5, VerdictKind.NO_GAIN_OVER_CHAMPION, False),   # a tie is no win
    (0.2, None, VerdictKind.NO_GAIN_OVER_BASE, False),      # equal to the base
    (0.1, 0.05, VerdictKind.NO_GAIN_OVER_BASE, False),      # beats the champion, not the base
])
def test_the_trained_model_must_beat_the_base_and_the_champion(trained: float, champion: float | None,
                                                              kind: VerdictKind, promoted: bool) -> None:
    v = decide(RULE, evaluation(trained, champion=champion), champion_run="/runs/old" if champion else None)
    assert (v.kind, v.promoted) == (kind, promoted)
    assert v.scores[Role.TRAINED.value] == trained
    assert v.line().startswith("promoted" if promoted else "not promoted")


def test_margins_are_exclusive() -> None:
    rule = PromotionRule(min_gain_over_base=0.1, min_gain_over_champion=0.05)
    assert decide(rule, evaluation(0.3, base=0.2), champion_run=None).kind is VerdictKind.NO_GAIN_OVER_BASE
    assert decide(rule, evaluation(0.31, base=0.2), champion_run=None).promoted
    v = decide(rule, evaluation(0.5, champion=0.45), champion_run="/runs/old")
    assert v.kind is VerdictKind.NO_GAIN_OVER_CHAMPION and "0.45 + 0.05" in v.reason


def test_without_a_champion_the_first_run_is_promoted_or_held() -> None:
    assert decide(RULE, evaluation(0.5), champion_run=None).kind is VerdictKind.WIN
    hold = PromotionRule(without_champion=WithoutChampion.HOLD)
    v = decide(hold, evaluation(0.5), champion_run=None)
    assert (v.promoted, v.kind) == (False, VerdictKind.NO_CHAMPION_HOLD)


def test_an_evaluation_that_failed_promotes_nothing() -> None:
    v = decide(RULE, None, champion_run="/runs/old", evaluation_error="the evaluation job failed: OOM")
    assert (v.promoted, v.kind) == (False, VerdictKind.NO_EVALUATION) and "OOM" in v.reason
    v = decide(RULE, evaluation(None, errors={"trained": "weights unreadable"}), champion_run=None)
    assert v.kind is VerdictKind.NO_EVALUATION and "weights unreadable" in v.reason
    v = decide(RULE, evaluation(0.9, base=None, errors={"base": "tokenizer missing"}), champion_run=None)
    assert v.kind is VerdictKind.NO_EVALUATION and "tokenizer missing" in v.reason


def test_a_champion_not_scored_on_these_rows_blocks_promotion() -> None:
    v = decide(RULE, evaluation(0.9, errors={"champion": "its model directory is gone"}), champion_run="/runs/old")
    assert (v.promoted, v.kind) == (False, VerdictKind.CHAMPION_NOT_SCORED)
    assert "/runs/old" in v.reason and "gone" in v.reason


def test_comparisons_switched_off() -> None:
    rule = PromotionRule(min_gain_over_base=None, min_gain_over_champion=None)
    v = decide(rule, evaluation(0.0, base=0.5, champion=0.9), champion_run="/runs/old")
    assert v.promoted and v.kind is VerdictKind.WIN


def test_a_manual_override_promotes_and_says_so() -> None:
    v = decide(RULE, evaluation(0.3, champion=0.5), champion_run="/runs/old", force=True)
    assert (v.promoted, v.kind, v.forced) == (True, VerdictKind.FORCED, True)
    assert "by hand" in v.reason and "0.5" in v.reason
    # A run that wins on its own is a win, with the override recorded.
    v = decide(RULE, evaluation(0.9, champion=0.5), champion_run="/runs/old", force=True)
    assert (v.kind, v.forced) == (VerdictKind.WIN, True)


def test_the_metric_chosen_is_the_one_compared() -> None:
    ev = Evaluation(data_path="/d", data_hash="h", split="val", engine=Engine.VLLM, sampling={},
                    models={Role.TRAINED: score(0.9, passed=0.1), Role.BASE: score(0.1, passed=0.2)})
    assert decide(PromotionRule(), ev, champion_run=None).promoted
    v = decide(PromotionRule(metric=Metric.PASS_RATE), ev, champion_run=None)
    assert v.kind is VerdictKind.NO_GAIN_OVER_BASE and v.metric == "pass_rate"


def test_verdict_and_rule_round_trip() -> None:
    v = decide(RULE, evaluation(0.6, champion=0.5), champion_run="/runs/old")
    assert Verdict.from_dict(v.to_dict()) == v
    rule = PromotionRule(metric=Metric.PASS_RATE, min_gain_over_base=None)
    assert PromotionRule.from_dict(rule.to_dict()) == rule


def test_the_profile_section() -> None:
    rule = PromotionRule.from_profile({"metric": "pass_rate", "min_gain_over_champion": 0.02,
                                       "min_gain_over_base": None, "without_champion": "hold"}, "p")
    assert rule == PromotionRule(Metric.PASS_RATE, None, 0.02, WithoutChampion.HOLD)
    assert PromotionRule.from_profile(None, "p") == PromotionRule()
    assert "more than the champion + 0.02" in rule.describe()


@pytest.mark.parametrize(("section", "key"), [
    ({"metric": "accuracy"}, "profiles/p.promotion.metric"),
    ({"min_gain_over_base": -0.1}, "profiles/p.promotion.min_gain_over_base"),
    ({"min_gain_over_champion": "a lot"}, "profiles/p.promotion.min_gain_over_champion"),
    ({"min_gain_over_champion": True}, "profiles/p.promotion.min_gain_over_champion"),
    ({"without_champion": "maybe"}, "profiles/p.promotion.without_champion"),
    ({"margin": 0.1}, "profiles/p.promotion.margin"),
    ("yes", "profiles/p.promotion"),
])
def test_bad_sections_are_refused_in_one_line(section: object, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        PromotionRule.from_profile(section, "p")
    assert e.value.key == key and "\n" not in str(e.value)


def test_a_frozen_spec_keeps_its_rule_and_evaluation_settings() -> None:
    import dataclasses
    import json

    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.scores import EvaluationSettings
    from verl_pipeline.spec import RunSpec

    spec = dataclasses.replace(build_run_spec({"profile": "smoke"}, run_name="r"),
                               promotion=PromotionRule(Metric.PASS_RATE, None, 0.05, WithoutChampion.HOLD),
                               evaluation=EvaluationSettings(sample=4, max_new_tokens=8))
    again = RunSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert (again.promotion, again.evaluation) == (spec.promotion, spec.evaluation)
