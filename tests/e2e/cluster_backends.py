"""Time the Slurm backend's lifecycle on a throwaway single-host Slurm, and KubeRay manifest validation.

    PYTHONPATH=include:. .venv/bin/python tests/e2e/cluster_backends.py [--runs 3]

Prints a markdown table (median, min, max seconds): the rows of docs/benchmarks.md's table.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "include"))

from tests.cluster.slurm_fixture import processes_of_job, slurm_cluster  # noqa: E402
from tests.cluster.test_kuberay import SCHEMAS, strict  # noqa: E402
from tests.cluster.test_slurm import slurm_test_spec  # noqa: E402
from verl_pipeline.cluster.registry import get_backend  # noqa: E402
from verl_pipeline.cluster.slurm import SlurmBackend  # noqa: E402


def _row(name: str, values: list[float]) -> str:
    return f"| {name} | {statistics.median(values):.1f} | {min(values):.1f} | {max(values):.1f} |"


def bench_slurm(runs: int) -> list[str]:
    phases: dict[str, list[float]] = {k: [] for k in ("slurm start", "sbatch → RUNNING", "RUNNING → head published",
                                                      "head published → 2 nodes + Jobs API ready", "provision total",
                                                      "teardown (scancel → left the queue)")}
    t0 = time.monotonic()
    gen = slurm_cluster(nodes=2, cpus_per_node=2)
    cluster = next(gen)
    phases["slurm start"].append(time.monotonic() - t0)
    try:
        for i in range(runs):
            backend = get_backend(slurm_test_spec(cluster, Path(tempfile.mkdtemp(prefix="vp-bench-"))))
            assert isinstance(backend, SlurmBackend)
            marks: dict[str, float] = {}
            orig_running, orig_head = backend._wait_running, backend._wait_head_file

            def running(h: Any, _o: Any = orig_running, _m: dict[str, float] = marks) -> None:
                _m["submitted"] = time.monotonic()
                _o(h)
                _m["running"] = time.monotonic()

            def head(h: Any, _o: Any = orig_head, _m: dict[str, float] = marks) -> dict[str, Any]:
                out: dict[str, Any] = _o(h)
                _m["head"] = time.monotonic()
                return out

            object.__setattr__(backend, "_wait_running", running)
            object.__setattr__(backend, "_wait_head_file", head)
            start = time.monotonic()
            handle = backend.provision(f"bench/slurm-{i}")
            end = time.monotonic()
            phases["sbatch → RUNNING"].append(marks["running"] - marks["submitted"])
            phases["RUNNING → head published"].append(marks["head"] - marks["running"])
            phases["head published → 2 nodes + Jobs API ready"].append(end - marks["head"])
            phases["provision total"].append(end - start)
            t1 = time.monotonic()
            backend.teardown(handle)
            phases["teardown (scancel → left the queue)"].append(time.monotonic() - t1)
            deadline = time.monotonic() + 15
            while processes_of_job(handle.extra["job_id"]) and time.monotonic() < deadline:
                time.sleep(0.5)
            assert processes_of_job(handle.extra["job_id"]) == [], "a process of the allocation survived"
    finally:
        try:
            next(gen)
        except StopIteration:
            pass
    return [_row(k, v) for k, v in phases.items() if v]


def bench_kuberay() -> list[str]:
    import yaml
    from jsonschema import Draft7Validator

    t0 = time.monotonic()
    validators = {k: Draft7Validator(strict(json.loads((SCHEMAS / f"ray.io_{p}.v1.schema.json").read_text())))
                  for k, p in (("RayCluster", "rayclusters"), ("RayJob", "rayjobs"))}
    load = time.monotonic() - t0
    spec = yaml.safe_load((REPO / "configs" / "clusters" / "kuberay-gpu.yaml").read_text())["cluster"]
    per: list[float] = []
    for i in range(50):
        t1 = time.monotonic()
        for m in get_backend(spec).manifests(f"bench/{i}"):  # type: ignore[attr-defined]
            assert not list(validators[m["kind"]].iter_errors(m))
        per.append((time.monotonic() - t1) * 1000 / 2)
    return [f"| strict CRD schemas loaded (both) | {load:.1f} | | |",
            f"| build + validate one manifest (ms) | {statistics.median(per):.1f} | {min(per):.1f} | {max(per):.1f} |"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    print("| phase (seconds) | median | min | max |\n|---|---|---|---|")
    for line in bench_slurm(args.runs) + bench_kuberay():
        print(line)


if __name__ == "__main__":
    main()
