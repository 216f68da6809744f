"""How many multi-day waits one triggerer carries: the project's RayJobTrigger x N in one event loop.

Usage: nice -n 10 .venv/bin/python bench/triggerer_scale.py --jobs 1000 --seconds 150

A fake Ray 2.60 head (``bench/fake_ray_jobs_api.py``, its own process) serves N RUNNING jobs whose
logs start at 20 MB and grow by 5 KB per poll interval; this process runs N ``RayJobTrigger``s
(the project's, unchanged; 10 s polls, started spread over one interval, each with the cursor a
re-deferred waiter carries) and forwards their lines to a log file, as a triggerer would.

By default each wait gets the arguments the wait operator gives a training job on a cluster the
pipeline owns: the node count checked (``expected_nodes``, ``--nodes`` nodes of ``--gpus-per-node``
GPUs in the fake's node summary), the hang watchdog, verl's metrics file and the run directory
(cursor file, GPU usage file). Each job trains: its log shows verl's console line of a step every
``--step-seconds`` (60) and the fake then writes the step's row to the metrics file. ``--not-owned``
runs the waits of a cluster the pipeline does not own (no node check, no metrics file), as measured
before the owned-cluster arguments were added. All jobs are on one cluster (one host) unless
``--hosts K`` spreads them over K (each its own loopback address, so its own connections: 1,000 owned
clusters are ``--hosts 1000``).

Figures, over the window after one warm-up interval:
- CPU % of one core of this process (the triggerer's event loop), and its CPU time per poll made
  (the figure that holds when a loaded machine delays polls);
- polls made, and polls on time (started at most 1 s later than ``poll_interval`` after the
  previous one), as a share of the polls due (N x window / interval);
- log bytes Ray sent per poll (counted by the fake) against the new output per poll;
- requests per poll (job status, shared job list, log range, node summary) and the bytes per poll
  of the node summaries and job lists;
- how fast a run's GPU usage file grows, per GPU node and day, and the gaps between two samples of
  one node in the window (median, 99th percentile, largest; ``--gpu-sample-interval``, the wait's
  ``gpu_sample_interval``, default :class:`WaitRequest`'s);
- this process's RSS at the end and its peak.

``--profile FILE`` writes a cProfile (CPU time) of the measured window (pstats) and prints its top functions.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import itertools
import json
import logging
import os
import pstats
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
LINE = 100


class Recorder:
    def __init__(self) -> None:
        self.starts: dict[str, list[float]] = {}

    def poll(self, job_id: str) -> None:
        self.starts.setdefault(job_id, []).append(time.monotonic())


def timed_polls(trigger: Any, recorder: Recorder) -> None:
    """Record the start of each of ``trigger``'s polls (its status read: the job's own request, or its
    share of the cluster's job list)."""
    status = trigger._job_info

    async def timed(hook: Any) -> Any:
        recorder.poll(trigger.job_id)
        return await status(hook)

    trigger._job_info = timed


def _gpu_usage_bytes(run_dirs: str | None) -> int:
    """Bytes of every run's GPU usage file."""
    from verl_pipeline.rundir import RunDir

    if not run_dirs:
        return 0
    files = [RunDir(d).gpu_usage_file for d in Path(run_dirs).iterdir()]
    return sum(f.stat().st_size for f in files if f.exists())


def _sample_gaps(run_dirs: str | None, start: float, end: float) -> dict[str, float | None]:
    """Seconds between two consecutive GPU samples of one node of one run, over samples taken in
    ``[start, end]`` (epoch seconds): the median, the 99th percentile and the largest."""
    import statistics

    from verl_pipeline.jobs.gpu_usage import read_samples
    from verl_pipeline.rundir import RunDir

    gaps: list[float] = []
    for run_dir in Path(run_dirs).iterdir() if run_dirs else ():
        times: dict[str, list[float]] = {}
        for sample in read_samples(RunDir(run_dir).gpu_usage_file):
            if start <= sample.time <= end:
                times.setdefault(sample.node_id, []).append(sample.time)
        gaps += [b - a for node in times.values() for a, b in itertools.pairwise(sorted(node))]
    if not gaps:
        return {"median": None, "p99": None, "max": None}
    gaps.sort()
    return {"median": round(statistics.median(gaps), 2), "p99": round(gaps[int(0.99 * (len(gaps) - 1))], 2),
            "max": round(gaps[-1], 2)}


def _stats(url: str) -> dict[str, int]:
    import requests

    return dict(requests.get(f"{url}/_stats", timeout=30).json())


