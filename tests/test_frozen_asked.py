"""A run keeps the spec it started with; a value the user asks for explicitly and the run does not have is
refused in one line (a new run name, or the same value where the run starts), never dropped with a warning.
What the user did not ask for (a profile file edited since) is still only logged."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import yaml

from tests.airflow.context import task_context
from verl_pipeline import cli, steps
from verl_pipeline.airflow.operators.base import provisioned_spec
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import _ASKED_IN_SPEC, PARAM_KEYS, Asked, build_run_spec
from verl_pipeline.trainer.overrides import parse_overrides

RUN = "pytest/asked"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def frozen_by_cluster_up(**params: object) -> None:
    """What ``verl-pipeline cluster up --run-name RUN [flags]`` freezes (without starting the cluster)."""
    steps.freeze(build_run_spec(dict(params), run_name=RUN))


def test_every_param_is_compared_with_the_frozen_run() -> None:
    assert set(PARAM_KEYS) - {"verl_overrides"} <= set(_ASKED_IN_SPEC)


def test_an_explicit_mode_the_frozen_run_does_not_have_is_refused_in_one_line(
        home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The case seen: ``cluster up`` froze mode=auto (the profile's), then ``submit --mode train`` submitted a
    preflight job. Now the flag is refused before anything is submitted, naming both ways out."""
    frozen_by_cluster_up()
    assert cli.main(["submit", "--run-name", RUN, "--mode", "train"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("verl-pipeline: error: mode='train': run 'pytest/asked' was started with mode='auto' "
                          "(frozen in ")
    assert "a new run name to run with mode as asked" in err
    assert f"the same value(s) to `verl-pipeline cluster up --run-name {RUN}`" in err


def test_flags_that_agree_with_the_frozen_run_pass_and_several_differences_are_named_together(home: Path) -> None:
    frozen_by_cluster_up(mode="train", nnodes=2)
    args = cli.build_parser().parse_args(["render", "--run-name", RUN, "--mode", "train", "--nnodes", "2"])
    assert cli._spec(args).mode.value == "train"
    args = cli.build_parser().parse_args(["render", "--run-name", RUN, "--mode", "preflight", "--nnodes", "4",
                                          "--set", "trainer.save_freq=5"])
    with pytest.raises(ConfigError) as e:
        cli._spec(args)
    assert e.value.key == "nnodes, mode, trainer.save_freq"
    assert e.value.value == {"mode": "preflight", "nnodes": 4, "trainer.save_freq": 5}
    assert "started with nnodes=2, mode='train', trainer.save_freq=None" in str(e.value)


def test_a_teardown_is_never_refused(home: Path) -> None:
    frozen_by_cluster_up()
    args = cli.build_parser().parse_args(["cluster", "down", "--run-name", RUN, "--mode", "train"])
    assert cli._spec(args, refuse_changes=args.action != "down").mode.value == "auto"


def test_a_changed_profile_file_is_logged_not_refused(home: Path, own_configs: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    frozen_by_cluster_up()
    smoke = own_configs / "profiles" / "smoke.yaml"
    prof = yaml.safe_load(smoke.read_text())
    prof["trainer"]["total_training_steps"] = 7
    smoke.write_text(yaml.safe_dump(prof))
    with caplog.at_level(logging.WARNING, logger="verl_pipeline.steps"):
        spec = cli._spec(cli.build_parser().parse_args(["render", "--run-name", RUN]))
    assert spec.total_training_steps == 2  # the run's, not the edited file's
    assert any("differ in" in r.getMessage() and "total_training_steps" in r.getMessage() for r in caplog.records)


def test_a_dag_runs_params_agree_with_the_run_they_froze_on_every_try(home: Path) -> None:
    """Params are the same on every try of a DAG run: a retried provision finds its own frozen spec and
    passes. The same run id with other params (a run id used again) is refused."""
    params = {"profile": "smoke", "mode": "auto", "nnodes": 2, "verl_overrides": ["trainer={save_freq:3}"]}
    first = task_context({}, params, run_id="manual__asked")
    steps.freeze(provisioned_spec(first))
    retry = task_context({}, dict(params), run_id="manual__asked")
    assert provisioned_spec(retry).nnodes == 2
    other = task_context({}, {**params, "verl_overrides": ["trainer.save_freq=4"]}, run_id="manual__asked")
    with pytest.raises(ConfigError, match=r"trainer\.save_freq=4: .*was started with trainer\.save_freq=3.*"
                                          r"the same value\(s\) when triggering the DAG run"):
        provisioned_spec(other)


def test_asked_reads_the_same_arguments_as_build_run_spec() -> None:
    sets = parse_overrides(["trainer={save_freq:5}"])
    asked = Asked.of({"mode": None, "nnodes": "", "placement": "separate", "verl_overrides": ["a.b=1"]},
                     cluster_profile="h100-ib", overrides=sets, nccl_debug=None)
    assert asked == Asked({"placement": "separate", "cluster_profile": "h100-ib"}, {"a.b": 1, "trainer.save_freq": 5})
