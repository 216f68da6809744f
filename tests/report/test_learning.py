"""The learning verdict: did the run's reward rise, did validation hold, did entropy collapse (pure)."""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any

import pytest

from tests.report.rows import verl_row
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.report.build import RunOutcome, StepRow
from verl_pipeline.report.learning import (
    END_STEPS,
    ENTROPY_COLLAPSE_RATIO,
    MIN_STEPS,
    REWARD_RISE_MARGIN,
    Reason,
    judge,
)
from verl_pipeline.report.write import write_report
from verl_pipeline.rundir import Attempt, RunDir

VAL = "val-core/openai/gsm8k/reward/mean@1"


def _rows(rewards: list[float], **per_step: list[float]) -> list[StepRow]:
    """Training steps 1..n with these train rewards (``critic/score/mean``) and other metrics per step."""
    rows = [verl_row(s) for s in range(1, len(rewards) + 1)]
    for row, reward in zip(rows, rewards, strict=True):
        row.metrics.update({"critic/score/mean": reward, **{k.replace("__", "/"): v[row.step - 1]
                                                             for k, v in per_step.items()}})
    return rows


def _validation_row(step: int, value: float) -> StepRow:
    """A row of validation alone, as verl logs step 0 with ``trainer.val_before_train``."""
    return StepRow(step, 1, {VAL: value})


def test_a_rising_reward_with_validation_that_rose_learned() -> None:
    rewards = [0.40, 0.45, 0.50, 0.55, 0.60, 0.65, 0.70, 0.75]
    rows = [_validation_row(0, 0.06), *_rows(rewards, actor__entropy=[2.0 - 0.1 * i for i in range(8)],
                                             actor__kl_loss=[0.001 * i for i in range(8)])]
    rows[-1].metrics[VAL] = 0.5
    v = judge(rows)
    assert v.learned is True and v.reasons == ()
    assert v.end_steps == END_STEPS and v.steps == 8 and v.reward_metric == "critic/score/mean"
    assert v.reward_first == pytest.approx(0.45) and v.reward_last == pytest.approx(0.70)
    assert v.reward_rise == pytest.approx(0.25) and v.reward_slope_per_step == pytest.approx(0.05)
    assert (v.validation_first, v.validation_first_step, v.validation_last, v.validation_last_step) == (0.06, 0, 0.5, 8)
    assert v.validation_metrics == (VAL,)
    assert v.kl_metric == "actor/kl_loss" and v.kl_first == pytest.approx(0.001) and v.kl_last == pytest.approx(0.006)
    assert v.entropy_first == pytest.approx(1.9) and v.entropy_last == pytest.approx(1.4)
    assert v.words.startswith("The run learned: train reward (critic/score/mean, mean of the first and last 3 steps) "
                              "0.45 -> 0.70 over 8 steps (+0.25, slope +0.05/step), validation 0.06 -> 0.50")
    assert "KL to the reference (actor/kl_loss) 0.001 -> 0.006, entropy 1.90 -> 1.40." in v.words


def test_a_flat_reward_did_not_learn_and_says_the_rise_was_under_the_margin() -> None:
    v = judge(_rows([0.5, 0.52, 0.49, 0.51, 0.5, 0.52]))
    assert v.learned is False and v.reasons == (Reason.RISE_UNDER_MARGIN,)
    assert v.reward_rise is not None and abs(v.reward_rise) < REWARD_RISE_MARGIN
    assert v.words.startswith("The run did not learn: the train reward changed +0.0067, under the +0.05 rise")
    assert "no validation logged" in v.words


def test_a_rise_just_at_the_margin_learned_and_just_under_it_did_not() -> None:
    at = judge(_rows([0.0, 0.0, 0.0, REWARD_RISE_MARGIN, REWARD_RISE_MARGIN, REWARD_RISE_MARGIN]))
    under = judge(_rows([0.0, 0.0, 0.0, 0.049, 0.049, 0.049]))
    assert (at.learned, under.learned) == (True, False)


def test_a_validation_that_fell_fails_a_rising_train_reward() -> None:
    rows = [_validation_row(0, 0.6), *_rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6])]
    rows[-1].metrics[VAL] = 0.4
    v = judge(rows)
    assert v.learned is False and v.reasons == (Reason.VALIDATION_FELL,)
    assert v.words.startswith("The run did not learn: validation fell 0.60 -> 0.40. Train reward")


def test_every_reward_zero_says_the_reward_function_never_rewarded_an_answer() -> None:
    v = judge(_rows([0.0] * 10))
    assert v.learned is False and v.reasons == (Reason.REWARD_ALL_ZERO,)  # not also "under the margin"
    assert ("the train reward was 0 at every one of its 10 steps (the reward function never rewarded an answer"
            in v.words)


def test_a_collapsed_entropy_fails_even_a_rising_reward() -> None:
    entropy = [2.0, 2.0, 2.0, 0.1, 0.1, 0.1]
    assert entropy[-1] < ENTROPY_COLLAPSE_RATIO * entropy[0]
    v = judge(_rows([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], actor__entropy=entropy))
    assert v.learned is False and v.reasons == (Reason.ENTROPY_COLLAPSED,)
    assert "entropy collapsed 2.00 -> 0.10" in v.words and v.words.count("entropy") == 1


