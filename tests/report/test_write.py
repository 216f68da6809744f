"""A run directory in, report.json + PNG plots + report.html out (real files, real matplotlib)."""

from __future__ import annotations

import json
import os
import re
import struct
from pathlib import Path

from tests.report.rows import node_samples, verl_row
from verl_pipeline.jobs.gpu_usage import append_samples
from verl_pipeline.jobs.progress import Progress, record_first_step
from verl_pipeline.jobs.startup.markers import Phase
from verl_pipeline.jobs.startup.phases import StartupPhases
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.report.build import RunOutcome
from verl_pipeline.report.plots import RESPONSE_LENGTH_PNG, REWARD_PNG, THROUGHPUT_PNG, TIMING_PNG, gpu_png
from verl_pipeline.report.write import write_report
from verl_pipeline.rundir import Attempt, RunDir, actor_starts_file, startup_file

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    """Width and height from the PNG's IHDR chunk (which must come first)."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR", path
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def _run_dir(root: Path, key: str, *, nnodes: int = 1, mode: str = "train") -> Path:
    run_dir = root / "runs" / key
    run_dir.mkdir(parents=True)
    spec = {"run_name": f"verl_ppo/{key}", "profile": "gsm8k", "nnodes": nnodes, "n_gpus_per_node": 8,
            "total_training_steps": 6, "mode": "auto", "storage_root": str(root), "hardware": {"gpu_memory_gb": 80}}
    (run_dir / "run_spec.json").write_text(json.dumps(spec))
    (run_dir / "job.json").write_text(json.dumps({"mode": mode}))
    return run_dir


def _log(run_dir: Path, attempt: int, steps: range, *, resume_from: int, **row: float) -> None:
    RunDir(run_dir).record_attempt(Attempt(f"job-a{attempt}", attempt, 1000.0 + attempt, "http://d", resume_from,
                                    str(RunDir(run_dir).metrics_file(attempt))))
    lines = [json.dumps({"step": s, "data": verl_row(s, attempt, **row).metrics}) for s in steps]
    # the last line cut by a kill
    RunDir(run_dir).metrics_file(attempt).write_text("\n".join(lines) + '\n{"step": 9, "da')


def test_a_resumed_training_run_gets_plots_html_and_json(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "r1")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    _log(run_dir, 2, range(3, 7), resume_from=2)
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED)
    out = files.to_dict()
    assert out["report_dir"] == str(run_dir / "report") and out["html"] == str(run_dir / "report" / "report.html")
    assert out["steps_done"] == 6 and out["status"] == "succeeded"
    plots = [REWARD_PNG, RESPONSE_LENGTH_PNG, THROUGHPUT_PNG, TIMING_PNG]
    assert out["plots"] == sorted(plots)
    for name in plots:
        width, height = _png_size(run_dir / "report" / name)
        assert width > 100 and height > 100 and (run_dir / "report" / name).stat().st_size > 1000
    html = (run_dir / "report" / "report.html").read_text()
    assert set(re.findall(r'<img src="([^"]+)"', html)) == set(plots)  # relative names, same directory
    assert "6 / 6" in html and "job-a2" in html and "Steps redone after resuming: 1." in html
    data = json.loads((run_dir / "report" / "report.json").read_text())
    assert data["steps_done"] == 6 and [a["resumed_from_step"] for a in data["attempts"]] == [0, 2]
    assert data["scaling_point"]["nnodes"] == 1


def test_a_later_run_at_more_nodes_is_compared_with_the_earlier_report(tmp_path: Path) -> None:
    first = _run_dir(tmp_path, "one-node")
    _log(first, 1, range(1, 7), resume_from=0)
    write_report(first, status=RunOutcome.SUCCEEDED, plots=False)
    second = _run_dir(tmp_path, "two-nodes", nnodes=2)
    _log(second, 1, range(1, 7), resume_from=0, step_s=9.0, gen=2.0)  # slower steps: 67% of linear
    files = write_report(second, status=RunOutcome.SUCCEEDED, plots=False)
    (comparison,) = files.report.comparisons
    assert comparison.other_run_key == "one-node" and comparison.efficiency == round(6 / 9, 3)
    assert files.to_dict()["flags"] == ["per_gpu_throughput_falls"]
    html = files.html.read_text()
    assert "67%" in html and "NCCL_IB_HCA" in html


def test_a_preflight_run_reports_no_steps_and_its_checks(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "pre", mode="preflight")
    RunDir(run_dir).record_attempt(Attempt("job-a1", 1, 1000.0, "http://d", 0, str(RunDir(run_dir).metrics_file(1))))
    summary = {"ok": True, "checks": {"verl_config": {"ok": True, "n_gpus": 8}, "reward": {"ok": True}}}
    (run_dir / "preflight.json").write_text(json.dumps(summary))
    files = write_report(run_dir)  # no status given: the preflight summary says it passed
    assert files.to_dict()["status"] == "succeeded" and files.to_dict()["plots"] == []
    html = files.html.read_text()
    assert "No training steps: this was a preflight run" in html and "Preflight checks" in html
    assert "verl accepted the configuration for 8 GPU(s)" in html and "<img" not in html


def test_a_new_segment_after_a_merge_is_reported_at_its_run_steps_and_marked(tmp_path: Path) -> None:
    """After a merge on a changed world size, attempt 2 trains segment 2 from run step 4: verl logs its
    steps from 1, the report places them at run steps 5 and 6 and marks the segment."""
    run_dir = _run_dir(tmp_path, "seg")
    _log(run_dir, 1, range(1, 5), resume_from=0)
    RunDir(run_dir).record_attempt(Attempt("job-a2", 2, 1002.0, "http://d", 4, str(RunDir(run_dir).metrics_file(2)),
                                    segment=2, segment_start_step=4))
    RunDir(run_dir).metrics_file(2).write_text("".join(
        json.dumps({"step": s, "data": verl_row(s, 2).metrics}) + "\n" for s in (1, 2)))
    out = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False).to_dict()
    assert out["steps_done"] == 6
    data = json.loads((run_dir / "report" / "report.json").read_text())
    second = data["attempts"][1]
    assert (second["first_step"], second["last_step"], second["segment"]) == (5, 6, 2)
    assert "2: merged weights, optimizer state lost" in (run_dir / "report" / "report.html").read_text()


def test_the_html_shows_validation_apart_from_the_steps_phase_shares(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "val")
    _log(run_dir, 1, range(1, 4), resume_from=0, **{"timing_s/testing": 2.0})
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED)
    html = files.html.read_text()
    shares = [int(p) for p in re.findall(r"\((\d+)% of all step time\)", html)]
    assert shares and sum(shares) <= 100
    assert "timing_s/testing (validation)" in html and "Timed apart from the step" in html
    assert TIMING_PNG in files.to_dict()["plots"]


def test_each_attempt_shows_the_seconds_from_its_submission_to_its_first_step(tmp_path: Path) -> None:
    """What a resume costs: attempt 1 (submitted at 1001) first stepped at 1091, attempt 2 (at 1002)
    at 1302; an attempt no reader saw step says so."""
    run_dir = _run_dir(tmp_path, "ttfs")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    _log(run_dir, 2, range(3, 7), resume_from=2)
    _log(run_dir, 3, range(0), resume_from=6)
    for attempt, seen in ((1, 1091.0), (2, 1302.0)):
        record_first_step(RunDir(run_dir).metrics_file(attempt), Progress(step=1, total=6, first_step_seen_at=seen))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    data = json.loads(files.json.read_text())
    assert [a["time_to_first_step_s"] for a in data["attempts"]] == [90.0, 300.0, None]
    html = files.html.read_text()
    assert "submit to first step" in html and "1 m 30 s" in html and "5 m 0 s" in html
    assert "verl's file logger records no time" in html


def test_each_attempt_shows_its_start_phase_by_phase_and_unknown_where_a_line_was_not_seen(tmp_path: Path) -> None:
    """Attempt 1 (submitted at 1001) saw every line; attempt 2 (at 1002, a resume) lost its waiter's
    records before the engine started: what it did not see is unknown, not zero."""
    run_dir = _run_dir(tmp_path, "phases")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    _log(run_dir, 2, range(3, 7), resume_from=2)
    ends = dict(zip(list(Phase)[:-1], (1021.0, 1061.0, 1101.0, 1111.0, 1116.0, 1131.0), strict=True))
    write_json_atomic(startup_file(RunDir(run_dir).metrics_file(1)), StartupPhases(ends).to_dict())
    write_json_atomic(startup_file(RunDir(run_dir).metrics_file(2)),
                      StartupPhases({Phase.WORKER_START: 1012.0, Phase.MODEL_LOAD: 1032.0}).to_dict())
    for attempt, seen in ((1, 1191.0), (2, 1302.0)):
        record_first_step(RunDir(run_dir).metrics_file(attempt), Progress(step=1, total=6, first_step_seen_at=seen))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    first, second = json.loads(files.json.read_text())["attempts"]
    assert [p["duration_s"] for p in first["startup"]] == [20.0, 40.0, 40.0, 10.0, 5.0, 15.0, 60.0]
    assert [p["duration_s"] for p in second["startup"]] == [10.0, 20.0, None, None, None, None, None]
    assert second["startup"][-1]["ended_after_s"] == 300.0  # when its first step came is still known
    html = files.html.read_text()
    assert "Start-up, phase by phase" in html and "<th>graph capture</th>" in html
    assert "<td>60 s</td>" in html and "<td>unknown</td>" in html and "unknown (done at 300 s)" in html


def test_each_attempts_actors_show_by_class_where_ray_recorded_them(tmp_path: Path) -> None:
    """Attempt 1's waiter recorded how its actors came up; attempt 2's did not (no table row, not zeros)."""
    from tests.jobs.startup.test_actors import SUBMITTED, _task, _worker
    from verl_pipeline.jobs.startup import actors

    run_dir = _run_dir(tmp_path, "actors")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    _log(run_dir, 2, range(3, 7), resume_from=2)
    tasks = [_task("TaskRunner", "t0", asked=24, running=26, loaded=50, finished=50.1),  # no worker record
             *(_task("WorkerDict", f"w{i}", asked=57, running=60, loaded=85 + 9 * i, finished=90 + 9 * i)
               for i in range(2))]
    workers = [_worker(f"w{i}", launch=57.5, ready=59.5) for i in range(2)]
    write_json_atomic(actor_starts_file(RunDir(run_dir).metrics_file(1)),
                      actors.to_record(actors.from_ray(tasks, workers, SUBMITTED)))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    first, second = json.loads(files.json.read_text())["attempts"]
    assert [(a["cls"], a["load_s"]) for a in first["actors"]] == [("TaskRunner", 24.0), ("WorkerDict", 25.0),
                                                                  ("WorkerDict", 34.0)]
    assert second["actors"] is None
    html = files.html.read_text()
    assert "Ray actors of each start" in html
    assert ("<tr><td>1</td><td>WorkerDict</td><td>2</td><td>10.0.0.2</td><td>57 s</td><td>1 s</td><td>2 s</td>"
            "<td>30 s (slowest 34 s)</td><td>5 s</td><td>99 s</td></tr>") in html
    assert "<td>TaskRunner</td><td>1</td><td>10.0.0.2</td><td>24 s</td><td>unknown</td><td>unknown</td>" in html


def _trained_between(run_dir: Path, first_seen: float, last_row: float) -> None:
    """Attempt 1 (submitted at 1001) logged steps 1-6; its waiter saw step 1 at ``first_seen``, the
    file's last row was written at ``last_row``."""
    _log(run_dir, 1, range(1, 7), resume_from=0)
    record_first_step(RunDir(run_dir).metrics_file(1), Progress(step=1, total=6, first_step_seen_at=first_seen))
    os.utime(RunDir(run_dir).metrics_file(1), (last_row, last_row))


