"""How busy the GPU was in each phase of each training step, from the driver's own utilisation samples.

Ray's node summary, which the run report reads every 10 s, gives one instant each (the driver's utilisation
over its last sample period, a fraction of a second): a run of a few minutes gets a handful of instants of
a GPU that works in bursts, and nothing says *when* it idles (a checkpoint save on the disk, verl's loop
around generation on the CPU, an update of small micro batches).

``record`` runs beside a run on the GPU machine. Every ``--poll-s`` it reads every sample the driver
kept since its last read (NVML's ``nvmlDeviceGetSamples`` for GPU utilisation: one every 0.2 s on an
H100, stamped in the CPU's epoch microseconds), so no burst falls between readings. It also notes when
each training row lands in the runs' metrics files, and the CPU time every process on the machine used
since the last read, summed by what the process is (``process_group``: a Ray actor by its class, vLLM's
engine, the DAG's own Python process, Ray's daemons), and the whole machine's CPU time by state
(``/proc/stat``: work, waits on the disk, and ``steal``, the time a virtual machine's CPUs waited for
their host's). ``analyse`` lays verl's phases of each step back from its row: verl logs the row after
the step and its validation, and times the phases in a fixed order (``STEP_PHASES``). It then gives the
mean utilisation of the samples inside each phase and over the steps as a whole, and the CPU cores each
phase kept busy and by whom.

Usage (the GPU machine; ``bench/gpu_all.sh`` does it around the 0.5B runs):
  python bench/gpu_busy.py record --metrics GLOB [--metrics GLOB ...] --out FILE.jsonl [--poll-s 1]
  python bench/gpu_busy.py analyse --samples FILE.jsonl --out FILE.json
``record`` stops on SIGTERM or SIGINT; what it read is on disk line by line.
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import os
import signal
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_acceptance as acceptance  # a metrics file's training rows

#: The phases of one training step in the order verl 0.9.1 times them (``fit`` in
#: ``trainer/ppo/ray_trainer.py``): a phase a run does not have (no critic, no reference) takes no time.
STEP_PHASES = ("gen", "reward", "old_log_prob", "ref", "values", "adv", "update_critic", "update_actor",
               "save_checkpoint", "update_weights")
#: The step's time that no named phase covers (between the timers, and after the last).
OTHER = "other"
#: Validation after the step (``testing``), before the row is logged: outside the step's timer.
TESTING = "testing"

#: A reader of the driver's samples: each call gives those it has not given before, as (GPU, time, %).
Reader = Callable[[], list[tuple[int, float, float]]]
#: A reader of the machine's processes: each call gives the CPU seconds used since the call before, by group.
CpuReader = Callable[[], dict[str, float]]
#: A reader of the whole machine's CPU time: each call gives the seconds since the call before, by state.
MachineReader = Callable[[], dict[str, float]]
#: The kernel's clock ticks per second, the unit of ``/proc``'s CPU times.
TICKS_PER_S = float(os.sysconf("SC_CLK_TCK"))
#: How many of a phase's busiest process groups ``analyse`` names.
CPU_TOP = 6
#: ``/proc/stat``'s first line, the states of all CPUs summed, in its order (proc(5)); the guest's time is
#: also in ``user``. What the machine's CPU did is read as these states' shares.
STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
#: The states that are work; ``steal`` is time a virtual machine's CPUs waited for the host's.
BUSY_STATES = ("user", "nice", "system", "irq", "softirq")


@dataclass(frozen=True)
class Window:
    phase: str
    step: int
    start: float
    end: float


def step_windows(row: dict[str, float], landed_at: float) -> list[Window]:
    """The phases of the step whose row landed at ``landed_at``, laid back from it: validation ends
    where the row lands, the step where validation starts, and the named phases run from the step's
    start in verl's order, each as long as its ``timing_s/<phase>``."""
    from verl_pipeline.trainer import metrics as m

    step = int(row["step"])
    testing = float(row.get(m.TIMING_PREFIX + TESTING, 0.0))
    end = landed_at - testing
    t = end - float(row[m.TIMING_STEP])  # the step's start
    windows = []
    for phase in STEP_PHASES:
        seconds = float(row.get(m.TIMING_PREFIX + phase, 0.0))
        if seconds > 0:
            windows.append(Window(phase, step, t, min(t + seconds, end)))
            t += seconds
    if t < end:
        windows.append(Window(OTHER, step, t, end))
    if testing > 0:
        windows.append(Window(TESTING, step, end, landed_at))
    return windows


