"""bench/gpu_busy.py on the CPU: verl's phases laid back from each row, the driver's samples attributed to
them, and the recorder on real files. Reading the driver itself needs an NVIDIA GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.bench import bench_script

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_busy.py"

#: One PPO step as verl 0.9.1 logs it (the 0.5B PPO run's step 3 on the H100, 2026-12-05, rounded).
ROW = {"step": 3, "timing_s/step": 43.0, "timing_s/gen": 10.0, "timing_s/old_log_prob": 3.0,
       "timing_s/values": 1.0, "timing_s/adv": 0.5, "timing_s/update_critic": 4.0, "timing_s/update_actor": 6.0,
       "timing_s/save_checkpoint": 18.0, "timing_s/update_weights": 0.5, "timing_s/testing": 2.0}


def _bench() -> Any:
    return bench_script("gpu_busy")


def test_the_phases_run_in_verls_order_from_the_steps_start_laid_back_from_the_row() -> None:
    windows = _bench().step_windows(ROW, landed_at=1000.0)
    got = [(w.phase, round(w.start, 3), round(w.end, 3)) for w in windows]
    # The row lands after validation (2 s), so the step ends at 998 and began 43 s before.
    assert got == [("gen", 955.0, 965.0), ("old_log_prob", 965.0, 968.0), ("values", 968.0, 969.0),
                   ("adv", 969.0, 969.5), ("update_critic", 969.5, 973.5), ("update_actor", 973.5, 979.5),
                   ("save_checkpoint", 979.5, 997.5), ("update_weights", 997.5, 998.0),
                   ("testing", 998.0, 1000.0)]
    # Time no timer covers is the step's "other"; a step without validation ends where its row lands.
    short = {"step": 1, "timing_s/step": 10.0, "timing_s/gen": 6.0}
    assert [(w.phase, w.start, w.end) for w in _bench().step_windows(short, 50.0)] == [
        ("gen", 40.0, 46.0), ("other", 46.0, 50.0)]


Samples = list[tuple[float, float]]


def _samples(busy: Samples, start: float, end: float, every: float = 1 / 6) -> Samples:
    """The driver's samples from ``start`` to ``end``: 100% inside the ``busy`` spans, 0% elsewhere."""
    n = int((end - start) / every)
    times = [start + i * every for i in range(n)]
    return [(t, 100.0 if any(a <= t < b for a, b in busy) else 0.0) for t in times]


def test_each_phase_gets_the_samples_inside_it_and_the_steps_their_mean() -> None:
    bench = _bench()
    # Generation and both updates keep the GPU busy; the save, validation and the rest leave it idle.
    busy = [(955.0, 965.0), (969.5, 979.5)]
    out = bench.analyse_run(_samples(busy, 900.0, 1010.0), [(ROW, 1000.0)])
    phases = out["phases"]
    assert phases["gen"]["busy_pct"] == 100.0 and phases["update_actor"]["busy_pct"] == 100.0
    assert phases["save_checkpoint"]["busy_pct"] == 0.0 and phases["testing"]["busy_pct"] == 0.0
    assert phases["gen"]["samples"] == pytest.approx(60, abs=1) and phases["gen"]["busy_s"] == 10.0
    assert phases["save_checkpoint"]["seconds"] == 18.0
    # 20 of the step's 43 s busy; the window adds validation's idle 2 s.
    assert out["steps_busy_pct"] == pytest.approx(100 * 20 / 43, abs=1)
    assert out["window_busy_pct"] == pytest.approx(100 * 20 / 45, abs=1)
    assert out["sample_interval_s"] == pytest.approx(1 / 6, abs=1e-3)
    assert bench.analyse_run(_samples([], 0.0, 10.0), []) == {}


