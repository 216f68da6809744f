"""How many multi-day waits one triggerer carries: the project's RayJobTrigger x N in one event loop.

Usage: nice -n 10 .venv/bin/python bench/triggerer_scale.py --jobs 1000 --seconds 150

A fake Ray 2.60 head (``bench/fake_ray_jobs_api.py``, its own process) serves N RUNNING jobs whose
logs start at 20 MB and grow by 5 KB per poll interval; this process runs N ``RayJobTrigger``s
(the project's, unchanged; 10 s polls, started spread over one interval, each with the cursor a
re-deferred waiter carries) and forwards their lines to a log file, as a triggerer would.

Figures, over the window after one warm-up interval:
- CPU % of one core of this process (the triggerer's event loop);
- polls made, and polls on time (started at most 1 s later than ``poll_interval`` after the
  previous one), as a share of the polls due (N x window / interval);
- log bytes Ray sent per poll (counted by the fake) against the new output per poll;
- this process's RSS at the end and its peak.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
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


class TimedHook:
    """The project's hook, with the start of each poll (the status request) recorded."""

    def __init__(self, inner: Any, recorder: Recorder) -> None:
        self.inner, self.recorder = inner, recorder

    async def __aenter__(self) -> TimedHook:
        await self.inner.__aenter__()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.inner.__aexit__(*exc)

    async def aget_job(self, job_id: str) -> Any:
        self.recorder.poll(job_id)
        return await self.inner.aget_job(job_id)

    def alog_stream(self, info: Any, start: int, *, max_bytes: int) -> Any:
        return self.inner.alog_stream(info, start, max_bytes=max_bytes)

    async def anodes_alive(self) -> int:
        return int(await self.inner.anodes_alive())


def _stats(url: str) -> dict[str, int]:
    import requests

    return dict(requests.get(f"{url}/_stats", timeout=30).json())


async def _run(args: argparse.Namespace, dashboard_url: str, log_path: Path) -> dict[str, Any]:
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

    cluster = ClusterHandle(backend="address", name="bench", dashboard_url=dashboard_url, owned=False).to_dict()
    recorder = Recorder()
    initial = args.initial_bytes - args.initial_bytes % LINE
    rng = random.Random(0)

    async def one(i: int) -> None:
        await asyncio.sleep(rng.uniform(0, args.poll))  # waits deferred at different times
        # As the wait operator defers a training job: the hang watchdog on, the cursor saved in the run dir.
        run_dir = Path(args.run_dirs) / f"run-{i}" if args.run_dirs else None
        request = WaitRequest(cluster=cluster, job_id=f"bench-job-{i}", poll_interval=args.poll,
                              log_offset_bytes=initial, total_steps=1000,
                              watch={} if args.watch else None, cursor_dir=str(run_dir) if run_dir else None)
        trigger = RayJobTrigger(**request.to_dict())
        trigger._log = logger
        trigger._hook = lambda: TimedHook(RayJobsHook(cluster), recorder)
        async for event in trigger.run():
            logger.warning("trigger %s ended: %s", i, event.payload)

    tasks = [asyncio.create_task(one(i)) for i in range(args.jobs)]
    await asyncio.sleep(2 * args.poll)  # every trigger started and polled once
    stats0 = await asyncio.to_thread(_stats, dashboard_url)
    ru0, cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.monotonic()
    await asyncio.sleep(args.seconds)
    ru1, cpu1, t1 = resource.getrusage(resource.RUSAGE_SELF), time.process_time(), time.monotonic()
    stats1 = await asyncio.to_thread(_stats, dashboard_url)
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
    polls = stats1["status_requests"] - stats0["status_requests"]
    body = stats1["log_body_bytes"] - stats0["log_body_bytes"]
    growth = args.growth_bytes - args.growth_bytes % LINE
    return {
        "jobs": args.jobs, "window_s": round(window, 1), "poll_interval_s": args.poll,
        "cpu_pct_of_one_core": round(100 * (cpu1 - cpu0) / window, 1),
        "of_which_system_pct": round(100 * (ru1.ru_stime - ru0.ru_stime) / window, 1),
        "polls_made_pct": round(100 * made / due, 1), "polls_on_time_pct": round(100 * on_time / due, 1),
        "log_bytes_per_poll": round(body / max(polls, 1)), "new_output_per_poll": growth,
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
    args = p.parse_args()

    fake = subprocess.Popen(
        [sys.executable, str(REPO / "bench" / "fake_ray_jobs_api.py"), "--jobs", str(args.jobs),
         "--initial-bytes", str(args.initial_bytes), "--growth-bytes", str(args.growth_bytes),
         "--interval", str(args.poll)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert fake.stdout is not None
        urls = json.loads(fake.stdout.readline())
        import psutil

        fake_proc = psutil.Process(fake.pid)
        fake_cpu0 = sum(fake_proc.cpu_times()[:2])
        with tempfile.TemporaryDirectory(prefix="triggerer-scale-") as tmp:
            args.run_dirs = str(Path(tmp) / "runs") if args.cursor_file else None
            out = asyncio.run(_run(args, urls["dashboard_url"], Path(tmp) / "triggers.log"))
            out["watchdog"], out["cursor_file"] = args.watch, args.cursor_file
        out["fake_ray_cpu_s"] = round(sum(fake_proc.cpu_times()[:2]) - fake_cpu0, 1)
        print(json.dumps(out, indent=2))
    finally:
        fake.terminate()
        try:
            fake.wait(10)
        except subprocess.TimeoutExpired:
            fake.kill()


if __name__ == "__main__":
    main()
