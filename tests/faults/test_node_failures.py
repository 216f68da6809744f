"""Real failures on a real 2-node Ray cluster (two `ray start` nodes on this host), through the real DAG.

Each scenario asserts the outcome, the checkpoints, and that no Ray or trainer process survives.
Recovery times (kill → the resumed attempt logging its first step) are written to
.work/fault-recovery.json; bench/fault_recovery.py reports them.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ray_processes
from tests.faults.conftest import (
    FAKE_TRAINER,
    HANG_AFTER_STEP,
    HANG_STALL_TIMEOUT,
    KILL_AT_STEP,
    SAVE_FREQ,
    TOTAL_STEPS,
    Killer,
    gate_path,
    kill_node,
    load_dag,
    metric_lines,
    record_result,
    run_dir,
)
from verl_pipeline.durations import parse_duration
from verl_pipeline.rundir import RunDir

pytestmark = pytest.mark.integration


def _states(dr: Any) -> dict[str, str]:
    return {ti.task_id: str(ti.state) for ti in dr.get_task_instances()}


def _tries(dr: Any, task_id: str) -> int:
    return next(int(ti.try_number) for ti in dr.get_task_instances() if ti.task_id == task_id)


def _no_leftovers(rd: Path) -> None:
    temp_dirs = set()
    for name in ("cluster.json", "cluster.stopped.json"):
        if (rd / name).exists():
            temp_dirs.add(json.loads((rd / name).read_text())["extra"]["temp_dir"])
    assert temp_dirs
    for td in temp_dirs:
        assert ray_processes(td) == [], f"Ray processes left in {td}"
    import psutil

    # This run's trainers only (their overrides name its home): other tests may train at the same time.
    home = str(rd.parent.parent)
    trainers = [p.pid for p in psutil.process_iter(["cmdline"])
                if str(FAKE_TRAINER) in (cmd := " ".join(p.info["cmdline"] or [])) and home in cmd]
    assert trainers == [], "trainer processes left behind"


def _checkpoints_intact(home: Path) -> list[int]:
    """The steps whose checkpoint still holds its models, each written at its own step: the run keeps its
    newest 2 (the default), so the last attempt's older saves are pruned to their data.pt as verl prunes
    them, and the pipeline removed the attempt before's past its 2 when it retried."""
    (ckpt,) = list((home / "checkpoints").glob("*"))
    steps = sorted(int(p.name.split("_")[-1]) for p in ckpt.glob("global_step_*") if (p / "actor").is_dir())
    for s in steps:
        for role in ("actor", "critic"):
            data = json.loads((ckpt / f"global_step_{s}" / role / "model_world_size_1_rank_0.pt").read_text())
            assert data == {"step": s}
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(TOTAL_STEPS)
    return steps