def test_a_recording_gives_each_runs_steps_against_each_gpu(tmp_path: Path) -> None:
    lines = [{"kind": "gpu", "gpu": 0, "t": t, "util": u} for t, u in _samples([(955.0, 965.0)], 950.0, 1001.0)]
    lines += [{"kind": "row", "file": "dag/metrics-a1.jsonl", "t": 1000.0, "row": ROW}]
    (tmp_path / "busy.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = subprocess.run([sys.executable, str(SCRIPT), "analyse", "--samples", str(tmp_path / "busy.jsonl"),
                          "--out", str(tmp_path / "busy.json")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    run = json.loads((tmp_path / "busy.json").read_text())["runs"]["dag/metrics-a1.jsonl"]["gpu0"]
    assert run["steps"] == [3] and run["phases"]["gen"]["busy_pct"] == 100.0


def test_the_recorder_writes_every_sample_and_notes_each_training_row_once_when_whole(tmp_path: Path) -> None:
    bench = _bench()
    metrics = tmp_path / "run" / "metrics-a1.jsonl"
    metrics.parent.mkdir()
    validation = json.dumps({"step": 0, "data": {"val-core/openai/gsm8k/reward/mean@1": 0.0}})
    metrics.write_text(validation + "\n")
    fed: list[list[tuple[int, float, float]]] = [[(0, 1.0, 40.0), (0, 1.2, 60.0)], [(0, 1.4, 0.0)]]
    reads: list[int] = []

    def reader() -> list[tuple[int, float, float]]:
        reads.append(1)
        return fed.pop(0) if fed else []

    stop = threading.Event()
    out = tmp_path / "busy.jsonl"
    watch = bench.RowWatch([str(tmp_path / "run" / "metrics-*.jsonl")])
    recorder = threading.Thread(target=bench.record, args=(reader, watch, out, 0.01, stop),
                                kwargs={"cpu": lambda: {"ray::WorkerDict": 0.5},
                                        "machine": lambda: {"user": 0.4, "idle": 1.6}})
    recorder.start()

    def lines() -> list[dict[str, Any]]:
        return [json.loads(x) for x in out.read_text().splitlines()] if out.exists() else []

    def until(check: Any) -> None:
        deadline = time.monotonic() + 30
        while not check() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert check(), lines()

    try:
        until(lambda: sum(x["kind"] == "gpu" for x in lines()) == 3)
        step = json.dumps({"step": 1, "data": {"timing_s/step": 5.0}})
        with metrics.open("a") as f:  # a row half written is not read until its line ends
            f.write(step[:10])
            f.flush()
            polls = len(reads)
            until(lambda: len(reads) > polls + 1)  # a whole poll read the cut line
            assert not [x for x in lines() if x["kind"] == "row"] and watch.seen[str(metrics)] == 1
            f.write(step[10:] + "\n")
        until(lambda: any(x["kind"] == "row" for x in lines()))
    finally:
        stop.set()
        recorder.join(timeout=30)
    rows = [x for x in lines() if x["kind"] == "row"]
    assert [(r["row"]["step"], r["file"]) for r in rows] == [(1, str(metrics))]  # validation's row is no step
    assert [(x["t"], x["util"]) for x in lines() if x["kind"] == "gpu"] == [(1.0, 40.0), (1.2, 60.0), (1.4, 0.0)]
    # The machine once (its cores and CPU), then a CPU reading at every poll, the whole machine's beside it.
    assert lines()[0] == bench.host_facts() and lines()[0]["cores"] == os.cpu_count()
    cpu = [x for x in lines() if x["kind"] == "cpu"]
    assert len(cpu) == len(reads) and all(x["groups"] == {"ray::WorkerDict": 0.5} for x in cpu)
    assert all(x["machine"] == {"user": 0.4, "idle": 1.6} for x in cpu)


@pytest.mark.parametrize(("argv", "group"), [
    (["ray::WorkerDict.update_actor"], "ray::WorkerDict"),
    (["ray::AgentLoopWorkerTQ.generate_sequences            "], "ray::AgentLoopWorkerTQ"),
    (["ray::IDLE"], "ray::IDLE"),
    (["VLLM::EngineCore"], "VLLM::EngineCore"),
    (["/usr/bin/python3", "-u", "-m", "verl.trainer.main_ppo", "data.train_batch_size=8"],
     "python -m verl.trainer.main_ppo"),
    (["/usr/bin/python3", "/tmp/site/bin/airflow", "dags", "test", "verl_ppo"], "python airflow"),
    (["python3.12", "/tmp/site/ray/dashboard/agent.py", "--node-ip-address=1.2.3.4"], "python agent.py"),
    (["/tmp/site/ray/core/src/ray/raylet/raylet", "--node_id=abc"], "raylet"),
    (["/usr/bin/python3", "-c", "import sys"], "python -c"),
    (["/usr/bin/python3 bench/gpu_acceptance.py --steps 2"], "python gpu_acceptance.py"),
    ([], None),
])
def test_a_process_is_named_by_its_title_its_python_program_or_its_program(argv: list[str], group: str | None) -> None:
    assert _bench().process_group(argv) == group


def _burner(tmp_path: Path, name: str) -> subprocess.Popen[str]:
    """A Python program named ``name`` that uses CPU when told: each line it reads names seconds of CPU
    time to use, and it answers each once they are used; ``title T`` retitles it first, as Ray retitles
    a worker when it gives it an actor."""
    script = tmp_path / name
    script.write_text("import sys, time, setproctitle\n"
                      "for line in sys.stdin:\n"
                      "    if line.startswith('title '):\n"
                      "        setproctitle.setproctitle(line.split()[1])\n"
                      "        line = line.split()[2]\n"
                      "    goal = time.process_time() + float(line)\n"
                      "    while time.process_time() < goal:\n"
                      "        pass\n"
                      "    print('used', flush=True)\n")
    return subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _use(proc: subprocess.Popen[str], seconds: float, title: str = "") -> None:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(f"title {title} {seconds}\n" if title else f"{seconds}\n")
    proc.stdin.flush()
    assert proc.stdout.readline() == "used\n"


def test_the_process_reader_counts_each_programs_cpu_time_since_the_read_before(tmp_path: Path) -> None:
    """Real processes on this machine's /proc: one that ran before the first read counts only what it used
    after it; one that started after it counts from its start; one that retitles itself counts under its
    new title."""
    name_old, name_new = f"burner_old_{os.getpid()}.py", f"burner_new_{os.getpid()}.py"
    old = _burner(tmp_path, name_old)
    new = None
    try:
        _use(old, 0.3)
        cpu = _bench().ProcessCpu()
        assert f"python {name_old}" not in cpu()  # the first read only sets where the next one counts from
        _use(old, 0.2)
        new = _burner(tmp_path, name_new)
        _use(new, 0.3)
        used = cpu()
        assert 0.15 <= used[f"python {name_old}"] <= 0.3
        assert used[f"python {name_new}"] >= 0.25
        assert cpu().get(f"python {name_old}", 0.0) < 0.1  # waiting on its input uses next to nothing
        _use(new, 0.2, title=f"ray::Burner{os.getpid()}.update_actor")
        assert cpu()[f"ray::Burner{os.getpid()}"] >= 0.15
    finally:
        for proc in (old, new):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)