def run_windows(rows: list[tuple[dict[str, float], float]]) -> list[Window]:
    """The phases of every step of a run, each row with the time it landed."""
    return [w for row, landed in rows for w in step_windows(row, landed)]


def phases(windows: list[Window]) -> dict[str, tuple[list[Window], float]]:
    """Each phase, in the order the steps ran them: its windows over all steps and their seconds."""
    out: dict[str, tuple[list[Window], float]] = {}
    for phase in dict.fromkeys(w.phase for w in windows):
        mine = [w for w in windows if w.phase == phase]
        out[phase] = (mine, sum(w.end - w.start for w in mine))
    return out


def inside(samples: list[tuple[float, float]], start: float, end: float) -> list[float]:
    return [u for t, u in samples if start <= t < end]


def by_phase(samples: list[tuple[float, float]], windows: list[Window]) -> dict[str, dict[str, Any]]:
    """Per phase over all steps: its seconds, the samples inside it and their mean (the share of that
    time a kernel ran), and the busy seconds that make (seconds times mean)."""
    out: dict[str, dict[str, Any]] = {}
    for phase, (mine, seconds) in phases(windows).items():
        values = [u for w in mine for u in inside(samples, w.start, w.end)]
        mean = statistics.fmean(values) if values else None
        out[phase] = {"seconds": round(seconds, 2), "samples": len(values),
                      "busy_pct": None if mean is None else round(mean, 1),
                      "busy_s": None if mean is None else round(seconds * mean / 100, 2)}
    return out


#: CPU seconds by process group over the span (start, end] that one reading covers, and the whole
#: machine's CPU seconds by state over it (empty where the recording has none).
CpuSpan = tuple[float, float, dict[str, float], dict[str, float]]


def cpu_spans(lines: list[dict[str, Any]]) -> list[CpuSpan]:
    """The recording's CPU readings as spans: each from the reading before it to its own time (the
    first reading only sets where the second's span starts)."""
    readings = sorted(((float(x["t"]), x["groups"], x.get("machine") or {}) for x in lines
                       if x.get("kind") == "cpu"), key=lambda r: r[0])
    return [(a[0], b[0], b[1], b[2]) for a, b in itertools.pairwise(readings)]


def cpu_by_phase(spans: list[CpuSpan], windows: list[Window], cores: int | None) -> dict[str, dict[str, Any]]:
    """Per phase over all steps, from the readings whose span's middle falls in it: the CPU cores it kept
    busy on average (their CPU seconds over its seconds), the share of the machine's cores, its busiest
    process groups in cores and, where the recording has them, the whole machine's shares by state."""
    out: dict[str, dict[str, Any]] = {}
    for phase, (mine, seconds) in phases(windows).items():
        theirs = [(used, machine) for start, end, used, machine in spans
                  if any(w.start <= (start + end) / 2 < w.end for w in mine)]
        if not theirs or seconds <= 0:
            out[phase] = {"readings": 0}
            continue
        groups: dict[str, float] = {}
        for used, _ in theirs:
            for name, cpu_s in used.items():
                groups[name] = groups.get(name, 0.0) + cpu_s
        busy = sum(groups.values()) / seconds
        top = sorted(groups.items(), key=lambda kv: -kv[1])[:CPU_TOP]
        out[phase] = {"readings": len(theirs), "cores_busy": round(busy, 2),
                      "machine_pct": None if not cores else round(100 * busy / cores, 1),
                      "top": {name: round(cpu_s / seconds, 2) for name, cpu_s in top}}
        if machine := machine_shares([m for _, m in theirs]):
            out[phase]["machine"] = machine
    return out


