from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_pipeline.jobs.gpu_usage import NodeGpuSample, readings_from_summary
from verl_pipeline.jobs.progress import (
    GpuSummary,
    Progress,
    ProgressTracker,
    ProgressWatch,
    first_step_seen_at,
    metrics_file_due,
    parse_console_line,
    parse_jsonl_row,
    record_first_step,
)
from verl_pipeline.rundir import first_step_file


def test_verl_console_metric_line() -> None:
    line = ("(TaskRunnerV1 pid=4242) step:3 - training/global_step:3 - critic/score/mean:0.41 - "
            "perf/throughput:1317.6 - perf/time_per_step:6.2 - timing_s/gen:nan")
    step, metrics = parse_console_line(line) or (0, {})
    assert step == 3
    assert metrics == {"training/global_step": 3.0, "critic/score/mean": 0.41, "perf/throughput": 1317.6,
                       "perf/time_per_step": 6.2}
    assert parse_console_line("Training from scratch") is None
    assert parse_console_line("a log line that mentions step:3 in passing, then more words") is None


def test_verl_console_line_with_numpy_scalars() -> None:
    """verl 0.9.1 prints each value with pprint, and numpy 2 scalars print as their repr (seen on the H200)."""
    from tests.fakes.fake_verl_trainer import console_line

    line = ("(TaskRunnerV1 pid=12089) step:0 - val-aux/openai/gsm8k/reward/mean@1:np.float64(0.0) - "
            "val-core/openai/gsm8k/acc/mean@1:np.float64(0.0) - val-aux/num_turns/min:np.int64(2)")
    assert parse_console_line(line) == (0, {"val-aux/openai/gsm8k/reward/mean@1": 0.0,
                                            "val-core/openai/gsm8k/acc/mean@1": 0.0, "val-aux/num_turns/min": 2.0})
    t = ProgressTracker(total=2, clock=lambda: 5.0)
    assert not t.observe_console(line) and t.last is None  # validation: not the first step
    step = console_line({"training/global_step": 1, "perf/time_per_step": 293.35, "perf/throughput": 2380.6}, 1)
    assert parse_console_line(step) == (1, {"training/global_step": 1.0, "perf/time_per_step": 293.35,
                                            "perf/throughput": 2380.6})
    assert t.observe_console(step) and t.last is not None and t.last.seconds_per_step == 293.35
    assert parse_console_line("a log line that mentions step:3 in passing, then more words") is None


def test_verl_file_logger_row() -> None:
    row = json.dumps({"step": 7, "data": {"training/global_step": 7, "perf/throughput": 99.5, "note": "x"}})
    assert parse_jsonl_row(row) == (7, {"training/global_step": 7.0, "perf/throughput": 99.5})
    assert parse_jsonl_row('{"step": 8, "data": {"perf/thr') is None  # cut by a kill


def test_progress_line_reads_like_the_issue_asks() -> None:
    p = Progress(step=120, total=500, seconds_per_step=186.0,
                 metrics={"critic/score/mean": 0.41, "perf/throughput": 2310.0})
    assert p.line() == ("step 120/500 (24%) · 3.1 min/step · ETA 19 h 38 m · critic/score/mean 0.41 · "
                        "perf/throughput 2310")
    assert Progress(step=2, total=4).line() == "step 2/4 (50%)"
    assert Progress(step=10, total=1000, seconds_per_step=7200).line().startswith(
        "step 10/1000 (1%) · 2 h/step · ETA 82 d 12 h")
    assert Progress.from_dict(p.to_dict()) == p


def test_tracker_counts_each_step_once_and_averages_verls_step_time() -> None:
    t = ProgressTracker(total=10, clock=lambda: 7.0)
    assert t.observe(1, {"perf/time_per_step": 4.0, "perf/throughput": 10.0})
    assert t.observe(2, {"perf/time_per_step": 6.0})
    assert not t.observe(2, {"perf/time_per_step": 100.0})  # the same step again (other source)
    assert not t.observe(1, {})
    assert t.last == Progress(step=2, total=10, seconds_per_step=5.0, metrics={}, first_step_seen_at=7.0)
    resumed = ProgressTracker(total=10, last=t.last)  # a re-deferral carries the last progress
    assert not resumed.observe(2, {})
    assert resumed.observe(3, {"perf/time_per_step": 7.0})
    assert resumed.last is not None and resumed.last.seconds_per_step == 6.0


