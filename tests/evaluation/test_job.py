"""The evaluation job as a real Ray job on a local CPU cluster: the tiny model answers the example task's
validation rows (written by the project's preprocess), a reward function shipped in the job's working_dir
scores them, and the record comes back through the job's log.

The reward function scores by the row (1.0 for an even ``extra_info.index``, 0.25 for an odd one) and
writes down every call, so what each model must score follows from the rows, and what the function was
given can be set beside what verl's own naive reward manager gives it for the same response.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.evaluation.request import EvaluationRequest
from verl_pipeline.evaluation.run import evaluate
from verl_pipeline.exceptions import JobError
from verl_pipeline.scores import EXAMPLES, Engine, Evaluation, Role
from verl_pipeline.trainer.reward import VERL_EXTRA_INFO

pytestmark = pytest.mark.integration

SAMPLE, MAX_NEW_TOKENS = 4, 8
REWARD = '''
import json


def compute_score(data_source, solution_str, ground_truth, extra_info=None, calls=None):
    score = 1.0 if extra_info["index"] % 2 == 0 else 0.25
    with open(calls, "a", encoding="utf-8") as f:
        f.write(json.dumps({"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                            "extra_info": extra_info, "score": score}) + "\\n")
    return {"score": score, "index": extra_info["index"]}
'''


def row_score(row: dict[str, Any]) -> float:
    """What :data:`REWARD` gives ``row``."""
    return 1.0 if row["extra_info"]["index"] % 2 == 0 else 0.25


@dataclass(frozen=True)
class Evaluated:
    evaluation: Evaluation
    request: EvaluationRequest
    rows: list[dict[str, Any]]
    calls: list[dict[str, Any]]
    reward_file: Path


def example_rows(root: Path, tiny_model_path: Path) -> str:
    """The example task's validation parquet, as the project's preprocess writes it."""
    from verl_pipeline.data.preprocess import preprocess
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": "repeat-digit", "mode": "preflight"}, run_name="pytest/eval-rows",
                          cluster_profile="local-cpu")
    return preprocess(spec.data, spec.data_options, root / "data", tokenizer=str(tiny_model_path),
                      max_prompt_length=int(spec.verl["data.max_prompt_length"])).val_path


def job_env(working_dir: Path) -> dict[str, Any]:
    """A runtime_env as the pipeline renders one: this package shipped, the run's files as working_dir."""
    from verl_pipeline.paths import package_dir

    return {"working_dir": str(working_dir), "py_modules": [str(package_dir())],
            "env_vars": {"TOKENIZERS_PARALLELISM": "false"}}


