"""The restart budget on the CPU: a run that loses a node five times and finishes, and a run whose
trainer dies before its first step three times and fails with one line.

Usage: .venv/bin/python tests/e2e/restart_budget.py [--losses 5] [--delay 20s] [--scenario losses|crashes|both]
       [--reprobe on_change|always|both]

Each scenario is a real ``verl_ppo`` DAG run (``dag.test()``) on local Ray clusters started by the
pipeline, with the stand-in trainer (``tests/fakes/fake_verl_trainer.py``: verl's checkpoint layout
and metric names), in a throwaway Airflow home and pipeline home (the tests' environment and fault
profiles, ``tests/faults/conftest.py``):

- **losses**: two Ray nodes; 12 steps of 1.5 s, a checkpoint every 2. Each time the running attempt
  has saved a checkpoint past the one it resumed from, the worker node's process group is SIGKILLed
  (as in ``tests/faults``). Every loss follows progress, so the run is restarted every time, each
  after ``--delay`` (the budget's delay after progress), and finishes.
- **crashes**: one Ray node; every attempt's trainer is SIGKILLed before its first step (the
  ``die_before_first_step`` knob). The budget's default (2 restarts in a row without progress)
  restarts attempts 1 and 2 and fails the run after attempt 3. The nodes stay the same and the failure
  (a killed process) spares them, so each restart reuses the first attempt's probe; ``--reprobe both``
  also runs it with ``restarts.reprobe: always`` (a probe before every attempt) and prints, per
  restart, the seconds from the decision to the next attempt's submission (the delay, the probe or
  none, the submit).

Prints, per loss: the attempt, the step it reached, the checkpoint it saved, the restart delay
decided, and the time from the kill to the next attempt's first step; then the run's totals and the
wait task's error line of the crash run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import tests.conftest  # noqa: E402,F401  the tests' environment (throwaway Airflow home, Ray auth off), set at import
from tests.faults.conftest import _profile, kill_node, load_dag, metric_lines, run_dir, write_fault_configs  # noqa: E402
from verl_pipeline.rundir import RunDir, tracker_step  # noqa: E402

TOTAL_STEPS, SAVE_FREQ, STEP_S = 12, 2, 1.5
CRASH_PROFILE = "faults-crash-before-first-step"


@dataclass
class LossWatcher:
    """Kills the worker node each time the running attempt has moved the checkpoint on, ``losses`` times."""

    home: Path
    losses: int
    kills: list[dict[str, Any]] = field(default_factory=list)
    error: BaseException | None = None

    def _attempts(self) -> list[Any]:
        rd = run_dir(self.home)
        return RunDir(rd).attempts() if rd else []

    def _watch(self) -> None:
        try:
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline and (len(self.kills) < self.losses or not self._recovered()):
                attempts = self._attempts()
                ckpts = list((self.home / "checkpoints").glob("*"))
                if len(self.kills) < self.losses and attempts and ckpts and attempts[-1].attempt == len(self.kills) + 1:
                    saved = tracker_step(ckpts[0])
                    if saved is not None and saved > attempts[-1].resume_from_step:
                        rd = run_dir(self.home)
                        assert rd is not None
                        steps = [m["step"] for m in metric_lines(rd / f"metrics-a{attempts[-1].attempt}.jsonl")]
                        kill_node(1)(rd)
                        self.kills.append({"attempt": attempts[-1].attempt, "at": time.monotonic(),
                                           "resumed_from": attempts[-1].resume_from_step, "checkpoint": saved,
                                           "last_step": max(steps, default=None)})
                self._note_first_steps()
                time.sleep(0.1)
        except BaseException as e:  # surfaced by main
            self.error = e

    def _note_first_steps(self) -> None:
        rd = run_dir(self.home)
        for kill in self.kills:
            if "recovery_s" not in kill and rd and metric_lines(rd / f"metrics-a{kill['attempt'] + 1}.jsonl"):
                kill["recovery_s"] = round(time.monotonic() - kill["at"], 1)

    def _recovered(self) -> bool:
        return all("recovery_s" in k for k in self.kills)

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._watch, daemon=True)
        t.start()
        return t


def _setup(root: Path, profiles: dict[str, dict[str, Any]]) -> Path:
    """The fault configs (and ``profiles``) under ``root``, made the pipeline's; returns its home."""
    cfg = write_fault_configs(root)
    for name, profile in profiles.items():
        (cfg / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(profile))
    os.environ["VERL_PIPELINE_CONFIGS"] = str(cfg)
    os.environ["VERL_PIPELINE_HOME"] = str(root / "home")
    return root / "home"


def _wait_state(dr: Any) -> tuple[str, int]:
    ti = next(t for t in dr.get_task_instances() if t.task_id == "wait_for_verl_job")
    return str(ti.state), int(ti.try_number)


