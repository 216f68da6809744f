"""Wall time of the README's run command (`make run`), phase by phase; with ``--before``, against a commit.

Usage: .venv/bin/python bench/pipeline_wall_time.py [--runs N] [--before REF]

Runs `make run` of this checkout and, with ``--before``, of that commit (checked out in a temporary git
worktree), ``--runs`` times each, alternating, so all see the same machine. This checkout runs twice
per round: as a repeat run of the configuration
(the provision task reuses the validation verl passed in an earlier run) and as the configuration's
first run (the kept validations removed before it). Each variant runs its own Makefile and code
(``PYTHONPATH`` points at its ``include/``) with its own ``.work`` (Airflow DB, pipeline home) on
the installed venv; a first run of each tree, not counted, builds its caches (data, tiny model).

Phases, from the run's own log: everything before the DAG run starts (make, Airflow's DB migration,
`airflow dags test` starting), then the DAG run (Airflow's ``run_duration``): verl validation and
the Ray head's start in the provision task, preprocess + plan + prefetch, submit (render, the nodes'
environment probe, the submission), the wait (the preflight Ray job's start, its checks as
``preflight.json`` times them, and its end until the waiter saw it: the job writes that file last),
report + export, teardown, and Airflow's own time between tasks. "CPU" is the CPU time of every
process of the run (the Ray cluster's too), sampled every 0.25 s. Prints one table: median
(min-max) per phase and variant.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import psutil

from verl_pipeline.trainer.validate import RECORDS_DIR

REPO = Path(__file__).resolve().parents[1]
TS = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+)Z")
PHASES = {
    "make_run": "`make run` wall",
    "before_dag_run": "before the DAG run (make, DB migration, `airflow dags test` start)",
    "dag_run": "DAG run (Airflow's run_duration)",
    "validate": "  provision: verl composition + validation",
    "ray_start": "  provision: local Ray head until ready",
    "prepare": "  preprocess + plan + prefetch (cached)",
    "submit": "  submit (render, environment probe job, submission)",
    "wait": "  wait: the preflight Ray job until the waiter saw it end",
    "job_start": "    the job's start (Ray job supervisor, driver, imports)",
    "job_checks": "    the job's checks (preflight.json's seconds)",
    "job_seen": "    its end until the waiter saw it (poll interval)",
    "report": "  report + export",
    "teardown": "  teardown",
    "airflow": "  Airflow between tasks",
    "cpu": "CPU seconds, all processes of the run",
}


def _ts(line: str) -> float | None:
    m = TS.match(line)
    return datetime.fromisoformat(m.group(1)).replace(tzinfo=timezone.utc).timestamp() if m else None


class CpuSampler(threading.Thread):
    """CPU time of a process and all its descendants, summed over every process seen."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.root = psutil.Process(pid)
        self.seen: dict[tuple[int, float], float] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                processes = [self.root, *self.root.children(recursive=True)]
            except psutil.NoSuchProcess:
                processes = []
            for p in processes:
                try:
                    t = p.cpu_times()
                    self.seen[(p.pid, p.create_time())] = t.user + t.system
                except psutil.Error:
                    continue
            self.done.wait(0.25)

    def total(self) -> float:
        return sum(self.seen.values())


