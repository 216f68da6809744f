"""The evaluation record and the run profile's evaluation: section."""

from __future__ import annotations

import pytest

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.scores import Engine, Evaluation, EvaluationSettings, Example, Metric, ModelScore, Role


def test_an_evaluation_round_trips_and_says_when_it_is_a_smoke_run() -> None:
    trained = ModelScore(path="/r/model", mean_reward=0.75, pass_rate=0.5, mean_response_length=6.5, n=4,
                         examples=(Example("say 7", "777", "7", 1.0),))
    ev = Evaluation(data_path="/d/val.parquet", data_hash="h", split="val", engine=Engine.TRANSFORMERS,
                    sampling={"temperature": 0.0}, models={Role.TRAINED: trained}, rows_total=10,
                    errors={"base": "no such directory"})
    data = ev.to_dict()
    assert data["smoke"] is True and data["models"]["trained"]["examples"][0]["response"] == "777"
    assert Evaluation.from_dict(data) == ev
    assert ev.score(Role.TRAINED) == trained and ev.score(Role.CHAMPION) is None
    assert trained.value(Metric.PASS_RATE) == 0.5 and trained.value(Metric.MEAN_REWARD) == 0.75
    assert not Evaluation.from_dict({**data, "engine": "vllm"}).smoke


def test_the_evaluation_section() -> None:
    assert EvaluationSettings.from_profile(None, "p") == EvaluationSettings()
    s = EvaluationSettings.from_profile({"enabled": False, "sample": 4, "max_new_tokens": 32}, "p")
    assert s == EvaluationSettings(enabled=False, sample=4, max_new_tokens=32)
    assert EvaluationSettings.from_dict(s.to_dict()) == s
    held_out = EvaluationSettings.from_profile({"data": "/shared/eval/held-out.parquet"}, "p")
    assert held_out.data == "/shared/eval/held-out.parquet"
    assert EvaluationSettings.from_dict(held_out.to_dict()) == held_out


@pytest.mark.parametrize(("section", "key"), [
    ({"enabled": "yes"}, "profiles/p.evaluation.enabled"),
    ({"sample": 0}, "profiles/p.evaluation.sample"),
    ({"sample": None}, "profiles/p.evaluation.sample"),
    ({"max_new_tokens": 2.5}, "profiles/p.evaluation.max_new_tokens"),
    ({"max_new_tokens": True}, "profiles/p.evaluation.max_new_tokens"),
    ({"rows": 3}, "profiles/p.evaluation.rows"),
    ({"data": "eval/held-out.parquet"}, "profiles/p.evaluation.data"),
    ({"data": "/shared/eval/held-out.jsonl"}, "profiles/p.evaluation.data"),
    ({"data": ["/a.parquet"]}, "profiles/p.evaluation.data"),
])
def test_bad_evaluation_settings_are_refused(section: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        EvaluationSettings.from_profile(section, "p")
    assert e.value.key == key