def test_the_machine_reader_gives_each_cpu_states_seconds_since_the_read_before(tmp_path: Path) -> None:
    bench = _bench()
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text("cpu  100 0 50 1000 10 0 5 0 0 0\ncpu0 50 0 25 500 5 0 2 0 0 0\nintr 1\n")
    machine = bench.MachineCpu(tmp_path)
    assert machine() == {}  # the first read only sets where the next counts from
    stat.write_text(f"cpu  {100 + 3 * tick} 0 {50 + tick} {1000 + 12 * tick} 10 0 5 {2 * tick} 0 0\n")
    assert machine() == {"user": 3.0, "nice": 0.0, "system": 1.0, "idle": 12.0, "iowait": 0.0, "irq": 0.0,
                         "softirq": 0.0, "steal": 2.0}
    # This machine's own /proc/stat: a process that uses 0.3 s of CPU is in the machine's work since.
    burner = _burner(tmp_path, f"burner_machine_{os.getpid()}.py")
    try:
        real = bench.MachineCpu()
        real()
        _use(burner, 0.3)
        used = real()
        assert sum(used[k] for k in bench.BUSY_STATES) >= 0.25
    finally:
        burner.kill()
        burner.wait(timeout=30)


def test_the_host_line_names_the_cores_and_the_cpu(tmp_path: Path) -> None:
    bench = _bench()
    (tmp_path / "cpuinfo").write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\n"
                                      "model name\t: AMD EPYC 9654 96-Core Processor\n\nprocessor\t: 1\n")
    assert bench.host_facts(tmp_path) == {"kind": "host", "cores": os.cpu_count(),
                                          "cpu_model": "AMD EPYC 9654 96-Core Processor"}
    assert bench.host_facts(tmp_path / "absent")["cpu_model"] is None


