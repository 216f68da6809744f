"""How long a fresh Python process takes to import what verl's processes import, on this machine.

A verl start is a chain of fresh processes, each importing torch, vLLM or verl before it does its
work: the job's driver, the TaskRunner, the worker group's ``WorkerDict`` actors, the rollout server,
vLLM's engine core and its GPU worker, the reward and agent loop workers. On the H200 (2026-12-04) a warm
restart spent 20-30 s between one of them and the next (docs/benchmarks.md). This says how much of
that is the import alone: each module imported in a fresh interpreter (``-X importtime``), ``--repeat``
times (the first may read from disk, the later ones from the page cache), and with ``--cuda`` the
first CUDA call of a process (torch's context on the GPU).

Usage: python bench/import_cost.py [--module M ...] [--repeat 2] [--cuda] [--out FILE.json]
Prints a line per module and repeat, then the modules that cost most on the last repeat.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

#: What verl 0.9.1's processes import first: its trainer's entry (the driver, the TaskRunner), its
#: engine workers (the worker group), vLLM and verl's server on it (the rollout server; vLLM alone: its
#: engine core and GPU worker), its reward and agent loops (``reward.num_workers`` and
#: ``actor_rollout_ref.rollout.agent.num_workers`` actors, 8 each by default, all started at once), and
#: what they all stand on.
DEFAULT_MODULES = ("ray", "torch", "transformers", "vllm", "verl.trainer.main_ppo", "verl.workers.engine_workers",
                   "verl.workers.rollout.vllm_rollout.vllm_async_server", "verl.experimental.reward_loop",
                   "verl.experimental.agent_loop")
#: A process's first CUDA call: torch's context on the GPU.
CUDA_CODE = "import torch; torch.zeros(1, device='cuda'); torch.cuda.synchronize()"
TOP = 12


@dataclass
class Cost:
    """One import in a fresh interpreter."""

    module: str
    repeat: int
    wall_s: float
    ok: bool
    #: The modules that took longest themselves (``-X importtime``'s self time), seconds, longest first.
    top_self_s: list[tuple[str, float]] = field(default_factory=list)
    #: The module's direct imports with all they import in turn (cumulative), seconds, longest first.
    top_cumulative_s: list[tuple[str, float]] = field(default_factory=list)
    error: str = ""


def parse_importtime(stderr: str) -> tuple[list[tuple[str, float]], list[tuple[str, float]]]:
    """``-X importtime``'s lines (``import time: self [us] | cumulative | name``, nested names indented
    two spaces a level) as the top modules by self time and, at the outermost level, by cumulative time."""
    own: list[tuple[str, float]] = []
    outer: list[tuple[str, float]] = []
    for line in stderr.splitlines():
        if not line.startswith("import time:") or "self [us]" in line:
            continue
        try:
            self_us, cumulative_us, name = line.removeprefix("import time:").split("|", 2)
            self_s, cumulative_s = int(self_us) / 1e6, int(cumulative_us) / 1e6
        except ValueError:
            continue
        own.append((name.strip(), self_s))
        depth = (len(name) - len(name.lstrip(" ")) - 1) // 2
        if depth <= 1:
            outer.append((name.strip(), cumulative_s))
    return (sorted(own, key=lambda x: -x[1])[:TOP], sorted(outer, key=lambda x: -x[1])[:TOP])


def measure(code: str, label: str, repeat: int, *, python: str = sys.executable, timeout_s: float = 600) -> Cost:
    """Run ``code`` in a fresh interpreter with ``-X importtime``: its wall time and what took it."""
    t0 = time.perf_counter()
    try:
        done = subprocess.run([python, "-X", "importtime", "-c", code], capture_output=True, text=True,
                              timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return Cost(label, repeat, time.perf_counter() - t0, False, error=f"timed out after {timeout_s:.0f} s")
    wall = time.perf_counter() - t0
    own, outer = parse_importtime(done.stderr)
    said = [line for line in done.stderr.splitlines() if line.strip() and not line.startswith("import time:")]
    error = "" if done.returncode == 0 else (said[-1][:300] if said else f"exit {done.returncode}")
    return Cost(label, repeat, round(wall, 3), done.returncode == 0, own, outer, error)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", action="append", help="a module to import (repeatable; default: verl's own)")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--cuda", action="store_true", help="also time a process's first CUDA call")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    jobs = [(f"import {m}", m) for m in args.module or DEFAULT_MODULES]
    if args.cuda:
        jobs.append((CUDA_CODE, "torch + first CUDA call"))
    costs = []
    for repeat in range(1, args.repeat + 1):
        for code, label in jobs:
            cost = measure(code, label, repeat)
            costs.append(cost)
            print(f"{label}: {cost.wall_s:.2f} s (repeat {repeat})" + ("" if cost.ok else f" FAILED: {cost.error}"),
                  flush=True)
    for cost in costs[-len(jobs):]:
        if cost.ok:
            print(f"{cost.module}, longest: " + ", ".join(f"{n} {s:.2f} s" for n, s in cost.top_cumulative_s[:6]))
    if args.out:
        args.out.write_text(json.dumps({"python": sys.version, "costs": [asdict(c) for c in costs]}, indent=1))
    return 0 if all(c.ok for c in costs) else 1


if __name__ == "__main__":
    sys.exit(main())