def machine_shares(readings: list[dict[str, float]]) -> dict[str, float] | None:
    """The whole machine's CPU over some readings of ``/proc/stat``: the shares of its time that were work
    (every process and the kernel's), waits on the disk (``iowait``) and a virtual machine's waits for its
    host (``steal``), in percent. None where the readings have none."""
    total = sum(v for r in readings for v in r.values())
    if total <= 0:
        return None
    def share(states: tuple[str, ...]) -> float:
        return round(100 * sum(r.get(k, 0.0) for r in readings for k in states) / total, 1)
    return {"busy_pct": share(BUSY_STATES), "iowait_pct": share(("iowait",)), "steal_pct": share(("steal",))}


def analyse_run(samples: list[tuple[float, float]], rows: list[tuple[dict[str, float], float]]) -> dict[str, Any]:
    """One run's steps (each row with the time it landed): the phases' utilisation, and the steps'
    (named phases and ``other``, validation apart) and the whole window's from the first step's start."""
    windows = run_windows(rows)
    if not windows:
        return {}
    in_steps = [u for w in windows if w.phase != TESTING for u in inside(samples, w.start, w.end)]
    window = inside(samples, min(w.start for w in windows), max(w.end for w in windows))
    return {"steps": sorted({w.step for w in windows}), "phases": by_phase(samples, windows),
            "steps_busy_pct": round(statistics.fmean(in_steps), 1) if in_steps else None,
            "window_busy_pct": round(statistics.fmean(window), 1) if window else None,
            "window_samples": len(window),
            "sample_interval_s": interval(samples)}


def interval(samples: list[tuple[float, float]]) -> float | None:
    """The driver's median time between two samples (its sampling period)."""
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(samples) if b[0] > a[0]]
    return round(statistics.median(gaps), 3) if gaps else None


