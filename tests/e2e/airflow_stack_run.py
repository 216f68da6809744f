"""Wall time of the production path: the real Airflow stack (PostgreSQL + scheduler, dag-processor,
triggerer, api-server as separate processes) and one ``verl_ppo`` run triggered through the REST API.

Usage: PYTHONPATH=include .venv/bin/python tests/e2e/airflow_stack_run.py [--runs N]

Prints: PostgreSQL start, ``airflow db migrate``, components until /api/v2/monitor/health is all
healthy, DAG parsed, trigger → run success (and each task's duration, from the API), shutdown;
plus the load average, since the machine may be shared.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from tests.integration.airflow_stack import AirflowStack  # noqa: E402


def _secs(a: str | None, b: str | None) -> float:
    if not a or not b:
        return float("nan")
    start, end = (datetime.fromisoformat(x.replace("Z", "+00:00")) for x in (a, b))
    return (end - start).total_seconds()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=1, help="verl_ppo runs, one after the other")
    args = ap.parse_args()
    stack = AirflowStack()
    t0 = time.monotonic()
    try:
        stack.start()
        print(f"load average at start: {os.getloadavg()}")
        for k, v in stack.timings.items():
            print(f"{k:28s} {v:7.1f} s")
        api = stack.client()
        stack.wait_for_dag(api, "verl_ppo")
        print(f"{'start → DAG parsed':28s} {time.monotonic() - t0:7.1f} s")
        api.patch("/api/v2/dags/verl_ppo", json={"is_paused": False}).raise_for_status()
        for i in range(args.runs):
            t1 = time.monotonic()
            r = api.post("/api/v2/dags/verl_ppo/dagRuns",
                         json={"logical_date": None, "conf": {"mode": "preflight"}})
            r.raise_for_status()
            run_id = r.json()["dag_run_id"]
            run = stack.wait_for_run(api, "verl_ppo", run_id, timeout_s=900)
            print(f"run {i + 1}: {run['state']} trigger → end {time.monotonic() - t1:.1f} s")
            tis = api.get(f"/api/v2/dags/verl_ppo/dagRuns/{run_id}/taskInstances").json()["task_instances"]
            for ti in sorted(tis, key=lambda t: t["start_date"] or ""):
                print(f"   {ti['task_id']:24s} {_secs(ti['start_date'], ti['end_date']):7.1f} s  {ti['state']}")
        print(f"load average at end: {os.getloadavg()}")
    finally:
        t2 = time.monotonic()
        survivors = stack.stop()
        print(f"{'shutdown':28s} {time.monotonic() - t2:7.1f} s  survivors={survivors}")


if __name__ == "__main__":
    main()
