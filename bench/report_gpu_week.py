"""The run report's GPU section on a long run's samples: how long it takes and how much memory it needs.

Usage: nice -n 10 .venv/bin/python bench/report_gpu_week.py --days 7 --nodes 8 --gpus-per-node 8

Writes a run directory whose ``gpu-usage.jsonl`` holds ``--days`` of the waiter's samples (one line
per node every 10 s, in the waiter's own format, each GPU with its UUID; the nodes' raylets restart
once halfway, under new Ray node ids), one attempt that trained the whole time, and a metrics file;
then builds the report with its plots (``report.write.write_report``, the report task's function).

Figures: the usage file's size, the seconds to build the report (reading the samples, summarising,
drawing), this process's peak RSS before and after, the rows of the GPU table (one per GPU).
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path

from verl_pipeline.jobs.gpu_usage import GpuReading, NodeGpuSample, append_samples
from verl_pipeline.jobs.progress import Progress, record_first_step
from verl_pipeline.report.build import RunOutcome
from verl_pipeline.report.write import write_report
from verl_pipeline.rundir import Attempt, RunDir

SAMPLE_S = 10.0
START = 1_800_000_000.0


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _write_run(run_dir: Path, days: float, nodes: int, gpus: int) -> int:
    run = RunDir(run_dir)
    run_dir.mkdir(parents=True)
    run.save_spec({"run_name": "bench/week", "profile": "bench", "nnodes": nodes, "n_gpus_per_node": gpus,
                   "total_training_steps": 1000, "storage_root": str(run_dir.parent.parent)})
    run.save_job({"mode": "train"})
    run.record_attempt(Attempt("bench-a1", 1, START, "http://127.0.0.1:8265", 0, str(run.metrics_file(1))))
    end = START + days * 86400
    rows = [{"step": s, "data": {"training/global_step": s, "perf/time_per_step": 600.0}} for s in range(1, 1001)]
    run.metrics_file(1).write_text("".join(json.dumps(r) + "\n" for r in rows))
    record_first_step(run.metrics_file(1), Progress(step=1, total=1000, first_step_seen_at=START + 600))
    import os

    os.utime(run.metrics_file(1), (end, end))
    halfway = START + days * 43200
    t, batch = START, []
    while t < end:
        for n in range(nodes):
            raylet = f"{n:02x}{'b' if t >= halfway else 'a'}" * 14  # a new Ray node id after the restart
            batch.append(NodeGpuSample(t, raylet, f"10.0.0.{n + 1}", tuple(
                GpuReading(g, float((t // 60 + g) % 100), 90_000.0 + g, 143_771.0,
                           f"GPU-{n:04x}{g:04x}-0000-0000-0000-000000000000") for g in range(gpus))))
        if len(batch) >= 6 * nodes:  # the waiter appends once a minute
            append_samples(run.gpu_usage_file, batch)
            batch = []
        t += SAMPLE_S
    append_samples(run.gpu_usage_file, batch)
    return run.gpu_usage_file.stat().st_size


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--days", type=float, default=7.0)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="report-gpu-week-") as tmp:
        run_dir = Path(tmp) / "runs" / "week"
        t0 = time.monotonic()
        size = _write_run(run_dir, args.days, args.nodes, args.gpus_per_node)
        written_s = time.monotonic() - t0
        rss_before = _peak_mib()
        t0 = time.monotonic()
        files = write_report(run_dir, status=RunOutcome.SUCCEEDED)
        built_s = time.monotonic() - t0
        report = files.report
        print(json.dumps({
            "days": args.days, "nodes": args.nodes, "gpus": args.nodes * args.gpus_per_node,
            "usage_file_mb": round(size / 1e6, 1), "samples_per_gpu": report.gpus[0].samples if report.gpus else 0,
            "write_s": round(written_s, 1), "report_s": round(built_s, 1),
            "peak_rss_mib_before_report": round(rss_before), "peak_rss_mib_after_report": round(_peak_mib()),
            "gpu_rows": len(report.gpus), "ray_node_ids_per_gpu": len(report.gpus[0].node_ids) if report.gpus else 0,
            "gpu_plots": len(report.gpu_plots),
        }, indent=2))


if __name__ == "__main__":
    main()