def test_gpu_readings_of_two_nodes_give_a_row_per_gpu_a_plot_per_host_and_the_flag_for_the_idle_ones(
        tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "gpus", nnodes=2)
    _trained_between(run_dir, 1100.0, 1400.0)
    times = range(1010, 1500, 10)
    append_samples(RunDir(run_dir).gpu_usage_file, [
        *node_samples("aaaa1111", "10.0.0.1", times, lambda t: 92.0 if 1100 <= t <= 1400 else 3.0, n_gpus=8),
        *node_samples("bbbb2222", "10.0.0.2", times, lambda t: 35.0 if 1100 <= t <= 1400 else 3.0, n_gpus=8)])
    with RunDir(run_dir).gpu_usage_file.open("a") as f:
        f.write('{"time": 1490, "node_id": "cccc')  # a writer killed mid-line
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED)
    out = files.to_dict()
    assert out["flags"] == ["gpu_utilization_low"]
    assert {gpu_png(1), gpu_png(2)} <= set(out["plots"])
    for name in (gpu_png(1), gpu_png(2)):
        width, height = _png_size(run_dir / "report" / name)
        assert width > 100 and height > 100 and (run_dir / "report" / name).stat().st_size > 1000
    data = json.loads(files.json.read_text())
    assert [(g["label"], g["samples_in_window"], g["mean_utilization_pct"]) for g in data["gpus"]] \
        == [(f"10.0.0.1 GPU {i}", 31, 92.0) for i in range(8)] + [(f"10.0.0.2 GPU {i}", 31, 35.0) for i in range(8)]
    assert data["gpu_plots"] == {"10.0.0.1": gpu_png(1), "10.0.0.2": gpu_png(2)}
    (flag,) = data["flags"]
    assert "8 of 16 GPU(s)" in flag["evidence"] and "10.0.0.2 GPU 0: 35% on average" in flag["evidence"]
    assert "10.0.0.1" not in flag["evidence"]
    html = files.html.read_text()
    assert "GPU utilisation per GPU" in html and "35% (low)" in html and "92%" in html and "GPU-10.0.0.2-7" in html
    assert "58.6 / 80.0 GiB (73%)" in html  # the busiest GPU: 60,007 of 81,920 MiB
    assert set(re.findall(r'<img src="(gpu_node_[^"]+)"', html)) == {gpu_png(1), gpu_png(2)}
    assert "gpu_utilization_low" in html and "use_remove_padding" in html


