"""The plots' content, read back from real matplotlib axes."""

from __future__ import annotations

from typing import Any

from tests.report.rows import node_samples, verl_row
from verl_pipeline.report.build import AttemptInfo, StepRow
from verl_pipeline.report.gpu import collect
from verl_pipeline.report.plots import PLOTS, TIMING_PNG, _gpu_host, _pyplot, thinned


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


def test_a_hosts_gpu_plot_has_a_line_per_gpu_in_both_panels_and_the_training_window_shaded() -> None:
    """Utilisation and memory of each GPU over minutes since the first submit (here 1000), the 70%
    line on the utilisation panel, the training window as a band in both."""
    samples = node_samples("aaaa1111", "10.0.0.1", range(1060, 1600, 60), lambda t: 80.0, n_gpus=4)
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, sharex=True)
    try:
        _gpu_host(axes, collect(samples), [(1120.0, 1480.0)], [AttemptInfo(1, "job-a1", 1000.0, 0)], origin=1000.0)
        util = {line.get_label(): (list(line.get_xdata()), list(line.get_ydata())) for line in axes[0].get_lines()}
        memory = {line.get_label() for line in axes[1].get_lines()}
        bands = [(p.get_x(), p.get_x() + p.get_width()) for p in axes[0].patches]
    finally:
        plt.close(fig)
    gpus = {f"GPU {i}" for i in range(4)}
    assert gpus <= set(util) and gpus <= memory
    assert util["GPU 0"] == ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0], [80.0] * 9)
    assert util["70% (target: above)"][1] == [70.0, 70.0]
    assert bands == [(2.0, 8.0)]


def test_a_week_of_samples_is_drawn_as_the_means_of_equal_spans() -> None:
    """60,480 samples (a week, one every 10 s) become 2,000 points; a span without a reading stays a gap."""
    import math

    xs = [float(i) for i in range(60_480)]
    ys = [math.nan if 30_000 <= i < 30_100 else float(i % 2) * 100 for i in range(60_480)]
    tx, ty = thinned(xs, ys, 2000)
    assert len(tx) == len(ty) == 2000 and tx[0] == 14.5 and ty[0] == 50.0
    assert any(math.isnan(v) for v in ty) and abs(sum(v for v in ty if not math.isnan(v)) / 1999 - 50.0) < 1.0
    short = thinned([1.0, 2.0], [3.0, 4.0], 2000)
    assert list(short[0]) == [1.0, 2.0] and list(short[1]) == [3.0, 4.0]
