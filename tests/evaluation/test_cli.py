"""``verl-pipeline evaluate`` as a user runs it (a subprocess) on the example task's run and the tiny model:
on the run's recorded cluster, and on a local Ray head the command starts and stops itself."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ray_processes
from tests.evaluation.runs import example_run, published_run
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.paths import configs_dir
from verl_pipeline.rundir import RunDir
from verl_pipeline.scores import Evaluation, Role
from verl_pipeline.trainer.reward import RewardFunction, load

pytestmark = pytest.mark.integration

CLI = [sys.executable, "-m", "verl_pipeline", "evaluate"]


def _evaluate(*args: str, home: Path) -> subprocess.CompletedProcess[str]:
    r = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "VERL_PIPELINE_HOME": str(home)})
    assert r.returncode == 0, f"rc={r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return r


def test_evaluate_scores_the_run_its_base_and_another_run_and_writes_evaluation_json(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path, ray_cluster: ClusterHandle) -> None:
    home = tmp_path / "home"
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(home))
    spec = example_run(tiny_model_path, run_name=f"pytest/eval-cli-{os.getpid()}")
    RunDir(spec.run_dir).save_cluster(ray_cluster.to_dict())  # as `cluster up` records it
    other = published_run(spec.storage_root, tiny_model_path, run_key="another-run", data_hash=None)
    r = _evaluate(str(spec.run_dir), "--against", str(other), "--sample", "4", "--max-new-tokens", "8", "--json",
                  home=home)
    out = json.loads(r.stdout)
    assert out["file"] == str(RunDir(spec.run_dir).evaluation_file)
    assert RunDir(spec.run_dir).evaluation() == out["evaluation"]
    ev = Evaluation.from_dict(out["evaluation"])
    assert ev.errors == {} and set(ev.models) == set(Role)
    assert (ev.smoke, ev.rows_total, ev.sampling["sample"], ev.sampling["max_new_tokens"]) == (True, 10, 4, 8)
    trained, base, champion = (ev.models[r] for r in (Role.TRAINED, Role.BASE, Role.CHAMPION))
    assert trained.path == str(RunDir(spec.run_dir).model_dir) and base.path == str(tiny_model_path)
    assert (champion.path, champion.run_dir) == (str(RunDir(other).model_dir), str(other))
    assert f"champion: {other} (asked for)" in out["notes"]
    # Three copies of one model's weights: greedy generation gives each the same responses and scores.
    assert dataclasses.replace(champion, path=trained.path, run_dir=None) == trained
    assert dataclasses.replace(base, path=trained.path) == trained
    # Scored by the run's own reward function, the example task's (shipped in the run's job files).
    task_reward = load(RewardFunction(str(configs_dir() / "tasks" / "repeat-digit" / "reward.py")))
    for e in trained.examples:
        assert e.score == task_reward(data_source="example/repeat-digit", solution_str=e.response,
                                      ground_truth=e.ground_truth, extra_info={})


def test_without_a_recorded_cluster_evaluate_starts_a_local_head_and_stops_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path) -> None:
    from verl_pipeline.cluster.local import LocalBackend

    home = tmp_path / "home"
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(home))
    spec = example_run(tiny_model_path, run_name=f"pytest/eval-cli-head-{os.getpid()}")
    assert RunDir(spec.run_dir).cluster() is None
    r = _evaluate(str(spec.run_dir), "--sample", "2", "--max-new-tokens", "4", home=home)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("rows: ") and "a smoke evaluation: transformers on the first 2 of 10 rows" in lines[0]
    assert lines[1].split() == ["role", "mean", "reward", "pass", "rate", "length", "n"]
    ev = Evaluation.from_dict(RunDir(spec.run_dir).evaluation() or {})
    for role, line in zip((Role.TRAINED, Role.BASE), lines[2:4], strict=True):
        score = ev.models[role]
        assert line.split() == [role.value, f"{score.mean_reward:.3f}", f"{score.pass_rate:.1%}",
                                f"{score.mean_response_length:.1f}", str(score.n)]
    assert any(line.startswith("note: no champion: ") for line in lines)
    assert lines[-1] == f"written: {RunDir(spec.run_dir).evaluation_file}"
    # The head it started is gone, every process of it.
    temp_dir = LocalBackend.from_spec(spec.cluster).temp_dir_for(f"{spec.cluster_name}-evaluate")
    assert ray_processes(str(temp_dir)) == []