def test_a_run_without_gpu_readings_says_so_with_no_gpu_plot_or_flag(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "cpu")
    _trained_between(run_dir, 1100.0, 1400.0)
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED)
    assert files.to_dict()["flags"] == [] and not list((run_dir / "report").glob("gpu_node_*"))
    assert json.loads(files.json.read_text())["gpus"] == []
    html = files.html.read_text()
    assert "No GPU readings" in html and "gpu_node_" not in html and "No flag" in html


def test_a_run_whose_gradient_stayed_0_is_flagged_in_its_report(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "flat")
    _log(run_dir, 1, range(1, 5), resume_from=0, **{"actor/grad_norm": 0.0})
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    assert files.to_dict()["flags"] == ["grad_norm_zero"]
    html = files.html.read_text()
    assert "actor/grad_norm was 0 at all 4 training step(s)" in html and "entropy_coeff" in html


def test_a_resume_rendered_without_validation_shows_it_skipped_and_times_the_first_step_from_the_phase_before(
        tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "skipped")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    _log(run_dir, 2, range(3, 7), resume_from=2)
    RunDir(run_dir).record_decision({"attempt": 2, "settings": {"trainer.val_before_train": False}})
    ends = dict(zip(list(Phase)[:5], (1022.0, 1042.0, 1102.0, 1112.0, 1112.0), strict=True))
    write_json_atomic(startup_file(RunDir(run_dir).metrics_file(2)), StartupPhases(ends).to_dict())
    record_first_step(RunDir(run_dir).metrics_file(2), Progress(step=3, total=6, first_step_seen_at=1162.0))
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    first, second = json.loads(files.json.read_text())["attempts"]
    assert first["startup_skipped"] == [] and second["startup_skipped"] == ["validation"]
    assert [(p["phase"], p["duration_s"], p["skipped"]) for p in second["startup"][-2:]] == [
        ("validation", None, True), ("first_step", 50.0, False)]
    assert "<td>skipped</td>" in files.html.read_text()


