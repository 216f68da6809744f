"""The plots' content, read back from real matplotlib axes."""

from __future__ import annotations

from typing import Any

from tests.report.rows import verl_row
from verl_pipeline.report.build import StepRow
from verl_pipeline.report.plots import PLOTS, TIMING_PNG, _pyplot


def _axes() -> Any:
    plt = _pyplot()
    fig, ax = plt.subplots()
    return plt, fig, ax


def test_the_phase_plot_draws_no_training_step_for_the_validation_row_at_step_0() -> None:
    rows = [StepRow(0, 1, {"val-core/openai/gsm8k/reward/mean@1": 0.1})] + [
        verl_row(s, **{"timing_s/testing": 2.0}) for s in (1, 2, 3)]
    plt, fig, ax = _axes()
    try:
        assert PLOTS[TIMING_PNG][1](ax, rows)
        stacked_x = {float(x) for c in ax.collections for p in c.get_paths() for x, _ in p.vertices}
        lines = {line.get_label(): list(line.get_xdata()) for line in ax.get_lines()}
    finally:
        plt.close(fig)
    assert stacked_x and min(stacked_x) == 1.0
    assert lines["step (total)"] == [1, 2, 3]
    # Validation: its own dashed line, not a band stacked on the step.
    assert lines["testing (apart from the step)"] == [1, 2, 3]
    assert len(ax.collections) == 3  # gen, old_log_prob, update_actor
