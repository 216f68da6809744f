"""Wall time of the README's run command (`make run`) split by phase, from its own log.

Usage: .venv/bin/python bench/pipeline_wall_time.py [--runs N]

Phases: Airflow overhead (start-up, DB migrate, DAG parse, task bookkeeping), verl validation on the
Airflow side, Ray start, preprocessing, prefetch, submit, the Ray job (submit → wait done) and teardown.
Run it on a warm install (the venv exists); the first run also builds the tiny model and the parquet.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")


def _ts(line: str) -> float | None:
    m = TS.match(line)
    return datetime.fromisoformat(m.group(1)).timestamp() if m else None


def one_run() -> dict[str, float]:
    t0 = time.time()
    out = subprocess.run(["make", "-s", "run"], cwd=REPO, capture_output=True, text=True)
    wall = time.time() - t0
    if out.returncode != 0:
        raise SystemExit(f"make run failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    marks: dict[str, float] = {}
    for line in out.stdout.splitlines():
        t = _ts(line)
        if t is None:
            continue
        if m := re.search(r"\[DAG TEST\] starting task_id=(\w+)", line):
            start[m.group(1)] = t
        elif m := re.search(r"\[DAG TEST\] end task task_id=(\w+)", line):
            end[m.group(1)] = t
        elif "Starting a local Ray head" in line:
            marks["ray_start"] = t
        elif "verl_pipeline.steps" in line and "verl accepted the configuration" in line:
            marks["validated"] = t
    dur = {k: end[k] - start[k] for k in start}
    ray_start = end["provision_ray_cluster"] - marks["ray_start"]
    validation = dur["provision_ray_cluster"] - ray_start
    tasks = sum(dur.values())
    return {
        "wall": wall,
        "airflow_overhead": wall - tasks,
        "validate_on_airflow": validation,
        "ray_start": ray_start,
        "preprocess": dur["preprocess_data"],
        "prefetch": dur["prefetch_model"],
        "submit": dur["submit_verl_job"],
        "job": dur["wait_for_verl_job"],
        "teardown": dur["teardown_ray_cluster"],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    runs = [one_run() for _ in range(args.runs)]
    print(f"`make run`, warm install, {args.runs} runs (median, min-max), seconds")
    print("| phase | median | min | max |\n|---|---|---|---|")
    for key in runs[0]:
        values = [r[key] for r in runs]
        print(f"| {key} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |")


if __name__ == "__main__":
    main()