@pytest.fixture(scope="module")
def evaluated(ray_cluster: ClusterHandle, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Evaluated:
    """One evaluation job: the tiny model as trained, a copy of it as base, a champion that is not there."""
    import pyarrow.parquet as pq

    root = tmp_path_factory.mktemp("evaluation")
    val_path = example_rows(root, tiny_model_path)
    job_files = root / "job_files"
    job_files.mkdir()
    (job_files / "reward.py").write_text(REWARD)
    shutil.copytree(tiny_model_path, root / "base")
    calls = root / "calls.jsonl"
    request = EvaluationRequest.from_dict({
        "models": {"trained": str(tiny_model_path), "base": str(root / "base"), "champion": str(root / "no-model")},
        "data_path": val_path, "reward": {"path": "reward.py", "kwargs": {"calls": str(calls)}},
        "max_new_tokens": MAX_NEW_TOKENS, "sample": SAMPLE})
    evaluation = evaluate(ray_cluster.client(), request, runtime_env=job_env(job_files),
                          id_prefix=f"pytest-{os.getpid()}", timeout_s=300)
    lines = calls.read_text().splitlines() if calls.is_file() else []
    return Evaluated(evaluation, request, pq.read_table(val_path).to_pylist(), [json.loads(x) for x in lines],
                     job_files / "reward.py")


def test_a_model_that_is_not_there_is_its_error_and_the_others_are_scored(evaluated: Evaluated) -> None:
    ev = evaluated.evaluation
    assert set(ev.models) == {Role.TRAINED, Role.BASE}
    missing = evaluated.request.models[Role.CHAMPION]
    assert list(ev.errors) == ["champion"] and ev.errors["champion"].startswith(f"no model directory at {missing}")
    assert "\n" not in ev.errors["champion"]


def test_on_cpus_the_first_rows_are_a_smoke_evaluation_with_transformers(evaluated: Evaluated) -> None:
    ev, rows = evaluated.evaluation, evaluated.rows
    assert ev.engine is Engine.TRANSFORMERS and ev.smoke
    assert ev.rows_total == len(rows) > SAMPLE
    assert ev.sampling == {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "seed": 0, "sample": SAMPLE}
    assert ev.data_path == evaluated.request.data_path and ev.split == "val"
    assert ev.data_hash == hashlib.sha256(Path(ev.data_path).read_bytes()).hexdigest()
    for score in ev.models.values():
        assert score.n == SAMPLE and len(score.examples) == EXAMPLES
        assert [e.prompt for e in score.examples] == [r["prompt"][-1]["content"] for r in rows[:EXAMPLES]]
        assert [e.ground_truth for e in score.examples] == [r["reward_model"]["ground_truth"] for r in rows[:EXAMPLES]]


def test_the_scores_are_the_reward_function_over_the_rows(evaluated: Evaluated) -> None:
    ev, first = evaluated.evaluation, evaluated.rows[:SAMPLE]
    expected = [row_score(r) for r in first]
    assert 0 < sum(s == 1.0 for s in expected) < SAMPLE  # the rows both pass and fail
    for score in ev.models.values():
        assert score.mean_reward == pytest.approx(statistics.fmean(expected))
        assert score.pass_rate == sum(s >= 1.0 for s in expected) / SAMPLE
        assert [e.score for e in score.examples] == expected[:EXAMPLES]
        assert 1 <= score.mean_response_length <= MAX_NEW_TOKENS
    # Called once per row and model (trained first), with each row as verl hands it over, verl's additions included.
    calls = evaluated.calls
    assert len(calls) == SAMPLE * len(ev.models)
    for call, row in zip(calls, first + first, strict=True):
        assert call["data_source"] == row["data_source"] == "example/repeat-digit"
        assert call["ground_truth"] == row["reward_model"]["ground_truth"]
        assert call["extra_info"] == {**row["extra_info"], **VERL_EXTRA_INFO}
    assert [c["solution_str"] for c in calls[:EXAMPLES]] == [e.response for e in ev.models[Role.TRAINED].examples]


def test_each_response_scores_what_verls_naive_reward_manager_gives_it(evaluated: Evaluated, tmp_path: Path,
                                                                        tiny_model_path: Path) -> None:
    import functools

    import numpy as np
    import torch
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from verl import DataProto
    from verl.experimental.reward_loop.reward_manager.naive import NaiveRewardManager

    from verl_pipeline.trainer.reward import RewardFunction, load

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    verl_calls = tmp_path / "verl-calls.jsonl"
    # verl binds reward_kwargs to the function before its manager calls it.
    scorer = functools.partial(load(RewardFunction(str(evaluated.reward_file))), calls=str(verl_calls))
    manager = NaiveRewardManager(OmegaConf.create({}), tokenizer, scorer)
    rows = evaluated.rows[:SAMPLE]
    ours = evaluated.calls[:SAMPLE]
    for row, call in zip(rows, ours, strict=True):
        response = tokenizer(call["solution_str"], add_special_tokens=False, return_tensors="pt")["input_ids"]
        prompt = torch.tensor([[tokenizer.pad_token_id]])
        item = DataProto.from_dict(
            tensors={"prompts": prompt, "responses": response,
                     "attention_mask": torch.ones(1, 1 + response.shape[1], dtype=torch.long)},
            non_tensors={k: np.array([dict(row[k]) if isinstance(row[k], dict) else row[k]], dtype=object)
                         for k in ("data_source", "reward_model", "extra_info")})
        result = manager.loop.run_until_complete(manager.run_single(item))
        assert result["reward_score"] == call["score"]
    theirs = [json.loads(x) for x in verl_calls.read_text().splitlines()]
    assert theirs == ours


def test_greedy_generation_gives_one_model_the_same_responses_each_time(evaluated: Evaluated) -> None:
    trained, base = evaluated.evaluation.models[Role.TRAINED], evaluated.evaluation.models[Role.BASE]
    assert base.path != trained.path
    assert dataclasses.replace(base, path=trained.path) == trained


def test_a_job_that_cannot_read_its_rows_fails_in_one_line_with_its_id_and_log(ray_cluster: ClusterHandle,
                                                                               tiny_model_path: Path,
                                                                               tmp_path: Path) -> None:
    request = EvaluationRequest.from_dict({"models": {"base": str(tiny_model_path)},
                                           "data_path": str(tmp_path / "absent.parquet")})
    with pytest.raises(JobError) as err:
        evaluate(ray_cluster.client(), request, runtime_env=job_env(tmp_path), id_prefix=f"pytest-{os.getpid()}",
                 timeout_s=300)
    text = str(err.value)
    assert text.startswith(f"the evaluation job pytest-{os.getpid()}-eval-")
    assert " ended FAILED without a record: " in text
    assert f"the evaluation rows {tmp_path / 'absent.parquet'} cannot be read" in text and "\n" not in text


def test_a_job_past_its_deadline_is_stopped(ray_cluster: ClusterHandle, tiny_model_path: Path, tmp_path: Path) -> None:
    import re

    from verl_pipeline.jobs.client import wait_job_ended

    request = EvaluationRequest.from_dict({"models": {"base": str(tiny_model_path)}, "data_path": "rows.parquet"})
    client = ray_cluster.client()
    with pytest.raises(JobError, match=r"printed no record within 0s and was stopped \(fix: ") as err:
        evaluate(client, request, runtime_env=job_env(tmp_path), id_prefix=f"pytest-{os.getpid()}", timeout_s=0)
    found = re.search(r"job (\S+) printed", str(err.value))
    assert found is not None and wait_job_ended(client, found.group(1))
    info = client.get_job(found.group(1))
    assert info is not None and info.status.value == "STOPPED"


def test_without_a_reward_function_verls_default_scorer_scores(tiny_model_path: Path, tmp_path: Path) -> None:
    """In this process: the smoke profile's arithmetic rows (data_source openai/gsm8k), no reward file."""
    from verl.utils.reward_score import default_compute_score

    from verl_pipeline.data.preprocess import preprocess
    from verl_pipeline.evaluation.job import evaluate_models
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": "smoke"}, run_name="pytest/eval-default-reward")
    val_path = preprocess(spec.data, spec.data_options, tmp_path / "data").val_path
    request = EvaluationRequest.from_dict({"models": {"base": str(tiny_model_path)}, "data_path": val_path,
                                           "max_new_tokens": MAX_NEW_TOKENS, "sample": 2})
    ev = evaluate_models(request)
    assert ev.errors == {} and ev.models[Role.BASE].n == 2
    for e in ev.models[Role.BASE].examples:
        assert e.score == float(default_compute_score("openai/gsm8k", e.response, e.ground_truth))