def analyse(lines: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """``record``'s lines: per GPU its samples, per metrics file its rows; every file's steps against
    every GPU (one GPU per run on the machines this ran on), and against the machine's CPU readings
    where the recording has them (``cpu``)."""
    lines = list(lines)
    samples: dict[int, list[tuple[float, float]]] = {}
    rows: dict[str, list[tuple[dict[str, float], float]]] = {}
    for line in lines:
        if line.get("kind") == "gpu":
            samples.setdefault(int(line["gpu"]), []).append((float(line["t"]), float(line["util"])))
        elif line.get("kind") == "row":
            rows.setdefault(str(line["file"]), []).append((line["row"], float(line["t"])))
    for values in samples.values():
        values.sort()
    spans = cpu_spans(lines)
    host = next(({k: v for k, v in x.items() if k != "kind"} for x in lines if x.get("kind") == "host"), {})
    cores = int(host["cores"]) if host.get("cores") else None
    runs: dict[str, dict[str, Any]] = {}
    for f, r in rows.items():
        runs[f] = {f"gpu{g}": analyse_run(s, r) for g, s in sorted(samples.items())}
        if spans:
            runs[f]["cpu"] = cpu_by_phase(spans, run_windows(r), cores)
    return {"host": host, "runs": runs} if host else {"runs": runs}


# -- recording on the GPU machine ------------------------------------------------------------------

class RowWatch:
    """The training rows that land in metrics files matching some globs, each noted once, with when."""

    def __init__(self, patterns: list[str]) -> None:
        self.patterns = patterns
        self.seen: dict[str, int] = {}

    def poll(self, now: float) -> list[dict[str, Any]]:
        new = []
        for name in sorted({f for p in self.patterns for f in glob.glob(p)}):
            whole = Path(name).read_text(errors="replace").split("\n")[:-1]  # not a line still being written
            rows = [row for line in whole[self.seen.get(name, 0):] if (row := acceptance.training_row(line))]
            new += [{"kind": "row", "file": name, "t": now, "row": row} for row in rows]
            self.seen[name] = len(whole)
        return new


def process_group(argv: list[str]) -> str | None:
    """What a process is, from its command line, for summing CPU time: a process that retitled itself
    (Ray's workers ``ray::WorkerDict.update_actor``, vLLM's ``VLLM::EngineCore``) by its title up to the
    method; a Python program by its module (``-m``) or its script's file name, so the DAG's own process
    (``python gpu_acceptance.py``, ``python airflow``) stands apart from Ray's (``python dashboard.py``);
    anything else by its program's file name. None for a kernel thread (no command line)."""
    if not argv or not argv[0]:
        return None
    head = argv[0].split()[0]
    if "::" in head:
        return head.split(".")[0]
    program = os.path.basename(head)
    if not program.startswith("python"):
        return program
    rest = argv[1:] if len(argv) > 1 else argv[0].split()[1:]
    for i, arg in enumerate(rest):
        if arg == "-m" and i + 1 < len(rest):
            return f"python -m {rest[i + 1]}"
        if arg == "-c":
            return "python -c"
        if not arg.startswith("-"):
            return f"python {os.path.basename(arg)}"
    return "python"


class ProcessCpu:
    """The CPU seconds every process on the machine used between two calls, summed by ``process_group``
    (``/proc/<pid>/stat``'s user and system time, all of a process's threads). A process seen for the
    first time after the first call counts from its start; one that ended between two calls loses what
    it used since the call before (a fraction of a poll); a reused PID is a new process (its start time
    differs). A process is named afresh at every call: a Ray worker starts as ``ray::IDLE`` and takes its
    actor's title when it is given one."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.proc = proc
        self.seen: dict[tuple[int, str], float] = {}
        self.primed = False

    def _stat(self, pid: int) -> tuple[str, float] | None:
        try:
            fields = (self.proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            return None
        # After the name: state is field 3, utime 14, stime 15, starttime 22 (proc(5)).
        return fields[19], (int(fields[11]) + int(fields[12])) / TICKS_PER_S

    def _name(self, pid: int) -> str | None:
        try:
            raw = (self.proc / str(pid) / "cmdline").read_bytes()
        except OSError:
            return None
        return process_group([a.decode(errors="replace") for a in raw.split(b"\0") if a])

    def __call__(self) -> dict[str, float]:
        used: dict[str, float] = {}
        now: dict[tuple[int, str], float] = {}
        for entry in self.proc.iterdir():
            if not entry.name.isdigit() or (stat := self._stat(int(entry.name))) is None:
                continue
            key = (int(entry.name), stat[0])
            now[key] = stat[1]
            delta = stat[1] - self.seen.get(key, 0.0 if self.primed else stat[1])
            if delta > 0 and (name := self._name(key[0])) is not None:
                used[name] = used.get(name, 0.0) + delta
        self.seen, self.primed = now, True
        return {name: round(cpu_s, 3) for name, cpu_s in used.items()}


class MachineCpu:
    """The whole machine's CPU seconds by state (:data:`STAT_FIELDS`) between two calls, from
    ``/proc/stat``; the first call gives none, it only sets where the next counts from."""

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self.stat = proc / "stat"
        self.last: list[int] | None = None

    def __call__(self) -> dict[str, float]:
        fields = self.stat.read_text().split("\n", 1)[0].split()[1:1 + len(STAT_FIELDS)]
        now = [int(v) for v in fields] + [0] * (len(STAT_FIELDS) - len(fields))
        before, self.last = self.last, now
        if before is None:
            return {}
        return {k: round((b - a) / TICKS_PER_S, 3) for k, a, b in zip(STAT_FIELDS, before, now, strict=True)}


def host_facts(proc: Path = Path("/proc")) -> dict[str, Any]:
    """The machine a recording ran on: its cores and its CPU's model as the environment probe reads it
    (None where ``cpuinfo`` names none). Two machines of one GPU kind can run one job two-fold apart."""
    from verl_pipeline.cluster.probe import cpu_model

    return {"kind": "host", "cores": os.cpu_count(), "cpu_model": cpu_model(str(proc / "cpuinfo"))}


def record(reader: Reader, watch: RowWatch, out: Path, poll_s: float, stop: threading.Event,
           clock: Callable[[], float] = time.time, cpu: CpuReader | None = None,
           machine: MachineReader | None = None) -> None:
    """Until ``stop`` is set: every ``poll_s`` the driver's new samples, the newly landed rows and, with
    ``cpu``, the machine's CPU time by process group since the poll before (with ``machine``, the whole
    machine's by state beside it), a line each; with ``cpu``, first a line that says which machine."""
    with out.open("a") as f:
        if cpu is not None:
            f.write(json.dumps(host_facts()) + "\n")
        while True:
            lines = [{"kind": "gpu", "gpu": g, "t": t, "util": u} for g, t, u in reader()]
            if cpu is not None:
                line: dict[str, Any] = {"kind": "cpu", "t": clock(), "groups": cpu()}
                if machine is not None:
                    line["machine"] = machine()
                lines.append(line)
            lines += watch.poll(clock())
            f.writelines(json.dumps(line) + "\n" for line in lines)
            f.flush()
            if stop.wait(poll_s):
                return


def nvml_reader() -> Reader:  # pragma: no cover - needs an NVIDIA driver (run on the GPU machine)
    """Every GPU's utilisation samples the driver kept since the last call (``nvmlDeviceGetSamples``).
    Their stamps are the CPU's microseconds; should a driver stamp on another clock, they are moved so
    the newest of a read is the read's time."""
    try:
        import pynvml
    except ImportError:  # the GPU site has Ray's copy of NVML's bindings (its dashboard reads GPUs with it)
        from ray._private.thirdparty import pynvml

    pynvml.nvmlInit()
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    last = [0] * len(handles)

    def read() -> list[tuple[int, float, float]]:
        now, out = time.time(), []
        for i, h in enumerate(handles):
            try:
                _, samples = pynvml.nvmlDeviceGetSamples(h, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last[i])
            except pynvml.NVMLError_NotFound:  # nothing new since the last read
                continue
            got = [(int(s.timeStamp), float(s.sampleValue.uiVal)) for s in samples if s.timeStamp > last[i]]
            if not got:
                continue
            newest = max(ts for ts, _ in got)
            shift = 0.0 if abs(newest / 1e6 - now) < 300 else now - newest / 1e6
            out += [(i, ts / 1e6 + shift, u) for ts, u in got]
            last[i] = newest
        return out

    return read


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record", help="read the driver's samples and the rows as they land, until stopped")
    rec.add_argument("--metrics", action="append", required=True, help="a glob of verl metrics files to watch")
    rec.add_argument("--out", type=Path, required=True)
    rec.add_argument("--poll-s", type=float, default=1.0)
    ana = sub.add_parser("analyse", help="each run's steps, phase by phase, from a recording")
    ana.add_argument("--samples", type=Path, required=True)
    ana.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    if args.command == "record":
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        record(nvml_reader(), RowWatch(args.metrics), args.out, args.poll_s, stop, cpu=ProcessCpu(),
               machine=MachineCpu())
        return 0
    lines = [json.loads(line) for line in args.samples.read_text().splitlines() if line.strip()]
    figures = analyse(lines)
    args.out.write_text(json.dumps(figures, indent=2))
    print(json.dumps(figures))
    return 0 if figures["runs"] else 1


if __name__ == "__main__":
    sys.exit(main())