def one_run(tree: Path, work: Path, venv: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "include")}
    env.pop("VERL_PIPELINE_HOME", None)
    cmd = ["make", "-s", "-C", str(tree), "run", f"VENV={venv}", f"WORK={work}", "-o", f"{venv}/.installed"]
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    sampler = CpuSampler(proc.pid)
    sampler.start()
    out, _ = proc.communicate()
    wall = time.time() - t0
    sampler.done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"make run failed in {tree}:\n{out[-4000:]}")
    start: dict[str, float] = {}
    end: dict[str, float] = {}
    marks: dict[str, float] = {}
    run_dir = Path()
    for line in out.splitlines():
        t = _ts(line)
        if m := re.search(r"run_start_date=([\d\- :.+]+), run_end_date=([\d\- :.+]+), run_duration=([\d.]+)", line):
            marks["run_start"] = datetime.fromisoformat(m.group(1)).timestamp()
            marks["run_duration"] = float(m.group(3))
        if t is None:
            continue
        if m := re.search(r"\[DAG TEST\] starting task_id=(\w+)", line):
            start.setdefault(m.group(1), t)
        elif m := re.search(r"\[DAG TEST\] end task task_id=(\w+)", line):
            end[m.group(1)] = t
        elif "Starting a local Ray node" in line:
            marks.setdefault("ray_start", t)
        elif m := re.search(r"--summary-path (\S+)/preflight\.json", line):
            run_dir = Path(m.group(1))
    dur = {k: end[k] - start[k] for k in start if k in end}
    ray_start = end["provision_ray_cluster"] - marks["ray_start"]
    # The job writes preflight.json last: its mtime is (within the driver's exit) the job's end.
    summary = run_dir / "preflight.json"
    job_checks = float(json.loads(summary.read_text())["seconds"])
    job_end = summary.stat().st_mtime
    return {
        "make_run": wall,
        "before_dag_run": marks["run_start"] - t0,
        "dag_run": marks["run_duration"],
        "validate": dur["provision_ray_cluster"] - ray_start,
        "ray_start": ray_start,
        "prepare": dur["preprocess_data"] + dur["plan_models"] + dur["prefetch_model"],
        "submit": dur["submit_verl_job"],
        "wait": dur["wait_for_verl_job"],
        "job_start": job_end - job_checks - end["submit_verl_job"],
        "job_checks": job_checks,
        "job_seen": end["wait_for_verl_job"] - job_end,
        "report": dur["report_run"] + dur["export_model"],
        "teardown": dur["teardown_ray_cluster"],
        "airflow": marks["run_duration"] - sum(dur.values()),
        "cpu": sampler.total(),
    }


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})"


@dataclass(frozen=True)
class Variant:
    name: str
    tree: Path
    work: Path
    #: Remove the validations verl passed in earlier runs first (the provision task validates anew).
    forget_validations: bool = False

    def run(self, venv: Path) -> dict[str, float]:
        if self.forget_validations:
            shutil.rmtree(self.work / "home" / RECORDS_DIR, ignore_errors=True)
        return one_run(self.tree, self.work, venv)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", default=None, help="a commit to compare with (a git ref); none: this checkout only")
    args = parser.parse_args()
    venv = Path(sys.executable).parent.parent
    with tempfile.TemporaryDirectory(prefix="vp-bench-") as tmp:
        before = Path(tmp) / "before"
        variants = [Variant("after: a configuration run before", REPO, Path(tmp) / "work-after"),
                    Variant("after: a configuration's first run", REPO, Path(tmp) / "work-after", True)]
        if args.before:
            subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(before), args.before],
                           check=True, capture_output=True)
            variants.insert(0, Variant("before", before, Path(tmp) / "work-before"))
        try:
            for v in variants:  # warm-up: caches, Airflow DB
                if not v.forget_validations:
                    v.run(venv)
            runs: dict[str, list[dict[str, float]]] = {v.name: [] for v in variants}
            for i in range(args.runs):
                for v in variants:
                    load = os.getloadavg()[0]
                    runs[v.name].append(v.run(venv))
                    print(f"run {i + 1}, {v.name}: DAG run {runs[v.name][-1]['dag_run']:.1f}s, `make run` "
                          f"{runs[v.name][-1]['make_run']:.1f}s (load average {load:.1f} at start)", flush=True)
        finally:
            if args.before:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before)],
                               check=False, capture_output=True)
    names = [v.name for v in variants]
    print(f"\n`make run`, warm install, {args.runs} runs per variant, seconds: median (min-max)"
          + (f"; before = {args.before}" if args.before else ""))
    print("| phase | " + " | ".join(names) + " |\n|---|" + "---|" * len(names))
    for key, label in PHASES.items():
        print(f"| {label} | " + " | ".join(_cell([r[key] for r in runs[n]]) for n in names) + " |")


if __name__ == "__main__":
    main()
