"""The held-out rows a profile's evaluation scores (``evaluation.data``): checked before any cluster starts,
named among what every node needs, and the rows the evaluate task scores."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from tests.evaluation.runs import verl_rows
from verl_pipeline.evaluation.held_out import check_held_out
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.scores import HELD_OUT_KEY, EvaluationSettings
from verl_pipeline.spec import RunSpec

PROFILE = "repeat-digit"


def held_out_spec(data: str | None, *, cluster_profile: str = "local-cpu", enabled: bool = True) -> RunSpec:
    spec = build_run_spec({"profile": PROFILE, "mode": "preflight"}, run_name="pytest/held-out",
                          cluster_profile=cluster_profile)
    return dataclasses.replace(spec, evaluation=EvaluationSettings(enabled=enabled, data=data))


def test_without_held_out_rows_the_validation_split_is_scored() -> None:
    assert check_held_out(held_out_spec(None)) is None
    assert check_held_out(held_out_spec("/nowhere/held-out.parquet", enabled=False)) is None


def test_rows_in_verls_schema_pass(tmp_path: Path) -> None:
    path = str(verl_rows(tmp_path / "held-out.parquet"))
    assert check_held_out(held_out_spec(path)) == path


@pytest.mark.parametrize(("make", "message"), [
    (lambda d: d / "absent.parquet", r"evaluation\.data='.*absent\.parquet': does not exist \(fix: "),
    (lambda d: verl_rows(d / "no-truth.parquet", ground_truth=False),
     r"evaluation\.data='.*no-truth\.parquet': is not in verl's row schema: .*ground_truth"),
    (lambda d: (d / "text.parquet").write_text("not parquet") and d / "text.parquet",
     r"evaluation\.data='.*text\.parquet': is not a readable parquet file"),
])
def test_rows_the_evaluation_could_not_read_are_refused_in_one_line(tmp_path: Path, make: object,
                                                                    message: str) -> None:
    path = make(tmp_path)  # type: ignore[operator]
    with pytest.raises(ConfigError, match=message) as err:
        check_held_out(held_out_spec(str(path)))
    assert "\n" not in str(err.value) and str(err.value).startswith(f"profiles/{PROFILE}.evaluation.data=")


def test_on_a_cluster_of_its_own_the_rows_must_be_on_its_shared_storage(tmp_path: Path) -> None:
    spec = held_out_spec(str(verl_rows(tmp_path / "held-out.parquet")), cluster_profile="h100-ib")
    with pytest.raises(ConfigError, match=r"is not under a shared mount \['/mnt/shared"):
        check_held_out(spec)
    # Under the shared mount but not on this machine: the environment probe checks it on every node.
    remote = held_out_spec(f"{spec.shared_roots[0]}/eval/held-out.parquet", cluster_profile="h100-ib")
    assert check_held_out(remote) == remote.evaluation.data


def test_render_refuses_a_missing_file_and_names_the_rows_among_what_every_node_needs(
        tmp_path: Path, own_configs: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verl_pipeline.cli import main

    profile = yaml.safe_load((own_configs / "profiles" / f"{PROFILE}.yaml").read_text())
    profile["evaluation"] = {"data": str(tmp_path / "held-out.parquet")}
    (own_configs / "profiles" / "held-out.yaml").write_text(yaml.safe_dump(profile))
    assert main(["render", "--profile", "held-out", "--cluster-profile", "local-cpu", "--no-verl-check"]) == 2
    err = capsys.readouterr().err.strip()
    assert "evaluation.data=" in err and "does not exist" in err and len(err.splitlines()) == 1
    verl_rows(tmp_path / "held-out.parquet")
    assert main(["render", "--profile", "held-out", "--cluster-profile", "local-cpu", "--no-verl-check"]) == 0
    out = capsys.readouterr().out.splitlines()
    needs = [line for line in out if line.startswith("# needs:") and "at the same path" in line]
    assert needs and f"{HELD_OUT_KEY}={tmp_path / 'held-out.parquet'}" in needs[0]