async def _run(args: argparse.Namespace, dashboard_urls: list[str], log_path: Path) -> dict[str, Any]:
    import psutil

    from verl_pipeline.airflow.hooks import RayJobsHook
    from verl_pipeline.airflow.triggers import RayJobTrigger
    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.jobs.wait_request import WaitRequest

    logger = logging.getLogger("bench.triggers")
    logger.propagate = False
    logger.setLevel(logging.INFO)
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    logger.addHandler(handler)

    def cluster_of(i: int) -> dict[str, Any]:
        url = dashboard_urls[i % len(dashboard_urls)]
        if args.owned:
            return ClusterHandle(backend="local", name=f"bench-{i}", dashboard_url=url, owned=True,
                                 expected_nodes=args.nodes, expected_gpus=args.nodes * args.gpus_per_node).to_dict()
        return ClusterHandle(backend="address", name=f"bench-{i}", dashboard_url=url, owned=False).to_dict()

    dashboard_url = dashboard_urls[0]
    recorder = Recorder()
    initial = args.initial_bytes - args.initial_bytes % LINE
    rng = random.Random(0)

    async def one(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, args.poll))  # waits deferred at different times
        # As the wait operator defers a training job: the hang watchdog on, the cursor saved in the run
        # dir; on an owned cluster also the node count and verl's metrics file.
        run_dir = Path(args.run_dirs) / f"run-{i}" if args.run_dirs else None
        if run_dir is not None:
            run_dir.mkdir(parents=True, exist_ok=True)
        cluster = cluster_of(i)
        request = WaitRequest(cluster=cluster, job_id=f"bench-job-{i}", poll_interval=args.poll,
                              log_offset_bytes=initial, total_steps=1000,
                              expected_nodes=args.nodes if args.owned else 0,
                              metrics_path=args.metrics_path.format(job=i) if args.metrics_path else None,
                              watch={} if args.watch else None, cursor_dir=str(run_dir) if run_dir else None,
                              gpu_sample_interval=args.gpu_sample_interval)
        trigger = RayJobTrigger(**request.to_dict())
        trigger._log = logger
        trigger._hook = lambda: RayJobsHook(cluster)
        timed_polls(trigger, recorder)
        async for event in trigger.run():
            logger.warning("trigger %s ended: %s", i, event.payload)

    tasks = [asyncio.create_task(one(i)) for i in range(args.jobs)]
    await asyncio.sleep(2 * args.poll)  # every trigger started and polled once
    stats0 = await asyncio.to_thread(_stats, dashboard_url)
    gpu_bytes0 = await asyncio.to_thread(_gpu_usage_bytes, args.run_dirs)
    profile = cProfile.Profile(time.process_time) if args.profile else None  # CPU time, not wall
    ru0, cpu0, t0, wall0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.monotonic(), time.time()
    if profile is not None:
        profile.enable()
    await asyncio.sleep(args.seconds)
    if profile is not None:
        profile.disable()
    ru1, cpu1, t1, wall1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.monotonic(), time.time()
    stats1 = await asyncio.to_thread(_stats, dashboard_url)
    gpu_bytes1 = await asyncio.to_thread(_gpu_usage_bytes, args.run_dirs)
    sample_gaps = await asyncio.to_thread(_sample_gaps, args.run_dirs, wall0, wall1)
    if profile is not None:
        profile.dump_stats(args.profile)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
        print(text.getvalue(), file=sys.stderr)
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)

    window = t1 - t0
    made = on_time = 0
    for starts in recorder.starts.values():
        for prev, cur in itertools.pairwise(starts):
            if t0 <= cur < t1:
                made += 1
                on_time += cur - prev <= args.poll + 1.0
    due = args.jobs * window / args.poll
    polls = made
    statuses = stats1["status_requests"] - stats0["status_requests"]
    lists = stats1["list_requests"] - stats0["list_requests"]
    list_bytes = stats1["list_body_bytes"] - stats0["list_body_bytes"]
    body = stats1["log_body_bytes"] - stats0["log_body_bytes"]
    ranges = stats1["range_requests"] - stats0["range_requests"]
    node_requests = stats1["node_requests"] - stats0["node_requests"]
    node_bytes = stats1["node_body_bytes"] - stats0["node_body_bytes"]
    growth = args.growth_bytes - args.growth_bytes % LINE
    return {
        "jobs": args.jobs, "window_s": round(window, 1), "poll_interval_s": args.poll,
        "cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / window, 1),
        "of_which_system_pct": round(100 * (ru1.ru_stime - ru0.ru_stime) / window, 1),
        "cpu_ms_per_poll": round(1000 * (cpu1 - cpu0) / max(made, 1), 2),
        "polls_made_pct": round(100 * made / due, 1), "polls_on_time_pct": round(100 * on_time / due, 1),
        "log_bytes_per_poll": round(body / max(polls, 1)), "new_output_per_poll": growth,
        "requests_per_poll": {"status": round(statuses / max(polls, 1), 3),
                              "job_list": round(lists / max(polls, 1), 4),
                              "log_range": round(ranges / max(polls, 1), 2),
                              "node_summary": round(node_requests / max(polls, 1), 2)},
        "job_list_bytes_per_poll": round(list_bytes / max(polls, 1)),
        "node_summary_bytes_per_poll": round(node_bytes / max(polls, 1)),
        # One run's file grows by this much per GPU node per day (every node of the fake has GPUs).
        "gpu_usage_bytes_per_gpu_node_per_day": round((gpu_bytes1 - gpu_bytes0) / args.jobs / args.nodes
                                                      / window * 86400),
        "gpu_sample_interval_s": args.gpu_sample_interval, "gpu_sample_gap_s": sample_gaps,
        "rss_mib_end": round(psutil.Process().memory_info().rss / 2**20),
        "rss_mib_peak": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "log_lines_written": sum(1 for _ in open(log_path, "rb")),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=1000)
    p.add_argument("--seconds", type=float, default=120.0, help="measured window (after a warm-up)")
    p.add_argument("--poll", type=float, default=10.0)
    p.add_argument("--initial-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--growth-bytes", type=int, default=5 * 1024)
    p.add_argument("--no-watch", dest="watch", action="store_false", help="without the hang watchdog")
    p.add_argument("--no-cursor-file", dest="cursor_file", action="store_false",
                   help="without saving the cursor in a run directory")
    p.add_argument("--not-owned", dest="owned", action="store_false",
                   help="waits on a cluster the pipeline does not own: no node check, no metrics file")
    p.add_argument("--hosts", type=int, default=1,
                   help="clusters the jobs are spread over, each on its own loopback address (default: all on one)")
    p.add_argument("--nodes", type=int, default=2, help="nodes of each owned cluster (all alive)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--step-seconds", type=float, default=60.0, help="seconds between two training steps")
    p.add_argument("--gpu-sample-interval", type=float, default=None,
                   help="the waits' gpu_sample_interval (default: WaitRequest's)")
    p.add_argument("--profile", help="write a cProfile of the measured window here (pstats)")
    p.add_argument("--out", help="also write the figures here (JSON)")
    args = p.parse_args()
    if args.gpu_sample_interval is None:
        from verl_pipeline.jobs.wait_request import WaitRequest

        args.gpu_sample_interval = WaitRequest.gpu_sample_interval
    if args.owned and not args.cursor_file:
        p.error("an owned cluster's wait has its run directory: drop --no-cursor-file or add --not-owned")

    from verl_pipeline.rundir import RunDir

    tmp = tempfile.TemporaryDirectory(prefix="triggerer-scale-")
    args.run_dirs = str(Path(tmp.name) / "runs") if args.cursor_file else None
    args.metrics_path = (str(RunDir(Path(args.run_dirs) / "run-{job}").metrics_file(1))
                         if args.owned and args.run_dirs else None)
    fake_args = [sys.executable, str(REPO / "bench" / "fake_ray_jobs_api.py"), "--jobs", str(args.jobs),
                 "--initial-bytes", str(args.initial_bytes), "--growth-bytes", str(args.growth_bytes),
                 "--interval", str(args.poll), "--nodes", str(args.nodes), "--gpus-per-node", str(args.gpus_per_node),
                 "--step-seconds", str(args.step_seconds), "--hosts", str(args.hosts)]
    if args.metrics_path:
        fake_args += ["--metrics-path", args.metrics_path]
    # The fake stands for a cluster on other machines: it runs at normal priority when the waiters are niced.
    fake = subprocess.Popen(fake_args, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: os.setpriority(os.PRIO_PROCESS, 0, 0))
    try:
        assert fake.stdout is not None
        urls = json.loads(fake.stdout.readline())
        import psutil

        fake_proc = psutil.Process(fake.pid)
        fake_cpu0 = sum(fake_proc.cpu_times()[:2])
        out = asyncio.run(_run(args, urls["dashboard_urls"], Path(tmp.name) / "triggers.log"))
        out["owned_cluster"], out["watchdog"], out["cursor_file"] = args.owned, args.watch, args.cursor_file
        out["clusters"] = args.hosts
        out["fake_ray_cpu_s"] = round(sum(fake_proc.cpu_times()[:2]) - fake_cpu0, 1)
        print(json.dumps(out, indent=2))
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    finally:
        fake.terminate()
        try:
            fake.wait(10)
        except subprocess.TimeoutExpired:
            fake.kill()
        tmp.cleanup()


if __name__ == "__main__":
    main()
