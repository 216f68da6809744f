"""What one wait poll costs the Ray head: a real local job with a 50 MB log, whole-log vs ranged reads.

Usage: nice -n 10 .venv/bin/python bench/ray_log_poll_cost.py [--mb 50] [--polls 10]

Starts a local Ray head with the project's local backend (its own processes, stopped by PID at the
end), submits a job that prints ``--mb`` MB and then keeps running, and measures the CPU time of
every process of that cluster (dashboard, its job module, the dashboard agent, …) over ``--polls``
polls of each kind, minus the cluster's idle CPU over the same time:

- before: what the trigger did per poll until now: ``GET /api/jobs/{id}`` + ``GET /api/jobs/{id}/logs``
  (Ray's agent reads the whole file, the head relays it as JSON);
- after: ``GET /api/jobs/{id}`` + the driver agent's ``/logs/job-driver-{id}.log`` with
  ``Range: bytes=<cursor>-`` for the last 5 KB (what ``RayJobTrigger`` now reads per poll).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def _cluster_procs(handle: Any) -> list[psutil.Process]:
    from verl_pipeline.cluster import procs

    out: dict[int, psutil.Process] = {}
    for rec in procs.alive(procs.with_cmdline(handle.extra["temp_dir"])):
        try:
            p = psutil.Process(rec.pid)
            out[p.pid] = p
            for c in p.children(recursive=True):
                out[c.pid] = c
        except psutil.NoSuchProcess:
            continue
    for pid, _ in handle.extra.get("pids", []):
        try:
            out.setdefault(pid, psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    return list(out.values())


def _cpu(ps: list[psutil.Process]) -> dict[str, float]:
    by_name: dict[str, float] = {}
    for p in ps:
        try:
            t = p.cpu_times()
            name = " ".join(p.cmdline()[:2])[-60:] or p.name()
        except psutil.Error:
            continue
        by_name[name] = by_name.get(name, 0.0) + t.user + t.system
    return by_name


async def _measure(ps: list[psutil.Process], polls: int, poll: Callable[[], Awaitable[int]]) -> dict[str, Any]:
    before, t0 = _cpu(ps), time.monotonic()
    body = 0
    for _ in range(polls):
        body += await poll()
        await asyncio.sleep(0.5)
    after, took = _cpu(ps), time.monotonic() - t0
    return {"cpu": {k: after.get(k, 0.0) - v for k, v in before.items()}, "seconds": took, "bytes": body}


async def _bench(args: argparse.Namespace, handle: Any) -> dict[str, Any]:
    import aiohttp


    sync = handle.client()
    job_id = f"logcost-{int(time.time())}"
    line = "x" * 99
    sync.submit(entrypoint=f"python -c \"import time\nfor _ in range({args.mb * 10_000}): print('{line}')\n"
                           "print('done', flush=True)\ntime.sleep(3600)\"",
                submission_id=job_id, runtime_env={})
    ps = _cluster_procs(handle)
    async with aiohttp.ClientSession() as session:
        client = handle.client(session=session)  # with the cluster's token
        deadline = time.monotonic() + 600
        while True:
            info = await client.aget_job(job_id)
            if info is not None and info.driver_agent_http_address:
                async with client.alog_stream(info, 0, max_bytes=1) as s:
                    if s.size and s.size >= args.mb * 1_000_000:
                        size = s.size
                        break
            if time.monotonic() > deadline:
                raise SystemExit("the job did not print its log in time")
            await asyncio.sleep(1)
        await asyncio.sleep(3)
        ps = _cluster_procs(handle)
        assert info is not None
        job = info

        async def idle() -> int:
            return 0

        async def whole() -> int:
            await client.aget_job(job_id)
            return len(await client.alogs(job_id))

        async def ranged() -> int:
            await client.aget_job(job_id)
            n = 0
            async with client.alog_stream(job, size - 5 * 1024, max_bytes=1 << 20) as s:
                async for chunk in s.chunks():
                    n += len(chunk)
            return n

        out = {"log_bytes": size}
        for name, fn in (("idle", idle), ("before_whole_log", whole), ("after_ranged", ranged)):
            out[name] = await _measure(ps, args.polls, fn)
        sync.stop(job_id)
    idle_rate = sum(out["idle"]["cpu"].values()) / out["idle"]["seconds"]
    out["idle_cpu_pct"] = round(100 * idle_rate, 1)
    del out["idle"]
    for name in ("before_whole_log", "after_ranged"):
        m = out[name]
        total = sum(m["cpu"].values()) - idle_rate * m["seconds"]
        m["head_cpu_ms_per_poll"] = round(1000 * total / args.polls, 1)
        m["bytes_per_poll"] = m["bytes"] // args.polls
        m["top"] = sorted(((round(v, 2), k) for k, v in m["cpu"].items() if v > 0.05), reverse=True)[:4]
        del m["cpu"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mb", type=int, default=50)
    p.add_argument("--polls", type=int, default=10)
    args = p.parse_args()
    from verl_pipeline.cluster.local import LocalBackend

    backend = LocalBackend.from_spec({"backend": "local", "num_cpus": 2, "stop_grace_s": 3})
    handle = backend.provision(f"bench/log-poll-cost-{os.getpid()}")
    try:
        print(json.dumps(asyncio.run(_bench(args, handle)), indent=2))
    finally:
        backend.teardown(handle)


if __name__ == "__main__":
    main()