def test_an_idle_gpus_remedy_is_read_against_the_jobs_own_settings(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "fast")
    # job.json as RenderedJob.to_dict writes it: the overrides and the settings they were rendered from.
    (run_dir / "job.json").write_text(json.dumps({"mode": "train", "overrides": [
        "actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.model.use_remove_padding=true",
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=15360"], "settings": {
        "actor_rollout_ref.actor.use_dynamic_bsz": True, "actor_rollout_ref.model.use_remove_padding": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": 15360}}))
    _trained_between(run_dir, 1100.0, 1400.0)
    append_samples(RunDir(run_dir).gpu_usage_file,
                   node_samples("aaaa1111", "10.0.0.1", range(1010, 1500, 10), lambda t: 16.0, n_gpus=1))
    (flag,) = json.loads(write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False).json.read_text())["flags"]
    assert flag["kind"] == "gpu_utilization_low"
    assert "This job already has actor_rollout_ref.actor.use_dynamic_bsz=true, " \
           "actor_rollout_ref.model.use_remove_padding=true" in flag["remedy"]
    assert "larger micro batches" not in flag["remedy"] and "a larger actor_rollout_ref.actor.ppo_max" in flag["remedy"]


def test_the_evaluation_and_the_promotion_verdict_are_in_the_report(tmp_path: Path) -> None:
    from verl_pipeline.promotion import PromotionRule, decide
    from verl_pipeline.scores import Engine, Evaluation, Example, ModelScore, Role

    run_dir = _run_dir(tmp_path, "r-eval")
    _log(run_dir, 1, range(1, 4), resume_from=0)
    ev = Evaluation(data_path="/d/val.parquet", data_hash="0123456789abcdef", split="val", engine=Engine.TRANSFORMERS,
                    sampling={"temperature": 0.0, "max_new_tokens": 8}, rows_total=10,
                    models={Role.TRAINED: ModelScore("/r/model", 0.625, 0.5, 7.0, 8,
                                                     (Example("Repeat the digit 3", "333 <b>", "3", 1.0),)),
                            Role.BASE: ModelScore("/m/base", 0.125, 0.0, 8.0, 8)},
                    errors={"champion": "its model directory is gone"})
    RunDir(run_dir).save_evaluation(ev.to_dict())
    verdict = decide(PromotionRule(), ev, champion_run=None)
    RunDir(run_dir).save_promotion(verdict.to_dict())
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    data = json.loads(files.json.read_text())
    assert data["evaluation"]["models"]["trained"]["mean_reward"] == 0.625 and data["evaluation"]["smoke"] is True
    assert data["promotion"]["promoted"] is True and data["promotion"]["kind"] == "win"
    html = files.html.read_text()
    section = html[html.index("<h2>Evaluation</h2>"):]
    assert verdict.line() in section and "a smoke evaluation" in section and "8 of 10 rows" in section
    assert "0.625" in section and "50%" in section and "not scored: its model directory is gone" in section
    assert "333 &lt;b&gt;" in section  # responses are escaped


def test_a_run_without_an_evaluation_has_no_evaluation_section(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path, "r-noeval")
    _log(run_dir, 1, range(1, 3), resume_from=0)
    files = write_report(run_dir, status=RunOutcome.SUCCEEDED, plots=False)
    assert "<h2>Evaluation</h2>" not in files.html.read_text()
    assert json.loads(files.json.read_text())["evaluation"] is None
