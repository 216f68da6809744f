"""Fault-injection harness: a 2-node local Ray cluster, the fake verl trainer, the real DAG."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml

from verl_pipeline.paths import configs_dir

REPO = Path(__file__).resolve().parents[2]
FAKE_TRAINER = REPO / "tests" / "fakes" / "fake_verl_trainer.py"
TOTAL_STEPS = 8
SAVE_FREQ = 2
# Attempt 1 holds after this step until the test opens the gate (see fake_verl_trainer), so a kill
# always lands mid-run, however busy the machine.
KILL_AT_STEP = 5


#: The delay before a restart after progress in the fault profiles (a duration).
RESTART_DELAY = "1s"

#: The hang scenario: the trainer hangs after this step; the watchdog's stall timeout (a profile duration).
HANG_AFTER_STEP = 5
HANG_STALL_TIMEOUT = "15s"


def gate_path(home: Path) -> Path:
    """The file that lets the fake trainer go on after ``KILL_AT_STEP`` (a run's home → its gate)."""
    return home.parent / "gate-open"


def gated_fake(home: Path, step_seconds: float = 1.5) -> dict[str, Any]:
    """The fake trainer's knobs for a run that holds after ``KILL_AT_STEP`` until the gate opens."""
    return {"step_seconds": step_seconds, "gate_file": str(gate_path(home)), "gate_after_step": KILL_AT_STEP}


def _profile(name: str, verl: dict[str, Any], total: int = TOTAL_STEPS) -> dict[str, Any]:
    return {
        "description": f"fault injection: {name}",
        "model_profile": "tiny-ppo",
        "cluster_profile": "local-2node",
        "data": {"source": "builtin:arithmetic", "train_size": 32, "val_size": 8},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": total},
        "mode": "train",
        "trainer_command": [sys.executable, str(FAKE_TRAINER)],
        # The stand-in's cheap checkpoint files are no FSDP state verl's merger could read.
        "export": False,
        "verl": verl,
        # Short restart delays (the budget's default limit): a restart waits 1 s, 2 s at most.
        "restarts": {"delay": RESTART_DELAY, "max_delay": "2s"},
    }


@pytest.fixture
def fault_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, airflow_db: Path) -> Path:
    """A configs dir with the fault profiles and a fresh pipeline home; returns the home."""
    cfg = write_fault_configs(tmp_path)
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def write_fault_configs(tmp_path: Path) -> Path:
    """``tmp_path/configs``: the shipped configs plus the fault clusters (``local-2node``, ``local-1node``)
    and profiles, their storage in ``tmp_path/home`` (also what ``tests/e2e/restart_budget.py`` runs on)."""
    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    (cfg / "clusters" / "local-2node.yaml").write_text(yaml.safe_dump({
        "description": "two Ray nodes on this machine (head + worker)",
        "cluster": {"backend": "local", "nodes": 2, "num_cpus": 1, "num_gpus": 0, "object_store_memory_mb": 200,
                    "ready_timeout_s": 180, "stop_grace_s": 2},
        "hardware": {"gpu_memory_gb": 24},
        "storage": {"root": str(tmp_path / "home")},
        "runtime": {"ship_package": False, "env": {}},
    }))
    (cfg / "clusters" / "local-1node.yaml").write_text(yaml.safe_dump({
        "description": "one Ray node on this machine (the head)",
        "cluster": {"backend": "local", "num_cpus": 2, "num_gpus": 0, "object_store_memory_mb": 200,
                    "ready_timeout_s": 180, "stop_grace_s": 2},
        "hardware": {"gpu_memory_gb": 24},
        "storage": {"root": str(tmp_path / "home")},
        "runtime": {"ship_package": False, "env": {}},
    }))
    base = {"trainer": {"save_freq": SAVE_FREQ}, "+fake": {"step_seconds": 1.5}}
    gated = {**base, "+fake": gated_fake(tmp_path / "home")}
    profiles = {
        "faults": _profile("ok", gated),
        "faults-config-error": _profile("config error", {**base, "+fake": {"step_seconds": 0.2, "bad_key": 1}}),
        "faults-user-exception": _profile("user exception", {**base, "+fake": {"step_seconds": 0.2,
                                                                                "fail_at_step": 2}}),
        # Every attempt's trainer is SIGKILLed before its first step, on a one-node cluster (no node is lost).
        "faults-crash-before-first-step": {
            **_profile("crash before the first step", {**base, "+fake": {"die_before_first_step": True}}),
            "cluster_profile": "local-1node"},
        # Hangs once after HANG_AFTER_STEP with every node alive; the watchdog must end it.
        "faults-hang": {**_profile("hang", {**base, "+fake": {"step_seconds": 0.5, "hang_after_step": HANG_AFTER_STEP,
                                                                 "hang_once_file": str(tmp_path / "hung-once")}}),
                        "watch": {"stall_timeout": HANG_STALL_TIMEOUT, "startup_timeout": "5m"}},
    }
    for name, prof in profiles.items():
        (cfg / "profiles" / f"{name}.yaml").write_text(yaml.safe_dump(prof))
    return cfg


