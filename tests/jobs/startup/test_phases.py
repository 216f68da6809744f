"""What a wait keeps of its job's start, alone: the phases from the marker lines, and the first step."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from tests.fakes.fake_verl_trainer import startup_lines
from verl_pipeline.jobs.progress import Progress, first_step_seen_at
from verl_pipeline.jobs.run_files import write_all
from verl_pipeline.jobs.startup.markers import MARKERS, PHASES, Phase
from verl_pipeline.jobs.startup.phases import StartupPhases, StartupWatch, skipped_phases
from verl_pipeline.rundir import startup_file


def _lines(resume: str = "Training from scratch", *, validate: bool = True) -> list[str]:
    return startup_lines(resume, validate=validate)


def test_the_stand_in_prints_a_line_for_each_marker_in_the_tables_order() -> None:
    """Fed one line a second, the stand-in's start ends every phase the table has a marker for, in order."""
    phases = StartupPhases()
    seen = []
    for t, line in enumerate(_lines(), start=1):
        seen += phases.observe(line, float(t))
    assert seen == [m.phase for m in MARKERS] and seen == list(PHASES[:-1])
    assert [phases.ended[p] for p in seen] == sorted(phases.ended[p] for p in seen)


def test_each_phase_lasts_from_the_end_of_the_one_before_and_an_unseen_one_is_unknown() -> None:
    phases = StartupPhases()
    lines = _lines(validate=False)
    for t, line in zip((20.0, 60.0, 100.0, 110.0, 112.0, 113.0, 115.0, 120.0), lines, strict=True):
        phases.observe(line, 1000.0 + t)
    phases.end(Phase.FIRST_STEP, 1200.0)
    times = {t.phase: t for t in phases.times(1000.0)}
    assert [times[p].duration_s for p in PHASES[:5]] == [20.0, 40.0, 40.0, 10.0, 10.0]
    # No validation before training: its line never came. It is unknown, and so is the first step's
    # length (it started when validation ended); when the first step came is still known.
    assert times[Phase.VALIDATION].duration_s is None and times[Phase.VALIDATION].ended_after_s is None
    assert (times[Phase.FIRST_STEP].duration_s, times[Phase.FIRST_STEP].ended_after_s) == (None, 200.0)
    assert [t.text() for t in phases.times(1000.0)][4:] == [
        "checkpoint load 10 s", "validation unknown", "first step unknown (done 200 s after submission)"]
    # Rendered without validation (a resume attempt): skipped, and the first step lasts from the checkpoint load.
    skipped = {t.phase: t for t in phases.times(1000.0, frozenset({Phase.VALIDATION}))}
    assert skipped[Phase.VALIDATION].skipped and skipped[Phase.VALIDATION].text() == "validation skipped"
    assert (skipped[Phase.FIRST_STEP].duration_s, skipped[Phase.FIRST_STEP].text()) == (80.0, "first step 80 s")
    # A phase whose line came anyway is timed as it ran, whatever was expected.
    assert not phases.times(1000.0, frozenset({Phase.MODEL_LOAD}))[1].skipped
    # Without the submission time the first phase's length is unknown too.
    assert phases.times(None)[0].duration_s is None and phases.times(None)[1].duration_s == 40.0


def test_the_last_of_several_engines_ends_a_phase_and_a_marker_out_of_order_is_ignored() -> None:
    phases = StartupPhases()
    phases.observe("GPU KV cache size: 1 tokens", 10.0)  # replica 0
    assert phases.observe("GPU KV cache size: 1 tokens", 14.0) == []  # replica 1: not new, but later
    assert phases.ended[Phase.ENGINE_START] == 14.0
    phases.observe("Graph capturing finished in 3 secs, took 0.2 GiB", 20.0)
    phases.observe("GPU KV cache size: 1 tokens", 30.0)  # after a later phase: ignored
    assert phases.ended[Phase.ENGINE_START] == 14.0
    assert phases.observe("create worker group dict_keys([])", 40.0) == []  # out of order: stays unknown
    assert Phase.WORKER_START not in phases.ended
    assert StartupPhases.from_dict(phases.to_dict()) == phases


def test_a_line_that_says_when_it_was_printed_ends_its_phase_then_not_at_its_read() -> None:
    """One read brings the whole start 9 s after its last stamped line: each phase the loggers stamped ends
    when its line was printed; validation's line (verl's print, no stamp) ends at the read."""
    submitted = 1_796_000_000.0  # 2026-11-30 00:53:20 UTC

    def verl(after_s: int, message: str) -> str:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(submitted + after_s))
        return f"(TaskRunnerV1 pid=7) INFO:{at},250:{message}"

    def vllm(after_s: int, message: str) -> str:
        at = time.strftime("%m-%d %H:%M:%S", time.gmtime(submitted + after_s))
        return f"(EngineCore pid=9) INFO {at} [kv_cache_utils.py:2146] {message}"

    lines = [verl(23, "create worker group dict_keys(['actor_rollout_ref'])"),
             verl(46, "actor and ref model engine initialized"),
             vllm(99, "GPU KV cache size: 9,560,512 tokens"), vllm(98, "GPU KV cache size: 9,560,512 tokens"),
             vllm(103, "Graph capturing finished in 4 secs, took 0.29 GiB"),
             verl(107, "all initialize finished, ready to fit"),
             "(TaskRunnerV1 pid=7) (\"Initial validation metrics: {'val-aux/openai/gsm8k/reward/mean@1': \""]
    phases = StartupPhases()
    assert phases.observe("\n".join(lines), submitted + 116.0) == list(PHASES[:-1])
    times = [t.duration_s for t in phases.times(submitted)][:6]
    # The two engines' lines came out of order: the later one ends the phase.
    assert times == pytest.approx([23.25, 23.0, 52.75, 4.0, 4.25, 8.75])


