"""The request for a run's evaluation, built from the run's own files: its rows, its base model, its reward
function as its job reads it, and the champion rules (none; the latest published run, scored again on these rows)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from tests.evaluation.runs import PROFILE, example_run, published_run
from verl_pipeline.evaluation.run import plan_for_run
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.rundir import RunDir
from verl_pipeline.runs import latest_link
from verl_pipeline.scores import Role
from verl_pipeline.spec import RunSpec


@pytest.fixture
def run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_model_path: Path) -> RunSpec:
    """The example task's run in a pipeline home of its own (its ``runs/latest`` is this test's)."""
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    return example_run(tiny_model_path, run_name=f"pytest/eval-plan-{os.getpid()}")


def _val_path(spec: RunSpec) -> str:
    return str((RunDir(spec.run_dir).job() or {})["settings"]["data.val_files"])


def test_the_request_names_the_runs_rows_models_and_reward_as_its_job_does(run: RunSpec,
                                                                           tiny_model_path: Path) -> None:
    job = RunDir(run.run_dir).job() or {}
    plan = plan_for_run(run.run_dir, sample=4)
    request = plan.request
    assert request.data_path == job["settings"]["data.val_files"] and request.data_path.endswith("val.parquet")
    assert request.models == {Role.TRAINED: str(RunDir(run.run_dir).model_dir), Role.BASE: str(tiny_model_path)}
    # The reward file as the job reads it: by its name in the job's working_dir, which the plan's runtime_env ships.
    assert request.reward is not None and request.reward.path == job["settings"]["reward.custom_reward_function.path"]
    assert not Path(request.reward.path).is_absolute() and request.reward.name == "compute_score"
    assert plan.runtime_env == job["runtime_env"]
    assert (Path(plan.runtime_env["working_dir"]) / request.reward.path).is_file()
    # The run's response length, the sample asked for, no GPU asked for.
    assert request.max_new_tokens == run.verl["data.max_response_length"]
    assert (request.sample, request.use_gpus, request.engine) == (4, False, None)
    assert plan_for_run(run.run_dir, max_new_tokens=3).request.max_new_tokens == 3
    # vLLM's engine takes the share of the GPU the run's rollout had (verl's default when the job names none).
    share = RunDir(run.run_dir).job()["settings"].get("actor_rollout_ref.rollout.gpu_memory_utilization")
    assert request.gpu_memory_utilization == (None if share is None else float(share))


def test_no_published_run_means_no_champion(run: RunSpec) -> None:
    plan = plan_for_run(run.run_dir)
    assert Role.CHAMPION not in plan.request.models and plan.request.run_dirs == {}
    assert any(n.startswith("no champion: ") and str(latest_link(run.storage_root, PROFILE)) in n for n in plan.notes)


@pytest.mark.parametrize("its_rows", ["other", "same", None])
def test_the_champion_is_scored_again_on_these_rows_whatever_its_own_evaluation_was(
        run: RunSpec, tiny_model_path: Path, its_rows: str | None) -> None:
    # A retraining run on new data is compared with the model in service on that data.
    hashes = {"other": hashlib.sha256(b"other rows").hexdigest(),
              "same": hashlib.sha256(Path(_val_path(run)).read_bytes()).hexdigest(), None: None}
    champion = published_run(run.storage_root, tiny_model_path, run_key=f"champion-{its_rows}-rows",
                             data_hash=hashes[its_rows])
    plan = plan_for_run(run.run_dir)
    assert plan.request.models[Role.CHAMPION] == str(RunDir(champion).model_dir)
    assert plan.request.run_dirs == {Role.CHAMPION: str(champion)}
    assert any(n.startswith(f"champion: {champion}") and "scored on these rows" in n for n in plan.notes)



def test_the_run_itself_published_is_not_its_own_champion(run: RunSpec) -> None:
    from verl_pipeline import runs

    same = hashlib.sha256(Path(_val_path(run)).read_bytes()).hexdigest()
    RunDir(run.run_dir).save_evaluation({"data_hash": same})
    runs.record_run(run_dir=run.run_dir, run_key=run.run_key, run_name=run.run_name, profile=PROFILE,
                    status=runs.RunStatus.SUCCEEDED, checkpoint_dir=run.checkpoint_dir)
    runs.promote(run.storage_root, PROFILE, run.run_dir)
    plan = plan_for_run(run.run_dir)
    assert Role.CHAMPION not in plan.request.models
    assert any(n.endswith("is this run") for n in plan.notes)


def test_against_names_the_champion_and_must_have_an_exported_model(run: RunSpec, tiny_model_path: Path,
                                                                     tmp_path: Path) -> None:
    other = published_run(run.storage_root, tiny_model_path, run_key="another-run", data_hash=None)
    plan = plan_for_run(run.run_dir, against=other)
    assert plan.request.models[Role.CHAMPION] == str(RunDir(other).model_dir)
    assert plan.request.run_dirs == {Role.CHAMPION: str(other)}
    with pytest.raises(ConfigError, match=r"^against='.*': has no exported model .*\(fix: ") as err:
        plan_for_run(run.run_dir, against=tmp_path / "not-a-run")
    assert "\n" not in str(err.value)


def test_a_run_without_an_exported_model_is_planned_with_a_note(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                tiny_model_path: Path) -> None:
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    spec = example_run(tiny_model_path, run_name=f"pytest/eval-unexported-{os.getpid()}", exported=False)
    plan = plan_for_run(spec.run_dir)
    assert plan.request.models[Role.TRAINED] == str(RunDir(spec.run_dir).model_dir)
    assert any("holds no exported model" in n for n in plan.notes)


def test_a_directory_without_a_job_is_refused_in_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^run_dir='.*': has no job.json: the run submitted no job \(fix: "):
        plan_for_run(tmp_path)