def _resumed_run(fault_env: Path, results_file: Path, scenario: str, rank: int) -> None:
    dag = load_dag()
    killer = Killer(fault_env, at_step=KILL_AT_STEP, kill=kill_node(rank))
    thread = killer.start()
    dr = dag.test(run_conf={"profile": "faults"})
    thread.join(timeout=5)
    assert killer.error is None
    assert killer.killed_at is not None, "the job finished before the kill"
    states = _states(dr)
    assert str(dr.state) == "success", states
    assert _tries(dr, "wait_for_verl_job") == 1  # restarted within its try: Airflow's retries untouched

    rd = run_dir(fault_env)
    assert rd is not None
    attempts = RunDir(rd).attempts()
    assert [a.attempt for a in attempts] == [1, 2]
    # The lost attempt had moved the checkpoint on: a restart after progress, the whole budget left.
    (restart,) = RunDir(rd).restart_records()
    assert (restart["attempt"], restart["outcome"], restart["progressed"], restart["left"]) == (1, "restart", True, 2)
    first = [m["step"] for m in metric_lines(rd / "metrics-a1.jsonl")]
    second = [m["step"] for m in metric_lines(rd / "metrics-a2.jsonl")]
    resumed = attempts[1].resume_from_step
    assert resumed >= SAVE_FREQ and resumed % SAVE_FREQ == 0
    assert second[0] == resumed + 1 and second[-1] == TOTAL_STEPS
    redone = max(first) - resumed
    assert 0 <= redone <= SAVE_FREQ
    # A node was lost: the restart probes the nodes again, never reusing what the lost node answered.
    assert [d["rules"]["probe"].startswith("'ran (job ") for d in RunDir(rd).decisions()] == [True, True]
    kept = _checkpoints_intact(fault_env)
    assert kept[-2:] == [TOTAL_STEPS - SAVE_FREQ, TOTAL_STEPS] and len(kept) <= 2 * 2
    assert set(kept) <= set(range(SAVE_FREQ, TOTAL_STEPS + 1, SAVE_FREQ))
    # Each attempt's start, phase by phase, from the lines the stand-in prints as verl and vLLM do: the
    # waiter saw every phase end, in order, the resume's too, which skips validation before training
    # (the pipeline's rule for a resume attempt, trainer/nodes/warmstart.py): that phase is unknown, not guessed.
    report = json.loads((rd / "report" / "report.json").read_text())
    for attempt in report["attempts"]:
        skipped = {"validation"} if attempt["resumed_from_step"] else set()
        ends = [p["ended_after_s"] for p in attempt["startup"] if p["phase"] not in skipped]
        assert None not in ends and ends == sorted(ends), attempt["startup"]
        assert all(p["ended_after_s"] is None for p in attempt["startup"] if p["phase"] in skipped)
        # Skipped, not unknown: the job was rendered without it, and the first step counts from the phase before.
        assert {p["phase"] for p in attempt["startup"] if p["skipped"]} == skipped
        assert all(p["duration_s"] is not None for p in attempt["startup"] if p["phase"] not in skipped)
        # How each actor of the start came up, as Ray recorded it (read at the attempt's first step, while
        # the actors were alive): the stand-in's worker group and its tracking actor, each one ready.
        actors = attempt["actors"]
        assert sorted(a["cls"] for a in actors) == ["RolloutWorker", "RolloutWorker", "TrackingRunner"], actors
        assert all(a["ready_s"] is not None and not a["failed"] and a["asked_s"] <= a["ready_s"]
                   and None not in (a["before_s"], a["process_s"], a["load_s"], a["init_s"]) for a in actors), actors
    _no_leftovers(rd)
    # The critic's section covers both attempts (the stand-in's value loss is a function of the run's step).
    critic = json.loads((rd / "report" / "report.json").read_text())["critic"]
    assert critic["trends"]["critic/vf_loss"]["first_step"] == 1
    assert critic["trends"]["critic/vf_loss"]["final_step"] == TOTAL_STEPS
    assert (rd / "report" / "critic.png").is_file()
    record_result(results_file, scenario, {"recovery_s": killer.recovery_s, "killed_after_step": max(first),
                                           "resumed_from_step": resumed, "steps_redone": redone})


def test_worker_node_killed_mid_job_resumes_from_checkpoint(fault_env: Path, results_file: Path) -> None:
    _resumed_run(fault_env, results_file, "worker node killed", rank=1)


def test_head_node_killed_mid_job_reprovisions_and_resumes(fault_env: Path, results_file: Path) -> None:
    _resumed_run(fault_env, results_file, "head node killed", rank=0)