def _watch(metrics: Path | None, messages: list[str], skipped: frozenset[Phase] = frozenset()) -> StartupWatch:
    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    log = logging.getLogger(f"test.startup.{id(messages)}")
    log.setLevel(logging.INFO)
    log.addHandler(Keep())
    log.propagate = False
    return StartupWatch(job_id="j", metrics_path=str(metrics) if metrics else None, log=log, skipped=skipped)


def test_the_start_up_part_says_each_phase_and_the_summary_and_records_both(tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-a2.jsonl"
    messages: list[str] = []
    watch = _watch(metrics, messages)
    watch.resume(started=False)
    watch.started_at = 1000.0
    watch.observe_lines(_lines()[:2], 1030.0)
    assert messages == ["Ray job j start-up: worker start done 30 s after submission (worker start 30 s)",
                        "Ray job j start-up: model load done 30 s after submission (model load 0 s)"]
    assert write_all(watch.writes()) == [] and watch.writes() == []  # written once, until something changes
    again = _watch(metrics, [])  # a restarted triggerer's waiter of the same attempt
    again.resume(started=False)
    assert again.phases.ended == {Phase.WORKER_START: 1030.0, Phase.MODEL_LOAD: 1030.0}
    again.observe_lines(_lines()[:3], 1090.0)  # it reads again what the first one read: those stay as recorded
    assert again.phases.ended == {Phase.WORKER_START: 1030.0, Phase.MODEL_LOAD: 1030.0, Phase.ENGINE_START: 1090.0}
    watch.observe_lines(_lines()[2:], 1100.0)
    watch.first_step(Progress(step=1, total=4, first_step_seen_at=1160.0))
    assert messages[-1] == ("Ray job j start-up: first step 160 s after submission: worker start 30 s · model load "
                            "0 s · engine start 70 s · graph capture 0 s · checkpoint load 0 s · validation 0 s · "
                            "first step 60 s")
    assert write_all(watch.writes()) == []
    assert first_step_seen_at(metrics) == 1160.0 and StartupPhases.load(metrics).ended[Phase.FIRST_STEP] == 1160.0
    assert startup_file(metrics) == tmp_path / "metrics-a2.startup.json"
    watch.observe_lines(["create worker group"], 1200.0)  # the start is over: nothing more is watched
    assert len(messages) == len(MARKERS) + 1 and watch.writes() == []  # a line per phase, one summary


def test_a_waiter_that_reattaches_after_the_first_step_watches_nothing_and_keeps_the_first_record(
        tmp_path: Path) -> None:
    metrics = tmp_path / "metrics-a1.jsonl"
    first = _watch(metrics, [])
    first.first_step(Progress(step=1, total=4, first_step_seen_at=500.0))
    write_all(first.writes())
    later = _watch(metrics, messages := [])
    later.resume(started=True)
    later.observe_lines(_lines(), 900.0)
    later.first_step(Progress(step=3, total=4, first_step_seen_at=900.0))
    assert write_all(later.writes()) == [] and first_step_seen_at(metrics) == 500.0 and messages == []
    unrecorded = _watch(None, [])
    unrecorded.first_step(Progress(step=1, total=4, first_step_seen_at=500.0))
    assert unrecorded.writes() == []


def test_a_resume_rendered_without_validation_says_skipped_and_times_the_first_step_from_the_phase_before(
        tmp_path: Path) -> None:
    messages: list[str] = []
    watch = _watch(tmp_path / "metrics-a2.jsonl", messages, skipped=skipped_phases({"trainer.val_before_train": False}))
    watch.resume(started=False)
    watch.started_at = 1000.0
    watch.observe_lines(_lines("Resuming from global_step_3", validate=False), 1100.0)
    watch.first_step(Progress(step=4, total=6, first_step_seen_at=1150.0))
    assert messages[-1].endswith("checkpoint load 0 s · validation skipped · first step 50 s")
    # Any spelling, and the first layer that sets it decides (an attempt's decision, then the run's settings).
    assert skipped_phases(None, {"trainer": {"val_before_train": "false"}}) == {Phase.VALIDATION}
    assert skipped_phases({}, {"+trainer.val_before_train": False}) == {Phase.VALIDATION}
    assert skipped_phases({"trainer.val_before_train": True}, {"trainer.val_before_train": False}) == frozenset()
    assert skipped_phases(None, None) == frozenset()
