"""How long the Airflow-side configuration checks take: scaling rules, and verl's own compose + validate.

Prints one line per figure. Run: ``PYTHONPATH=include python bench/config_validation.py``.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

os.environ.setdefault("VERL_PIPELINE_HOME", tempfile.mkdtemp(prefix="vp-bench-"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from verl_pipeline import steps
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.profiles import build_run_spec, list_profiles
from verl_pipeline.trainer.validate import session

NNODES = (1, 2, 4, 8, 16, 32, 64)
GPUS = (1, 2, 4, 8)


def main() -> None:
    t0 = time.perf_counter()
    for _ in range(200):
        build_run_spec({"nnodes": 32, "n_gpus_per_node": 8}, run_name="b", model_profile="qwen2.5-32b-grpo",
                       cluster_profile="h100-ib")
    print(f"profiles + scaling rules + project checks: {(time.perf_counter() - t0) / 200 * 1000:.1f} ms per run")

    spec = build_run_spec({"nnodes": 4, "n_gpus_per_node": 8}, run_name="b", model_profile="qwen2.5-7b-grpo",
                          cluster_profile="h100-ib")
    t0 = time.perf_counter()
    steps.validate_spec_with_verl(spec)
    print(f"verl compose + validate, first call in a process (imports verl, hydra): "
          f"{time.perf_counter() - t0:.2f} s")
    warm = []
    for _ in range(5):
        t0 = time.perf_counter()
        steps.validate_spec_with_verl(spec)
        warm.append(time.perf_counter() - t0)
    print(f"verl compose + validate, later calls: median {statistics.median(warm):.2f} s")

    times, skipped = [], 0
    t_all, cpu_all = time.perf_counter(), time.process_time()
    with session():
        for mp in list_profiles("models"):
            for g in GPUS:
                for n in NNODES:
                    t0 = time.perf_counter()
                    try:
                        s = build_run_spec({"nnodes": n, "n_gpus_per_node": g}, run_name="b", model_profile=mp,
                                           cluster_profile="gpu-address")
                    except ConfigError:
                        skipped += 1
                        continue
                    steps.validate_spec_with_verl(s)
                    times.append(time.perf_counter() - t0)
    total, cpu = time.perf_counter() - t_all, time.process_time() - cpu_all
    print(f"matrix: {len(times)} combinations validated by verl (+{skipped} rejected: model does not fit) in "
          f"{total:.1f} s wall, {cpu:.1f} s CPU; per combination median {statistics.median(times):.2f} s, "
          f"max {max(times):.2f} s wall")
    print(f"load average while measuring: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPU(s)")


if __name__ == "__main__":
    main()
