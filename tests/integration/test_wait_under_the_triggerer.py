"""The wait step under the real scheduler and triggerer (PostgreSQL), with the stand-in trainer training.

Two runs at once, each holding after a step until the test opens the gate: one is marked failed
through the REST API while deferred (the trigger's ``on_kill`` stops its Ray job; teardown runs);
for the other, the triggerer is SIGKILLed mid-wait and a new one started (the wait resumes: one
job, no retry, no early teardown, no line forwarded twice).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.conftest import ray_processes
from tests.integration import secret_canary
from tests.integration.airflow_stack import (
    STACK_TOTAL_STEPS,
    STACK_TRAIN_PROFILE,
    AirflowStack,
    task_instance,
)
from tests.integration.airflow_stack import run_task_states as _states
from tests.integration.airflow_stack import run_xcom as _xcom
from verl_pipeline.rundir import RunDir

pytestmark = [pytest.mark.integration, pytest.mark.timeout(1500)]

DAG = "verl_ppo"
WAIT = "wait_for_verl_job"
FAKE_TRAINER = "fake_verl_trainer.py"


def _ti(api: httpx.Client, run_id: str, task_id: str = WAIT) -> dict[str, Any]:
    return task_instance(api, run_id, task_id, DAG)


def _wait_log(api: httpx.Client, run_id: str, try_number: int = 1) -> str:
    """The task log as the UI shows it (the worker's part and every triggerer's), one line per record."""
    r = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{WAIT}/logs/{try_number}",
                params={"full_content": "true"}, headers={"Accept": "application/json"})
    assert r.status_code == 200, r.text[:500]
    content = r.json().get("content") or []
    return "\n".join(str(item.get("event", "")) if isinstance(item, dict) else str(item) for item in content)


def _wait_cursor_caught_up(api: httpx.Client, run_id: str, run_dir: Path, timeout_s: float = 300.0) -> None:
    """Until the cursor the trigger saved in ``run_dir`` is at the end of the job's log as Ray serves it."""
    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.jobs.logstream import WaitCursor

    handle = ClusterHandle.from_dict(_xcom(api, run_id, "provision_ray_cluster"))
    job_id = RunDir(run_dir).attempts()[0].submission_id
    deadline = time.monotonic() + timeout_s
    while True:
        printed = len(handle.client(handle.token()).logs(job_id).encode())
        saved = WaitCursor.load(run_dir, job_id).log_offset_bytes
        if saved == printed:
            return
        assert time.monotonic() < deadline, f"the saved cursor stayed at byte {saved} of {printed}"
        time.sleep(1)


def _trainers(run_dir: Path) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if FAKE_TRAINER in " ".join(p.info["cmdline"] or []) and run_dir.name in " ".join(p.info["cmdline"] or [])]