def test_a_row_of_validation_alone_is_no_step() -> None:
    """verl logs its validation before training at step 0, and a resumed run's at the step it resumed from."""
    t = ProgressTracker(total=4)
    assert not t.observe(0, {"val-core/openai/gsm8k/reward/mean@1": 0.02, "val-aux/num_turns/mean": 1.0})
    assert t.last is None
    assert not t.observe_console("(TaskRunner pid=8) step:0 - val-core/openai/gsm8k/reward/mean@1:0.02")
    assert not t.observe_console("(TaskRunner pid=8) step:0 - val-core/openai/gsm8k/reward/mean@1:<unparsed>")
    assert t.observe(1, {"training/global_step": 1.0, "val-core/openai/gsm8k/reward/mean@1": 0.1})
    assert t.last is not None and t.last.step == 1 and not t.last.reached_total
    assert t.observe(4, {"training/global_step": 4.0}) and t.last.reached_total


def test_the_first_training_step_is_dated_when_it_arrives(tmp_path: Path) -> None:
    """verl's file logger records no time with a row: the tracker dates the first training step it
    sees (a validation row is none), and a reattached waiter keeps the date it carries."""
    now = iter([500.0, 600.0, 700.0])
    t = ProgressTracker(total=4, clock=lambda: next(now))
    assert not t.observe(0, {"val-core/openai/gsm8k/reward/mean@1": 0.02})
    assert t.observe(1, {"training/global_step": 1.0})
    assert t.observe(2, {"training/global_step": 2.0})
    assert t.last is not None and t.last.first_step_seen_at == 500.0
    carried = Progress.from_dict(t.last.to_dict())
    assert carried == t.last
    again = ProgressTracker(total=4, last=carried, clock=lambda: 900.0)
    assert again.observe(3, {}) and again.last is not None and again.last.first_step_seen_at == 500.0
    undated = ProgressTracker(total=4, last=Progress(step=2, total=4), clock=lambda: 900.0)
    assert undated.observe(3, {}) and undated.last is not None and undated.last.first_step_seen_at is None

    metrics = tmp_path / "metrics-a1.jsonl"
    assert first_step_seen_at(metrics) is None
    assert record_first_step(metrics, t.last)
    assert not record_first_step(metrics, Progress(step=3, total=4, first_step_seen_at=900.0))  # the first stays
    assert first_step_seen_at(metrics) == 500.0
    assert first_step_file(metrics) == tmp_path / "metrics-a1.first-step.json"


def _node(node: str, *utils: int | None) -> NodeGpuSample:
    gpus = [{"index": i, "utilizationGpu": u, "memoryUsed": 90000, "memoryTotal": 143771} for i, u in enumerate(utils)]
    return NodeGpuSample(0.0, node, "10.0.0.1", readings_from_summary(gpus))


def test_the_progress_line_shows_the_gpus_mean_nodes_and_least_busy() -> None:
    summary = GpuSummary.of([_node("a", 80, 90, 95, 83), _node("b", 85, 86, None, 90)])
    assert summary is not None and summary.line() == "GPU 87% (2 nodes, min 80%)"
    one = GpuSummary.of([_node("a", 0), _node("cpu-only")])
    assert one is not None and one.line() == "GPU 0% (1 node, min 0%)"
    assert GpuSummary.of([_node("a", None)]) is None  # no utilisation read: nothing to show


