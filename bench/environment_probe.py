"""Time of the environment probe on the embedded default (target: <= 5 s).

Usage: .venv/bin/python bench/environment_probe.py [--runs 5] [--profile gpu-acceptance --mode train]

Starts the embedded default's local Ray head (the ``local-cpu`` cluster profile; ``--profile``: that
run profile's cluster, e.g. the one-GPU ``local-gpu`` of ``gpu-acceptance``), builds the run's data
and model, renders its job and runs the probe the submit task runs
(:func:`verl_pipeline.cluster.probe.run_probe`, the job's own ``runtime_env``) ``--runs`` times,
then stops the head. Prints each run's wall time from submit to report with its parts: the
submission (package upload check), the job's start (supervisor + driver process), ``ray.init``
in the driver, and the pinned per-node tasks (worker start + imports + path checks).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--profile", help="a run profile (default: the embedded default)")
    parser.add_argument("--mode", help="the run's mode (train on a GPU cluster; default: the profile's)")
    args = parser.parse_args()
    os.environ.setdefault("VERL_PIPELINE_HOME", tempfile.mkdtemp(prefix="vp-bench-probe-"))
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    from verl_pipeline import steps
    from verl_pipeline.cluster.probe import run_probe
    from verl_pipeline.models.prefetch import prefetch_run
    from verl_pipeline.profiles import build_run_spec
    from verl_pipeline.trainer.environment import evaluate, installed_verl_pins, needs_for

    conf = {k: v for k, v in (("profile", args.profile), ("mode", args.mode)) if v}
    spec = build_run_spec(conf, run_name="bench/probe")
    handle = steps.provision(spec)
    try:
        data = steps.preprocess(spec).to_dict()
        models = prefetch_run(spec)
        client = handle.client()
        mode = steps.choose_mode(spec, steps.cluster_status(handle, client))
        job = steps.render(spec, data=data, models=models, mode=mode)
        needs = needs_for(job.settings, installed_verl_pins())
        rows = []
        for i in range(args.runs):
            raw = run_probe(client, request=needs.request(), runtime_env=job.runtime_env,
                            id_prefix="verl-bench", timeout_s=60)
            node = raw["nodes"][0]["facts"]
            start = raw["driver"]["started_at"] - raw["submitted_at"] - raw["submit_s"]
            rows.append({"run": i + 1, "wall_s": raw["wall_seconds"], "submit_s": raw["submit_s"],
                         "job_start_s": round(start, 2), "ray_init_s": raw["driver"]["ray_init_s"],
                         "tasks_s": raw["seconds"], "node_facts_s": node["seconds"],
                         "imports_s": {m: e["seconds"] for m, e in node["modules"].items()},
                         "findings": len(evaluate(needs, raw["nodes"]))})
            print(json.dumps(rows[-1]))
        walls = [r["wall_s"] for r in rows]
        print(f"probe of {args.profile or 'the embedded default'} ({mode.value}, {len(raw['nodes'])} node): median "
              f"{statistics.median(walls):.2f}s, first {walls[0]:.2f}s, min {min(walls):.2f}s, max {max(walls):.2f}s "
              f"over {len(walls)} runs (target <= 5 s)")
    finally:
        steps.teardown(handle, run_dir=Path(spec.run_dir))


if __name__ == "__main__":
    main()
