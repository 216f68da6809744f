"""The critic's part of the report (PPO with GAE): its learning per step and its share of the step."""

from __future__ import annotations

import math

from tests.report.rows import verl_row
from verl_pipeline.report.build import AttemptInfo, RunFacts, RunOutcome, StepRow, build_report
from verl_pipeline.report.critic import summarise
from verl_pipeline.report.html import render_html
from verl_pipeline.report.plots import CRITIC_PNG, PLOTS, _pyplot

FACTS = RunFacts(run_key="ppo", run_name="verl_ppo/ppo", profile="smoke", mode="train", nnodes=1, n_gpus_per_node=1,
                 total_steps=4)


def _ppo_row(step: int, attempt: int = 1, *, vf_loss: float, values: float = 0.5, explained: float = 0.1) -> StepRow:
    # A 6 s step of which the critic's values pass took 0.5 s and its update 1 s.
    return verl_row(step, attempt, step_s=6.0, gen=3.0, **{
        "critic/vf_loss": vf_loss, "critic/vf_explained_var": explained, "critic/values/mean": values,
        "timing_s/values": 0.5, "timing_s/update_critic": 1.0})


def test_a_ppo_runs_critic_is_summarised_from_first_to_last_step_with_its_share_of_the_step() -> None:
    rows = [_ppo_row(1, vf_loss=0.03), _ppo_row(2, vf_loss=0.02), _ppo_row(3, vf_loss=float("nan")),
            _ppo_row(4, vf_loss=0.01, explained=0.4)]
    c = summarise(rows)
    assert c is not None
    loss = c.trends["critic/vf_loss"]
    # The NaN verl logs for a step without valid tokens is skipped, not taken as the last value.
    assert (loss.first, loss.first_step, loss.final, loss.final_step) == (0.03, 1, 0.01, 4)
    assert math.isclose(loss.median, 0.02)
    assert c.trends["critic/vf_explained_var"].final == 0.4
    assert c.timing_s == {"timing_s/values": 0.5, "timing_s/update_critic": 1.0}
    assert c.share_of_step is not None and math.isclose(c.share_of_step, 1.5 / 6.0)


def test_a_run_without_a_critic_gets_no_critic_section() -> None:
    rows = [verl_row(s) for s in (1, 2)]
    assert summarise(rows) is None
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, attempts=[AttemptInfo(1, "j1", 1000.0, 0)], rows=rows,
                          generated_at=2000.0)
    assert report.critic is None and report.to_dict()["critic"] is None
    assert "<h2>Critic</h2>" not in render_html(report)


def test_the_report_shows_the_critic_of_a_resumed_run_as_numbers_and_a_plot_with_the_attempts() -> None:
    # Attempt 2 resumed from step 2: its critic goes on from attempt 1's (the loss keeps falling).
    rows = [_ppo_row(s, 1, vf_loss=0.04 - 0.01 * s) for s in (1, 2)] + [
        _ppo_row(s, 2, vf_loss=0.04 - 0.01 * s) for s in (3,)]
    report = build_report(FACTS, status=RunOutcome.SUCCEEDED, rows=rows, generated_at=2000.0,
                          attempts=[AttemptInfo(1, "j1", 1000.0, 0), AttemptInfo(2, "j2", 1100.0, 2)])
    assert report.critic is not None
    assert report.to_dict()["critic"]["trends"]["critic/vf_loss"]["final_step"] == 3
    page = render_html(report)
    assert "<h2>Critic</h2>" in page and "critic/vf_loss" in page and "25%" in page
    plt = _pyplot()
    fig, ax = plt.subplots()
    try:
        assert PLOTS[CRITIC_PNG][1](ax, rows)
        left = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
        right = {line.get_label(): list(line.get_ydata()) for line in fig.axes[1].get_lines()}
    finally:
        plt.close(fig)
    assert left["critic/vf_loss"] == [1, 2, 3]
    assert "critic/vf_explained_var (right)" in left  # in the legend of the left axis
    assert right["critic/values/mean"] == [0.5, 0.5, 0.5]