def test_the_metrics_file_is_read_when_the_log_shows_a_step_the_file_has_not_given() -> None:
    def due(console: int | None, file: int | None, *, ended: bool = False, complete: bool = True) -> bool:
        return metrics_file_due(ended=ended, console_step=console, file_step=file, log_complete=complete)

    assert due(None, None) and due(None, 4)  # the log shows no step (yet, or no console logger): every poll
    assert due(5, None) and due(5, 4)  # the log is ahead of the file
    assert not due(5, 5) and not due(4, 5)  # the file gave every step the log showed: not this poll
    assert due(5, 5, ended=True)  # the job's last look reads whatever verl wrote last
    assert due(5, 5, complete=False)  # bytes were skipped or the read failed: a step's line may be missing


def test_the_stand_in_trainer_prints_its_console_lines_as_verl_does() -> None:
    pytest.importorskip("torch")
    import numpy as np
    from verl.utils.logger.aggregate_logger import concat_dict_to_str

    from tests.fakes.fake_verl_trainer import console_line

    metrics = {"training/global_step": 2, "critic/score/mean": 0.41, "perf/time_per_step": 6.2}
    verls = {k: v if isinstance(v, int) else np.float64(v) for k, v in metrics.items()}
    assert console_line(metrics, 2) == concat_dict_to_str(verls, 2)


# -- the progress part of a wait: ProgressWatch -------------------------------------------------------
def _console(step: int, seconds: float = 30.0) -> str:
    return f"(TaskRunner pid=7) step:{step} - training/global_step:{step} - perf/time_per_step:{seconds}"


def test_the_progress_part_reports_a_step_once_at_most_every_interval_and_the_last_step_always() -> None:
    watch = ProgressWatch(total=3, metrics_path=None, progress=None, metrics_offset=0, interval=60.0)
    assert watch.unreported() is None
    watch.observe_lines(["loading the model", _console(1)])
    first = watch.unreported()
    assert first is not None and first.step == 1 and watch.progress is not None and watch.progress["step"] == 1
    assert watch.line_due(first, now=100.0)
    assert watch.unreported() is None  # reported: nothing new
    watch.observe_lines([_console(2)])
    second = watch.unreported()
    assert second is not None and not watch.line_due(second, now=130.0)  # within the interval
    assert watch.line_due(second, now=130.0, final=True)  # the ended job's last step is logged
    watch.observe_lines([_console(3)])
    third = watch.unreported()
    assert third is not None and third.reached_total and watch.line_due(third, now=131.0)


def test_the_progress_part_reads_verls_metrics_file_from_its_cursor_and_resumes(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-a1.jsonl"
    rows = [json.dumps({"step": s, "data": {"training/global_step": s, "perf/throughput": 500.0 + s}}) for s in (1, 2)]
    metrics.write_text(rows[0] + "\n" + rows[1][:9])  # the second row is still being written
    watch = ProgressWatch(total=4, metrics_path=str(metrics), progress=None, metrics_offset=0, interval=0.0)
    assert watch.metrics_file_due(ended=False, log_complete=True)  # no step in the log yet: every read
    watch.observe_rows(watch.read_metrics())
    assert watch.metrics_offset_bytes == len(rows[0]) + 1
    watch.observe_lines([_console(1)])
    assert not watch.metrics_file_due(ended=False, log_complete=True)  # the file gave the log's step
    last = watch.unreported()
    assert last is not None and last.metrics == {"perf/throughput": 501.0}
    metrics.write_text("\n".join(rows) + "\n")
    again = ProgressWatch(total=4, metrics_path=str(metrics), progress=None, metrics_offset=0, interval=0.0)
    again.resume(watch.progress, watch.metrics_offset_bytes)  # a cursor an earlier waiter saved
    again.observe_rows(again.read_metrics())
    resumed = again.unreported()
    assert resumed is not None and resumed.step == 2 and again.metrics_offset_bytes == metrics.stat().st_size
    missing = ProgressWatch(total=4, metrics_path=str(tmp_path / "nowhere.jsonl"), progress=None, metrics_offset=0,
                            interval=0.0)
    assert missing.read_metrics() == [] and missing.metrics_offset_bytes == 0  # not written yet, or not mounted
