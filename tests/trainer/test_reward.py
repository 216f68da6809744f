"""The run's reward function: named once, loaded and called as verl calls it, refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.trainer import reward

GOOD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, scale=1.0):
    return scale * float(solution_str.strip().endswith(str(ground_truth)))
'''


def _data(tmp_path: Path, n: int = 20) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"Say {i}", "answer": str(i), "id": f"r{i}"}) + "\n"
                            for i in range(n)))
    return path


def _profile(configs: Path, data: Path, name: str = "own", **data_options: object) -> str:
    prof = yaml.safe_load((configs / "profiles" / "smoke.yaml").read_text())
    prof["data"] = {"source": str(data), "recipe": "generic", "data_source": "my/task",
                    "check_solution": "{ground_truth}", **data_options}
    (configs / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(prof))
    return name


def _spec(profile: str, overrides: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    return build_run_spec({"profile": profile}, run_name="pytest/reward", overrides=overrides)


def test_a_recipe_reward_reaches_the_job_with_its_kwargs(own_configs: Path, tmp_path: Path) -> None:
    (own_configs / "reward.py").write_text(GOOD)
    spec = _spec(_profile(own_configs, _data(tmp_path), custom_reward_path="reward.py",
                          custom_reward_kwargs={"scale": 2.0}))
    assert spec.verl[reward.PATH_KEY] == str(own_configs / "reward.py")
    assert spec.verl[reward.NAME_KEY] == "compute_score"
    assert spec.verl[f"+{reward.KWARGS_KEY}"] == {"scale": 2.0}
    assert "named by data.custom_reward_path" in spec.derived[reward.PATH_KEY]


def test_verl_spelling_and_recipe_spelling_that_differ_are_refused(own_configs: Path, tmp_path: Path) -> None:
    (own_configs / "a.py").write_text(GOOD)
    (own_configs / "b.py").write_text(GOOD)
    profile = _profile(own_configs, _data(tmp_path), custom_reward_path="a.py")
    with pytest.raises(ConfigError, match=r"data.custom_reward_path=.*a.py:compute_score.*names another reward "
                                          r"function than reward.custom_reward_function.path"):
        _spec(profile, {reward.PATH_KEY: str(own_configs / "b.py")})
    same = _spec(profile, {reward.PATH_KEY: str(own_configs / "a.py")})  # the same file twice is one function
    assert same.verl[reward.PATH_KEY] == str(own_configs / "a.py")


@pytest.mark.parametrize(("body", "error"), [
    ("def compute_score(solution_str):\n    return 1.0\n", r"verl cannot call it with its keyword arguments"),
    ("def score(**kw):\n    return 1.0\n", r"is not a function in"),
    ("import no_such_module_here\n", r"importing it failed \(ModuleNotFoundError"),
])
def test_a_function_verl_cannot_call_is_refused_when_the_run_is_built(own_configs: Path, tmp_path: Path,
                                                                       body: str, error: str) -> None:
    (own_configs / "reward.py").write_text(body)
    with pytest.raises(ConfigError, match=error):
        _spec(_profile(own_configs, _data(tmp_path), custom_reward_path="reward.py"))


@pytest.mark.parametrize(("returned", "error"), [
    ("'1.0'", r"returned '1.0' \(str\), not a number"),
    ("{'acc': 1.0}", r"returned a dict without 'score'"),
    ("True", r"returned True \(bool\), not a number"),
    ("1 / 0", r"raised ZeroDivisionError"),
])
def test_what_verl_could_not_use_is_one_line_naming_the_function_and_the_row(returned: str, error: str,
                                                                            tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text(f"def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    f"    return {returned}\n")
    fn = reward.RewardFunction(str(path))
    with pytest.raises(DataError, match=rf"rows.jsonl line 3: {path}:compute_score " + error) as e:
        reward.call(reward.load(fn), fn, data_source="my/task", solution="7", ground_truth="7", extra_info={},
                    where="rows.jsonl line 3")
    assert "\n" not in str(e.value) and "Fix:" in str(e.value)


def test_the_function_gets_the_rows_extra_info_as_verl_passes_it(tmp_path: Path) -> None:
    path = tmp_path / "r.py"
    path.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                    "    return {'score': float(extra_info['id'] == 'r3' and 'num_turns' in extra_info)}\n")
    fn = reward.RewardFunction(str(path))
    assert reward.call(reward.load(fn), fn, data_source="d", solution="x", ground_truth="x",
                       extra_info={"id": "r3"}, where="here") == 1.0


def test_preprocessing_calls_the_function_with_the_kept_columns(own_configs: Path, tmp_path: Path) -> None:
    from verl_pipeline import steps

    (own_configs / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(extra_info['id'] == 'r' + ground_truth and solution_str == ground_truth)\n")
    spec = _spec(_profile(own_configs, _data(tmp_path), custom_reward_path="reward.py", extra_columns=["id"]))
    result = steps.preprocess(spec, out_root=tmp_path / "out")
    assert result.counts["train_rows"] + result.counts["val_rows"] == 20
    (own_configs / "reward.py").write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(extra_info['missing'])\n")
    spec = _spec(_profile(own_configs, _data(tmp_path), custom_reward_path="reward.py", extra_columns=["id"]))
    with pytest.raises(DataError, match=r"line 1: .*reward.py:compute_score raised KeyError: 'missing'.*"
                                        r"extra_info keys \[.*'id'.*\]"):
        steps.preprocess(spec, out_root=tmp_path / "out2")


def test_a_reward_manager_verl_does_not_register_is_refused_at_provision() -> None:
    pytest.importorskip("verl")
    with pytest.raises(ConfigError, match=r"reward.reward_manager.name='prime': verl registers no reward manager.*"
                                          r"one of \[.*'naive'.*\]"):
        reward.check_manager({"reward.reward_manager.name": "prime"})
    reward.check_manager({"reward.reward_manager.name": "dapo"})
    reward.check_manager({"reward.reward_manager.name": "mine", "reward.reward_manager.source": "importlib"})
