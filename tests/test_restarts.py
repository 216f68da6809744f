"""The run profile's ``restarts:`` section: defaults, validation with one-line errors, the frozen spec."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.restarts import RestartPolicy


def test_defaults_afford_two_restarts_in_a_row_without_progress_and_wait_20s_doubling_to_10m() -> None:
    p = RestartPolicy.from_profile(None, "p")
    assert p == RestartPolicy() == RestartPolicy(no_progress_limit=2, delay_s=20.0, max_delay_s=600.0)
    assert [p.delay(n) for n in range(7)] == [20.0, 40.0, 80.0, 160.0, 320.0, 600.0, 600.0]
    assert p.describe() == ("2 restart(s) in a row without progress, any number after progress; delay 20s doubled "
                            "per attempt without progress, at most 10m")


def test_a_profile_sets_the_limit_and_the_delays() -> None:
    p = RestartPolicy.from_profile({"no_progress_limit": 5, "delay": "1s", "max_delay": "4s"}, "p")
    assert (p.no_progress_limit, p.delay_s, p.max_delay_s) == (5, 1.0, 4.0)
    assert RestartPolicy.from_profile({"no_progress_limit": 0, "delay": "0s", "max_delay": "0s"}, "p").delay(3) == 0
    assert RestartPolicy.from_dict(p.to_dict()) == p and RestartPolicy.from_dict(None) == RestartPolicy()


@pytest.mark.parametrize(("section", "key", "fix"), [
    ({"no_progress_limit": -1}, "profiles/p.restarts.no_progress_limit", "no_progress_limit: 2"),
    ({"no_progress_limit": "two"}, "profiles/p.restarts.no_progress_limit", "no_progress_limit: 2"),
    ({"no_progress_limit": True}, "profiles/p.restarts.no_progress_limit", "no_progress_limit: 2"),
    ({"no_progress_limit": 1.5}, "profiles/p.restarts.no_progress_limit", "no_progress_limit: 2"),
    ({"delay": "soon"}, "profiles/p.restarts.delay", '"90s"'),
    ({"delay": 20}, "profiles/p.restarts.delay", '"90s"'),
    ({"max_delay": "5s", "delay": "10s"}, "profiles/p.restarts.max_delay", "max_delay: 10m"),
    ({"max_retries": 3}, "profiles/p.restarts.max_retries", "no_progress_limit"),
    ([2], "profiles/p.restarts", "restarts: {no_progress_limit: 2}"),
])
def test_a_bad_value_is_one_line_naming_the_key_the_value_and_the_fix(section: object, key: str, fix: str) -> None:
    with pytest.raises(ConfigError) as err:
        RestartPolicy.from_profile(section, "p")
    text = str(err.value)
    assert text.startswith(f"{key}=") and fix in text and "\n" not in text


def test_a_profiles_restarts_section_reaches_the_frozen_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_pipeline.paths import configs_dir
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.spec import RunSpec

    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    smoke = yaml.safe_load((cfg / "profiles" / "smoke.yaml").read_text())
    (cfg / "profiles" / "smoke.yaml").write_text(yaml.safe_dump({**smoke, "restarts": {"no_progress_limit": 4}}))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    spec = build_run_spec({"profile": "smoke"}, run_name="t/restarts")
    assert spec.restarts == RestartPolicy(no_progress_limit=4)
    assert RunSpec.from_dict(spec.to_dict()).restarts == spec.restarts
    # A run frozen by a release without the budget restarts by the defaults.
    older = {k: v for k, v in spec.to_dict().items() if k != "restarts"}
    assert RunSpec.from_dict(older).restarts == RestartPolicy()
    (cfg / "profiles" / "smoke.yaml").write_text(yaml.safe_dump({**smoke, "restarts": {"no_progress_limit": -2}}))
    with pytest.raises(ConfigError, match=r"^profiles/smoke\.restarts\.no_progress_limit=-2"):
        build_run_spec({"profile": "smoke"}, run_name="t/restarts")


def test_reprobe_is_on_change_by_default_and_always_on_request() -> None:
    from verl_pipeline.restarts import Reprobe

    assert RestartPolicy().reprobe is Reprobe.ON_CHANGE
    p = RestartPolicy.from_profile({"reprobe": "always"}, "p")
    assert p.reprobe is Reprobe.ALWAYS and p.to_dict()["reprobe"] == "always"
    assert RestartPolicy.from_dict(p.to_dict()) == p  # as the frozen spec keeps it
    with pytest.raises(ConfigError) as err:
        RestartPolicy.from_profile({"reprobe": "never"}, "p")
    assert str(err.value).startswith("profiles/p.restarts.reprobe=") and "reprobe: always" in str(err.value)