def load_dag(retry_delay_s: float = 1.0) -> Any:
    """The real verl_ppo DAG, with short retry delays and fast polling so a test takes a minute."""
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags" / "verl_ppo.py"))
    assert bag.import_errors == {}
    dag = bag.dags["verl_ppo"]
    for task in dag.tasks:
        task.retry_delay = timedelta(seconds=retry_delay_s)
        task.retry_exponential_backoff = False
    wait = dag.get_task("wait_for_verl_job")
    wait.poll_interval = 0.5
    wait.max_poll_errors = 4
    return dag


def run_dir(home: Path) -> Path | None:
    runs = sorted((home / "runs").glob("*")) if (home / "runs").is_dir() else []
    return runs[0] if runs else None


def metric_lines(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


@dataclass
class Killer:
    """Watches the run; when attempt 1 has logged ``at_step``, calls ``kill`` and opens the trainer's
    gate (a gated trainer holds after that step until then); then times recovery."""

    home: Path
    at_step: int
    kill: Callable[[Path], None]
    killed_at: float | None = None
    recovered_at: float | None = None
    error: BaseException | None = None
    events: list[str] = field(default_factory=list)

    def _watch(self) -> None:
        try:
            deadline = time.monotonic() + 3600
            while time.monotonic() < deadline and self.killed_at is None:
                rd = run_dir(self.home)
                if rd and len(metric_lines(rd / "metrics-a1.jsonl")) >= self.at_step:
                    self.kill(rd)
                    self.killed_at = time.monotonic()
                    self.events.append(f"killed at step {self.at_step}")
                    gate_path(self.home).touch()
                time.sleep(0.1)
            while time.monotonic() < deadline and self.recovered_at is None:
                rd = run_dir(self.home)
                if rd and metric_lines(rd / "metrics-a2.jsonl"):
                    self.recovered_at = time.monotonic()
                time.sleep(0.1)
        except BaseException as e:  # surfaced by the test
            self.error = e

    def start(self) -> threading.Thread:
        t = threading.Thread(target=self._watch, daemon=True)
        t.start()
        return t

    @property
    def recovery_s(self) -> float | None:
        if self.killed_at is None or self.recovered_at is None:
            return None
        return round(self.recovered_at - self.killed_at, 1)


def kill_node(rank: int) -> Callable[[Path], None]:
    def _kill(rd: Path) -> None:
        handle = json.loads((rd / "cluster.json").read_text())
        node = next(n for n in handle["extra"]["nodes"] if n["rank"] == rank)
        os.killpg(int(node["pgid"]), signal.SIGKILL)

    return _kill


#: Where the fault tests leave their recovery figures (bench/fault_recovery.py reads them).
RESULTS_FILE = REPO / ".work" / "fault-recovery.json"


def record_result(results_file: Path, scenario: str, value: dict[str, Any]) -> None:
    """Add one scenario's figures to ``results_file``. Tests of other xdist groups write it too: the
    file is replaced atomically, and one that cannot be read starts afresh (the figures are a bench's)."""
    from verl_pipeline.paths import write_json_atomic

    results_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        data = json.loads(results_file.read_text())
    except (OSError, ValueError):
        data = {}
    data[scenario] = value
    write_json_atomic(results_file, data)


@pytest.fixture
def results_file() -> Iterator[Path]:
    """Recovery times go to :data:`RESULTS_FILE` (picked up by docs/benchmarks.md by hand)."""
    yield RESULTS_FILE


@pytest.fixture
def checkpoint_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Profiles for the stand-in trainer on the session's local Ray head, without Airflow: ``ckpt``
    trains 6 steps on 1 x 2 GPUs (world size 2, a critic), saving every 2 steps; returns the home."""
    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    (cfg / "clusters" / "local-ckpt.yaml").write_text(yaml.safe_dump({
        "description": "the tests' shared local Ray head",
        "cluster": {"backend": "local", "num_cpus": 2, "num_gpus": 0},
        "hardware": {"gpu_memory_gb": 24},
        "storage": {"root": str(tmp_path / "home")},
        "runtime": {"ship_package": False, "env": {}},
    }))
    prof = _profile("checkpoints", {"trainer": {"save_freq": 2}, "+fake": {"step_seconds": 0.2}}, total=6)
    prof["cluster_profile"] = "local-ckpt"
    prof["trainer"]["n_gpus_per_node"] = 2
    (cfg / "profiles" / "ckpt.yaml").write_text(yaml.safe_dump(prof))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    monkeypatch.setenv("VERL_PIPELINE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"