def test_a_hang_with_every_node_alive_is_stopped_and_resumed(fault_env: Path, results_file: Path,
                                                              capfd: pytest.CaptureFixture[str]) -> None:
    """The job stops making steps while RUNNING (a collective waiting forever): the watchdog ends the
    wait after the stall timeout, the job is stopped, and the retry resumes from the last checkpoint."""
    dag = load_dag()
    dr = dag.test(run_conf={"profile": "faults-hang"})
    out = capfd.readouterr()
    states = _states(dr)
    assert str(dr.state) == "success", states
    assert _tries(dr, "wait_for_verl_job") == 1
    rd = run_dir(fault_env)
    assert rd is not None
    attempts = RunDir(rd).attempts()
    assert [a.attempt for a in attempts] == [1, 2]
    reason = RunDir(rd).stop_reason(attempts[0].submission_id)
    assert reason is not None and reason.startswith("hang: no training step for ") and \
        reason.endswith(f", last step {HANG_AFTER_STEP}"), reason
    assert f"[infrastructure failure: {reason}]" in out.out + out.err
    first = [m["step"] for m in metric_lines(rd / "metrics-a1.jsonl")]
    second = [m["step"] for m in metric_lines(rd / "metrics-a2.jsonl")]
    assert max(first) == HANG_AFTER_STEP
    resumed = attempts[1].resume_from_step
    assert second[0] == resumed + 1 and second[-1] == TOTAL_STEPS
    redone = HANG_AFTER_STEP - resumed
    assert 0 <= redone <= SAVE_FREQ  # the hang costs the stall timeout and at most one save interval
    # Only attempt 2 ran to the end: the hung job was stopped, not left behind.
    assert attempts[0].submission_id not in out.out.split("Training of ")[-1]
    _no_leftovers(rd)
    hung_s = attempts[1].submitted_at - attempts[0].submitted_at
    record_result(results_file, "hang with every node alive", {
        "stall_timeout_s": parse_duration(HANG_STALL_TIMEOUT), "attempt_gap_s": round(hung_s, 1),
        "hung_after_step": HANG_AFTER_STEP, "resumed_from_step": resumed, "steps_redone": redone})