def test_each_phase_gets_the_cpu_cores_its_readings_used_and_by_whom() -> None:
    bench = _bench()
    windows = bench.step_windows(ROW, landed_at=1000.0)  # gen 955-965, ..., save 979.5-997.5
    # A reading a second: generation keeps 3 cores busy (the agent loop 2, the engine 1), the save 1.
    lines: list[dict[str, Any]] = [{"kind": "cpu", "t": 954.0, "groups": {}}]
    lines += [{"kind": "cpu", "t": float(t), "groups": {"ray::AgentLoopWorkerTQ": 2.0, "VLLM::EngineCore": 1.0}}
              for t in range(955, 966)]
    lines += [{"kind": "cpu", "t": float(t), "groups": {"ray::WorkerDict": 1.0}} for t in range(966, 1001)]
    spans = bench.cpu_spans(lines)
    out = bench.cpu_by_phase(spans, windows, cores=16)
    # The readings whose span's middle falls in generation (955.5 ... 964.5): 10 of them, 3 s each.
    assert out["gen"] == {"readings": 10, "cores_busy": 3.0, "machine_pct": 18.8,
                          "top": {"ray::AgentLoopWorkerTQ": 2.0, "VLLM::EngineCore": 1.0}}
    assert out["save_checkpoint"]["cores_busy"] == 1.0 and out["save_checkpoint"]["top"] == {"ray::WorkerDict": 1.0}
    assert bench.cpu_by_phase([], windows, cores=16)["gen"] == {"readings": 0}
    # analyse gives every run its phases' CPU beside its GPUs', and says which machine.
    host = {"kind": "host", "cores": 16, "cpu_model": "AMD EPYC 9654 96-Core Processor"}
    recorded = [*lines, host, {"kind": "row", "file": "bare/metrics.jsonl", "t": 1000.0, "row": ROW}]
    figures = bench.analyse(recorded)
    run = figures["runs"]["bare/metrics.jsonl"]
    assert run["cpu"]["gen"]["cores_busy"] == 3.0 and run["cpu"]["gen"]["machine_pct"] == 18.8
    assert figures["host"] == {"cores": 16, "cpu_model": "AMD EPYC 9654 96-Core Processor"}
    assert "machine" not in run["cpu"]["gen"]  # a recording without the machine's states


def test_each_phase_gets_the_whole_machines_work_waits_and_steal() -> None:
    bench = _bench()
    windows = bench.step_windows(ROW, landed_at=1000.0)
    # 16 cores, a reading a second: in generation 4 core-seconds of work, 2 stolen by the host, 10 idle;
    # in the save 1 of work, 3 waiting on the disk, 12 idle.
    gen = {"user": 3.0, "system": 1.0, "steal": 2.0, "idle": 10.0}
    save = {"user": 1.0, "iowait": 3.0, "idle": 12.0}
    lines: list[dict[str, Any]] = [{"kind": "cpu", "t": 954.0, "groups": {}, "machine": {}}]
    lines += [{"kind": "cpu", "t": float(t), "groups": {"x": 1.0}, "machine": gen if t < 966 else save}
              for t in range(955, 1001)]
    out = bench.cpu_by_phase(bench.cpu_spans(lines), windows, cores=16)
    assert out["gen"]["machine"] == {"busy_pct": 25.0, "iowait_pct": 0.0, "steal_pct": 12.5}
    assert out["save_checkpoint"]["machine"] == {"busy_pct": 6.2, "iowait_pct": 18.8, "steal_pct": 0.0}
    assert bench.machine_shares([]) is None and bench.machine_shares([{}]) is None

