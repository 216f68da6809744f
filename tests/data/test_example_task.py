"""The example task ``repeat-digit``: its generated data, its reward function and its profiles."""

from __future__ import annotations

import pytest

from verl_pipeline.constants import BUILTIN_DATA
from verl_pipeline.data.generator import generate_problems
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir
from verl_pipeline.spec import DataSource
from verl_pipeline.trainer import reward


def test_every_ten_problems_ask_each_digit_once() -> None:
    problems = list(generate_problems(30, seed=0, kind="repeat-digit"))
    assert problems == list(generate_problems(30, seed=0, kind="repeat-digit"))
    for block in range(3):
        digits = [p.question.removeprefix("Repeat: ") for p in problems[block * 10:(block + 1) * 10]]
        assert sorted(digits) == [str(d) for d in range(10)]
    assert all(p.answer == f"#### {p.question.removeprefix('Repeat: ')}" for p in problems)
    # Another seed, another order.
    assert problems != list(generate_problems(30, seed=1, kind="repeat-digit"))


def test_the_arithmetic_problems_are_those_the_tokenizer_was_trained_on() -> None:
    assert list(generate_problems(5, seed=7)) == list(generate_problems(5, seed=7, kind="arithmetic"))
    assert "How many" in next(generate_problems(1, seed=7)).question


def test_builtin_data_sources_by_name() -> None:
    assert [str(DataSource.parse(f"builtin:{name}")) for name in BUILTIN_DATA] == ["builtin:arithmetic",
                                                                                  "builtin:repeat-digit"]
    with pytest.raises(ConfigError, match=r"unknown built-in data source.*builtin:arithmetic or builtin:repeat-digit"):
        DataSource.parse("builtin:copy")


@pytest.mark.parametrize(("response", "score"), [("7", 1.0), (" 7 7 7", 1.0), ("7 or 3", 0.25), ("3", 0.0),
                                                 ("", 0.0), ("  ", 0.0)])
def test_the_reward_is_the_share_of_the_answer_that_is_the_digit(response: str, score: float) -> None:
    fn = reward.load(reward.RewardFunction(str(configs_dir() / "tasks" / "repeat-digit" / "reward.py")))
    assert fn(data_source="example/repeat-digit", solution_str=response, ground_truth="7", extra_info={}) == score