def test_kill_from_the_api_and_a_triggerer_restart_mid_wait(airflow_stack: AirflowStack,
                                                            canaries: dict[str, str]) -> None:
    api = airflow_stack.client()
    airflow_stack.wait_for_dag(api, DAG)
    airflow_stack.close_gate()
    r = api.patch(f"/api/v2/dags/{DAG}", json={"is_paused": False})
    assert r.status_code == 200, r.text
    try:
        runs = []
        for _ in range(2):
            r = api.post(f"/api/v2/dags/{DAG}/dagRuns",
                         json={"logical_date": None, "conf": {"profile": STACK_TRAIN_PROFILE}})
            assert r.status_code == 200, r.text
            runs.append(r.json()["dag_run_id"])
        killed_run, restarted_run = runs
        killed_dir = airflow_stack.wait_held_at_gate(api, killed_run)
        restarted_dir = airflow_stack.wait_held_at_gate(api, restarted_run)

        # -- While both train: no secret in any job's info or log through the Jobs API (the job gets
        #    its cluster's Ray token by a file path, not in its runtime_env).
        live = [_xcom(api, r, "provision_ray_cluster") for r in runs]
        leaks = [leak for c in live for leak in secret_canary.jobs_api_leaks(
            c, {**canaries, "ray token": secret_canary.ray_token(c) or "(none)"})]
        assert all(secret_canary.ray_token(c) for c in live) and leaks == [], [str(x) for x in leaks]

        # -- A user marks the deferred wait task failed: the trigger's on_kill stops the Ray job.
        killed_job = RunDir(killed_dir).attempts()[0].submission_id
        r = api.patch(f"/api/v2/dags/{DAG}/dagRuns/{killed_run}/taskInstances/{WAIT}", json={"new_state": "failed"})
        assert r.status_code == 200, r.text
        finished = airflow_stack.wait_for_run(api, DAG, killed_run, timeout_s=300)
        states = _states(api, killed_run)
        assert finished["state"] == "failed" and states[WAIT] == "failed", states
        assert states["teardown_ray_cluster"] == "success", states
        log = _wait_log(api, killed_run)
        assert f"Task killed by a user: stopping Ray job {killed_job}" in log, log[-3000:]
        assert f"Ray job {killed_job}: stopped" in log, log[-3000:]
        cluster = _xcom(api, killed_run, "provision_ray_cluster")
        assert ray_processes(cluster["extra"]["temp_dir"]) == [] and _trainers(killed_dir) == []

        # -- The triggerer dies mid-wait (SIGKILL, all its processes) and a new one starts, once the job,
        #    quiet at its gate, has had everything it printed forwarded and the cursor saved (the
        #    trigger saves a moving cursor at most every 30 s, and a quiet one at its next read: a
        #    triggerer that dies within 30 s of a burst of output forwards that burst again).
        _wait_cursor_caught_up(api, restarted_run, restarted_dir)
        before = _ti(api, restarted_run)
        old_triggerer = before["triggerer_job"]["id"]
        airflow_stack.kill("triggerer")
        airflow_stack.relaunch("triggerer")
        deadline = time.monotonic() + 300
        while True:  # the new triggerer takes the trigger over once the old one's heartbeat is stale
            ti = _ti(api, restarted_run)
            job = ti.get("triggerer_job") or {}
            if ti.get("state") == "deferred" and job.get("id") not in (None, old_triggerer):
                break
            assert ti.get("state") == "deferred", ti
            assert time.monotonic() < deadline, f"no triggerer took the wait over: {ti}"
            time.sleep(1)
        airflow_stack.open_gate()
        done = airflow_stack.wait_for_run(api, DAG, restarted_run, timeout_s=600)
        states = _states(api, restarted_run)
        assert done["state"] == "success", states
        assert _ti(api, restarted_run)["try_number"] == 1  # the wait resumed: no retry
        assert _ti(api, restarted_run, "teardown_ray_cluster")["try_number"] == 1
        attempts = RunDir(restarted_dir).attempts()
        assert len(attempts) == 1, attempts  # one job: nothing resubmitted
        steps = [json.loads(line)["step"] for line in (restarted_dir / "metrics-a1.jsonl").read_text().splitlines()]
        assert steps == list(range(1, STACK_TOTAL_STEPS + 1))
        # Every line of the job reached the task log once, across both triggerers.
        log = _wait_log(api, restarted_run)
        for step in range(1, STACK_TOTAL_STEPS + 1):
            assert len(re.findall(rf"\bstep:{step} - training/global_step:{step}\b", log)) == 1, (step, log[-4000:])
        assert "continuing from the saved cursor" in log, log[-4000:]
        waited = _xcom(api, restarted_run, WAIT)
        assert waited["training"]["last_step"] == STACK_TOTAL_STEPS and waited["progress"]["step"] == STACK_TOTAL_STEPS
    finally:
        airflow_stack.open_gate()
        api.patch(f"/api/v2/dags/{DAG}", json={"is_paused": True})