def test_a_run_that_crashes_before_its_first_step_three_times_fails_with_one_clear_line(
        fault_env: Path, results_file: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Every attempt's trainer is SIGKILLed before its first step (an infrastructure failure that makes
    no progress): the budget's default of 2 restarts in a row without progress restarts attempts 1 and
    2, and attempt 3 fails the run without retries, its one line naming the budget."""
    started = time.monotonic()
    dr = load_dag().test(run_conf={"profile": "faults-crash-before-first-step"})
    took = round(time.monotonic() - started, 1)
    out = capfd.readouterr()
    states = _states(dr)
    assert str(dr.state) == "failed", states
    assert states["wait_for_verl_job"] == "failed" and _tries(dr, "wait_for_verl_job") == 1
    assert states["teardown_ray_cluster"] == "success" and states["report_run"] == "success"
    rd = run_dir(fault_env)
    assert rd is not None
    attempts = RunDir(rd).attempts()
    assert [a.attempt for a in attempts] == [1, 2, 3]
    assert all(metric_lines(rd / f"metrics-a{a.attempt}.jsonl") == [] for a in attempts)
    decided = [(r["attempt"], r["outcome"], r["no_progress"], r["left"], r["delay_s"])
               for r in RunDir(rd).restart_records()]
    assert decided == [(1, "restart", 1, 1, 2.0), (2, "restart", 2, 0, 2.0), (3, "exhausted", 3, 0, 0.0)]
    # The task's error: one line, the failure, what the budget says, and what to do.
    lines = {line[line.index("Ray job "):] for line in (out.out + out.err).splitlines()
             if "the restart budget is used up" in line and "Ray job " in line}
    assert len(lines) == 1, lines
    (line,) = lines
    assert f"Ray job {attempts[2].submission_id} ended FAILED [infrastructure failure: worker killed (OOM or " \
           "signal)]" in line
    assert ("not restarted, the restart budget is used up: attempt 3 ended before its first training step "
            "(checkpoint still at step 0); 3 attempts in a row made no progress and restarts.no_progress_limit "
            "is 2") in line
    report = json.loads((rd / "report" / "report.json").read_text())
    assert report["status"] == "failed" and report["restarts"]["exhausted"] is True
    # The same nodes each time and a killed process: the restarts reuse attempt 1's probe (jobs/reprobe.py).
    probes = [d["rules"]["probe"] for d in RunDir(rd).decisions()]
    assert probes[0].startswith("'ran (job ") and len(probes) == 3, probes
    first_probe = probes[0].split("(job ")[1].split(")")[0]
    assert all(p.startswith(f"'reused probe job {first_probe}: the same 1 node(s) and GPUs") for p in probes[1:]), \
        "|".join(p[:120] for p in probes)
    _no_leftovers(rd)
    record_result(results_file, "trainer killed before its first step, every attempt", {
        "attempts": len(attempts), "restarts": 2, "dag_run_s": took,
        "note": f"failed after attempt 3: {line[line.index('not restarted'):][:120]}…"})


@pytest.mark.parametrize(
    ("profile", "reason"),
    [("faults-config-error", "configuration rejected"), ("faults-user-exception", "exception in user code")],
)
def test_user_failures_are_not_retried(
    fault_env: Path, profile: str, reason: str, capfd: pytest.CaptureFixture[str]
) -> None:
    dag = load_dag()
    dr = dag.test(run_conf={"profile": profile})
    out = capfd.readouterr()
    assert f"user failure: {reason}" in out.out + out.err
    states = _states(dr)
    assert str(dr.state) == "failed"
    assert states["wait_for_verl_job"] == "failed"
    assert _tries(dr, "wait_for_verl_job") == 1
    assert states["teardown_ray_cluster"] == "success"
    rd = run_dir(fault_env)
    assert rd is not None
    assert len(RunDir(rd).attempts()) == 1
    # A failed run gets its report too, saying it failed.
    assert states["report_run"] == "success"
    assert json.loads((rd / "report" / "report.json").read_text())["status"] == "failed"
    _no_leftovers(rd)


def test_killed_waiter_reattaches_and_exactly_one_job_runs(fault_env: Path, results_file: Path) -> None:
    """The process waiting on the job dies mid-run; the wait task's retry reattaches to the live job."""
    airflow = str(Path(sys.executable).parent / "airflow")
    env = dict(os.environ)
    first = subprocess.Popen([airflow, "dags", "test", "verl_ppo", "-c", json.dumps({"profile": "faults"})],
                             env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    rd: Path | None = None
    retry: subprocess.Popen[bytes] | None = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            rd = run_dir(fault_env)
            if rd and len(metric_lines(rd / "metrics-a1.jsonl")) >= KILL_AT_STEP:
                break
            assert first.poll() is None, "the first dags test ended before it could be killed"
            time.sleep(0.2)
        os.killpg(first.pid, signal.SIGKILL)  # the waiter (and the triggerer it runs inline) dies
        killed_at = time.monotonic()
        first.wait(timeout=30)
        assert rd is not None
        run_id = json.loads((rd / "cluster.json").read_text())["name"].split("#")[0].split("/", 1)[1]
        job_id = RunDir(rd).attempts()[0].submission_id
        # The wait task's retry, as the scheduler would run it: it must reattach, not resubmit. The
        # trainer holds at its gate until the retry has deferred, so the job is still running when it looks.
        retry_log = fault_env.parent / "retry.log"
        with open(retry_log, "wb") as log:
            retry = subprocess.Popen([airflow, "tasks", "test", "verl_ppo", "wait_for_verl_job", run_id], env=env,
                                     stdout=log, stderr=subprocess.STDOUT)
        deferring = f"Ray job {job_id} is running: deferring"
        deadline = time.monotonic() + 600
        while deferring not in retry_log.read_text(errors="replace") and retry.poll() is None:
            assert time.monotonic() < deadline, "the retried wait task never deferred"
            time.sleep(0.2)
        reattached_s = round(time.monotonic() - killed_at, 1)
        gate_path(fault_env).touch()
        rc = retry.wait(timeout=600)
        out = retry_log.read_text(errors="replace")
        assert rc == 0, out[-4000:]
        assert deferring in out
    finally:
        gate_path(fault_env).touch()
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
        if retry is not None and retry.poll() is None:
            retry.kill()
            retry.wait(timeout=30)
        if rd is not None and (rd / "cluster.json").exists():
            run_id = json.loads((rd / "cluster.json").read_text())["name"].split("#")[0].split("/", 1)[1]
            subprocess.run([airflow, "tasks", "test", "verl_ppo", "teardown_ray_cluster", run_id], env=env,
                           capture_output=True, timeout=300)
    attempts = RunDir(rd).attempts()
    assert len(attempts) == 1, attempts
    steps = [m["step"] for m in metric_lines(rd / "metrics-a1.jsonl")]
    assert steps == list(range(1, TOTAL_STEPS + 1))  # one job, never restarted
    _no_leftovers(rd)
    record_result(results_file, "waiting process killed", {"recovery_s": reattached_s, "steps_redone": 0,
                                                            "note": "job kept training; retry reattached"})