def test_too_few_steps_or_no_reward_is_not_judged() -> None:
    few = judge([_validation_row(0, 0.1), *_rows([0.1, 0.9, 1.0][: MIN_STEPS - 1])])
    assert few.learned is None and few.reasons == (Reason.TOO_FEW_STEPS,) and few.steps == MIN_STEPS - 1
    assert few.words.startswith("Learning not judged: 3 training step(s) logged a train reward (critic/score/mean)")
    assert few.validation_first == 0.1  # what there is, is still reported
    bare = [StepRow(s, 1, {"training/global_step": float(s), "timing_s/step": 6.0}) for s in range(1, 10)]
    none = judge(bare)
    assert none.learned is None and none.reasons == (Reason.NO_REWARD,) and none.reward_metric is None
    assert none.words == ("Learning not judged: verl logged no train reward (critic/score/mean or "
                          "critic/rewards/mean) at any training step.")
    assert judge([]).learned is None


def test_without_validation_the_train_reward_decides_and_the_words_say_so() -> None:
    v = judge(_rows([0.1, 0.1, 0.1, 0.5, 0.5, 0.5]))
    assert v.learned is True and v.validation_first is None and v.validation_metrics == ()
    assert "no validation logged" in v.words
    once = judge([_validation_row(0, 0.3), *_rows([0.1, 0.1, 0.1, 0.5, 0.5, 0.5])])
    assert once.learned is True and "validation 0.30 (once, at step 0)" in once.words


def test_a_ppo_run_reports_the_critic_the_kl_penalty_and_the_rewards_when_no_score() -> None:
    steps = range(1, 9)
    rows = [StepRow(s, 1, {"critic/rewards/mean": 0.1 * s, "critic/vf_explained_var": -0.5 + 0.15 * s,
                           "actor/reward_kl_penalty": 0.002 * s, "actor/ppo_kl": 0.5, "actor/entropy": 1.0,
                           "critic/vf_loss": 0.1 / s}) for s in steps]
    v = judge(rows)
    assert v.learned is True and v.reward_metric == "critic/rewards/mean"
    # The KL to the reference (a penalty in the reward) wins over the update's own KL.
    assert v.kl_metric == "actor/reward_kl_penalty" and v.kl_last == pytest.approx(0.014)
    assert v.explained_var_first == pytest.approx(-0.2) and v.explained_var_last == pytest.approx(0.55)
    assert "critic's explained variance -0.20 -> 0.55" in v.words
    only_ppo_kl = judge([StepRow(r.step, 1, {k: x for k, x in r.metrics.items() if k != "actor/reward_kl_penalty"})
                         for r in rows])
    assert only_ppo_kl.kl_metric == "actor/ppo_kl" and "KL of each update to the rollout's policy" in only_ppo_kl.words


def test_nan_steps_are_skipped_and_validation_averages_its_data_sources() -> None:
    rows = _rows([0.1, float("nan"), 0.1, 0.1, 0.5, 0.5, 0.5])
    rows[0].metrics.update({VAL: 0.2, "val-core/math/acc/mean@4": 0.4, "val-aux/openai/gsm8k/reward/std@1": 9.0})
    rows[-1].metrics.update({VAL: 0.6, "val-core/math/acc/mean@4": 0.8})
    v = judge(rows)
    assert v.steps == 6 and v.reward_first == pytest.approx(0.1) and v.reward_last == pytest.approx(0.5)
    assert v.validation_metrics == ("val-core/math/acc/mean@4", VAL)
    assert v.validation_first == pytest.approx(0.3) and v.validation_last == pytest.approx(0.7)


def test_a_report_of_a_stand_in_run_carries_the_verdict_in_its_json_html_and_xcom(tmp_path: Path) -> None:
    from tests.fakes.fake_verl_trainer import step_metrics

    run_dir = tmp_path / "runs" / "learn"
    run_dir.mkdir(parents=True)
    write_json_atomic(run_dir / "run_spec.json", {"run_name": "verl_ppo/learn", "profile": "gsm8k", "nnodes": 1,
                                                  "n_gpus_per_node": 2, "total_training_steps": 6,
                                                  "storage_root": str(tmp_path)})
    write_json_atomic(run_dir / "job.json", {"mode": "train"})
    metrics_file = RunDir(run_dir).metrics_file(1)
    RunDir(run_dir).record_attempt(Attempt("job-a1", 1, 1000.0, "http://d", 0, str(metrics_file)))
    # The stand-in trainer's rows: its two workers score 0.1 x step (+0.01 for the second shard).
    lines: list[dict[str, Any]] = [{"step": 0, "data": {VAL: 0.05}}]
    lines += [{"step": s, "data": step_metrics(s, 6.0, [{"score": 0.1 * s + 0.01 * w, "length": 50.0 + s}
                                                         for w in range(2)], world=2, critic=False)}
              for s in range(1, 7)]
    lines[-1]["data"][VAL] = 0.45
    metrics_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    words = ("The run learned: train reward (critic/score/mean, mean of the first and last 3 steps) 0.21 -> 0.51 "
             "over 6 steps (+0.30, slope +0.1/step), validation 0.05 -> 0.45 (step 0 -> 6).")
    data = json.loads(files.json.read_text())
    assert data["learning"]["learned"] is True and data["learning"]["words"] == words
    assert data["learning"]["reasons"] == [] and data["learning"]["margin"] == REWARD_RISE_MARGIN
    assert data["learning"]["reward_rise"] == pytest.approx(0.3)
    html = files.html.read_text()
    assert f'<p class="ok"><b>{escape(words)}</b></p>' in html
    assert html.index(escape(words)) < html.index("<table>")  # near the top: before the summary table
    out = files.to_dict()
    assert out["learned"] is True and out["learning"] == words