def losses(losses: int, delay: str) -> dict[str, Any]:
    prof = _profile("node losses", {"trainer": {"save_freq": SAVE_FREQ}, "+fake": {"step_seconds": STEP_S}},
                    total=TOTAL_STEPS)
    prof["restarts"] = {"delay": delay}
    home = _setup(Path(tempfile.mkdtemp(prefix="restart-bench-")), {"bench-losses": prof})
    watcher = LossWatcher(home, losses)
    thread = watcher.start()
    started = time.monotonic()
    dr = load_dag().test(run_conf={"profile": "bench-losses"})
    took = time.monotonic() - started
    thread.join(timeout=30)
    if watcher.error:
        raise watcher.error
    rd = run_dir(home)
    assert rd is not None
    decisions = {r["attempt"]: r for r in RunDir(rd).restart_records()}
    print(f"\n## {losses} node losses, restart delay {delay} after progress\n")
    print("| loss | attempt | resumed from | killed after step | checkpoint saved | progress | restart delay (s) "
          "| kill → next attempt's first step (s) |")
    print("|---|---|---|---|---|---|---|---|")
    for n, k in enumerate(watcher.kills, 1):
        d = decisions.get(k["attempt"], {})
        print(f"| {n} | {k['attempt']} | {k['resumed_from']} | {k['last_step']} | {k['checkpoint']} "
              f"| {'yes' if d.get('progressed') else 'no'} | {d.get('delay_s', '-')} | {k.get('recovery_s', '-')} |")
    state, tries = _wait_state(dr)
    report = json.loads((rd / "report" / "report.json").read_text())
    attempts = RunDir(rd).attempts()
    print(f"\nDAG run {dr.state} in {took:.0f} s; wait task {state} in {tries} try(s); {len(attempts)} attempts; "
          f"{report['steps_done']}/{TOTAL_STEPS} steps, {report['steps_redone']} redone; report: "
          f"{report['restarts']['restarts']} restarts, {report['restarts']['after_progress']} after progress, "
          f"most in a row without progress {report['restarts']['most_in_a_row']}")
    return {"state": str(dr.state), "seconds": round(took), "attempts": len(attempts), "kills": watcher.kills}


def crashes(reprobe: str) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="restart-bench-"))
    home = _setup(root, {})
    profiles = Path(os.environ["VERL_PIPELINE_CONFIGS"]) / "profiles"
    base = yaml.safe_load((profiles / f"{CRASH_PROFILE}.yaml").read_text())
    base["restarts"] = {**(base.get("restarts") or {}), "reprobe": reprobe}
    (profiles / "bench-crashes.yaml").write_text(yaml.safe_dump(base))
    started = time.monotonic()
    dr = load_dag().test(run_conf={"profile": "bench-crashes"})
    took = time.monotonic() - started
    rd = run_dir(home)
    assert rd is not None
    state, tries = _wait_state(dr)
    rows = RunDir(rd).restart_records()
    submitted = {a.attempt: a.submitted_at for a in RunDir(rd).attempts()}
    probes = {d["attempt"]: "reused" if str(d["rules"].get("probe", "")).startswith("'reused") else "ran"
              for d in RunDir(rd).decisions()}
    print("\n## Trainer killed before its first step, every attempt (budget default: 2 in a row without progress), "
          f"restarts.reprobe: {reprobe}\n")
    print("| attempt | outcome | in a row without progress | left | delay (s) | next attempt's probe "
          "| decision → next attempt submitted (s) |")
    print("|---|---|---|---|---|---|---|")
    gaps = []
    for r in rows:
        nxt = r["attempt"] + 1
        gap = round(submitted[nxt] - r["at"], 1) if nxt in submitted else None
        if gap is not None:
            gaps.append(gap)
        print(f"| {r['attempt']} | {r['outcome']} | {r['no_progress']} | {r['left']} | {r['delay_s']} "
              f"| {probes.get(nxt, '-')} | {gap if gap is not None else '-'} |")
    print(f"\nDAG run {dr.state} in {took:.0f} s; wait task {state} in {tries} try(s); "
          f"{len(RunDir(rd).attempts())} attempts")
    return {"state": str(dr.state), "seconds": round(took), "decisions": rows, "restart_gaps_s": gaps,
            "reprobe": reprobe}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", type=int, default=5)
    parser.add_argument("--delay", default="20s", help="restarts.delay of the loss run (the default's 20s)")
    parser.add_argument("--scenario", choices=("losses", "crashes", "both"), default="both")
    parser.add_argument("--reprobe", choices=("on_change", "always", "both"), default="on_change",
                        help="restarts.reprobe of the crash run (both: one run each, always first)")
    args = parser.parse_args()
    airflow = Path(sys.executable).parent / "airflow"
    subprocess.run([str(airflow), "db", "migrate"], check=True, capture_output=True, env=dict(os.environ))
    out: dict[str, Any] = {}
    if args.scenario in ("losses", "both"):
        out["losses"] = losses(args.losses, args.delay)
    if args.scenario in ("crashes", "both"):
        for reprobe in (("always", "on_change") if args.reprobe == "both" else (args.reprobe,)):
            out["crashes" if reprobe == "on_change" else f"crashes-reprobe-{reprobe}"] = crashes(reprobe)
    (REPO / ".work").mkdir(exist_ok=True)
    (REPO / ".work" / "restart-budget.json").write_text(json.dumps(out, indent=2, default=str))
    ok = out.get("losses", {}).get("state", "success") == "success" and \
        all(v["state"] == "failed" for k, v in out.items() if k.startswith("crashes"))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
