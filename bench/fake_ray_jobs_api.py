"""A stand-in for a Ray 2.60 head serving N RUNNING jobs with big, growing logs (for benchmarks).

Serves what the wait path reads, in Ray's formats (read from ``ray/dashboard/modules/job/job_head.py``
and ``ray/dashboard/modules/log/log_agent.py``, checked against a real local job):

- dashboard port: ``GET /api/jobs/{id}`` (JobDetails JSON, ``application/json; charset=utf-8``) and
  ``GET /api/jobs/{id}/logs`` (``{"logs": "<whole log>"}``: what the trigger before streaming read);
- agent port (``driver_agent_http_address``): ``GET /logs/job-driver-{id}.log``, the agent's
  ``routes.static("/logs", log_dir)``, i.e. aiohttp's file response: ``Range: bytes=N-`` gives 206
  with ``Content-Range: bytes N-M/SIZE``, N at or past the end gives 416 with ``bytes */SIZE``,
  an unknown file 404; ``application/octet-stream``.

Each job's log is virtual (no 20 GB on disk): 100-byte lines whose content is a function of the
offset, ``initial_bytes`` long at start and ``growth_bytes`` longer every ``interval`` seconds
(each job at its own phase). ``GET /_stats`` (not a Ray route) reports the body bytes and requests
served, for the benchmark's bytes-per-poll figure.

    python bench/fake_ray_jobs_api.py --jobs 1000 --port 0 --agent-port 0
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from email.utils import formatdate
from typing import Any

from aiohttp import web

LINE = 100


def _line(job: int, n: int) -> bytes:
    head = f"(TaskRunnerV1 pid={1000 + job}) job {job} line {n:012d} "
    return (head + "x" * (LINE - 1 - len(head))).encode() + b"\n"


class FakeRay:
    def __init__(self, jobs: int, initial_bytes: int, growth_bytes: int, interval: float) -> None:
        self.jobs = jobs
        self.initial = initial_bytes - initial_bytes % LINE
        self.growth = growth_bytes - growth_bytes % LINE
        self.interval = interval
        self.t0 = time.monotonic()
        self.started_ms = int(time.time() * 1000)
        self.agent_url = ""
        self.stats: dict[str, int] = {"status_requests": 0, "whole_log_requests": 0, "range_requests": 0,
                                      "log_body_bytes": 0}

    def job_index(self, submission_id: str) -> int | None:
        prefix = "bench-job-"
        if not submission_id.startswith(prefix):
            return None
        try:
            i = int(submission_id[len(prefix):])
        except ValueError:
            return None
        return i if 0 <= i < self.jobs else None

    def size(self, job: int) -> int:
        phase = (job * 0.6180339887) % 1.0 * self.interval
        grown = int((time.monotonic() - self.t0 + phase) // self.interval)
        return self.initial + grown * self.growth

    def read(self, job: int, start: int, end: int) -> bytes:
        first, last = start // LINE, (end + LINE - 1) // LINE
        data = b"".join(_line(job, n) for n in range(first, last))
        return data[start - first * LINE:end - first * LINE]

    # -- dashboard ----------------------------------------------------------------------------------
    async def job(self, request: web.Request) -> web.Response:
        sid = request.match_info["job_or_submission_id"]
        i = self.job_index(sid)
        self.stats["status_requests"] += 1
        if i is None:
            return web.Response(status=404, text=f"Job {sid} does not exist")
        details: dict[str, Any] = {
            "type": "SUBMISSION", "job_id": None, "submission_id": sid, "driver_info": None,
            "status": "RUNNING", "entrypoint": "python -m verl.trainer.main_ppo",
            "message": "Job is currently running.",
            "error_type": None, "start_time": self.started_ms, "end_time": None, "metadata": {}, "runtime_env": {},
            "driver_agent_http_address": self.agent_url, "driver_node_id": "f" * 56, "driver_exit_code": None,
        }
        return web.Response(text=json.dumps(details), content_type="application/json")

    async def whole_log(self, request: web.Request) -> web.Response:
        i = self.job_index(request.match_info["job_or_submission_id"])
        if i is None:
            return web.Response(status=404, text="Job does not exist")
        self.stats["whole_log_requests"] += 1
        body = json.dumps({"logs": self.read(i, 0, self.size(i)).decode()})
        self.stats["log_body_bytes"] += len(body)
        return web.Response(text=body, content_type="application/json")

    # -- agent --------------------------------------------------------------------------------------
    async def log_file(self, request: web.Request) -> web.StreamResponse:
        name = request.match_info["name"]
        sid = name.removeprefix("job-driver-").removesuffix(".log")
        i = self.job_index(sid) if name.startswith("job-driver-") and name.endswith(".log") else None
        if i is None:
            raise web.HTTPNotFound()
        self.stats["range_requests"] += 1
        size = self.size(i)
        headers = {"Accept-Ranges": "bytes", "Last-Modified": formatdate(time.time(), usegmt=True),
                   "Etag": f'"{int(self.t0 * 1e9):x}-{size:x}"'}
        try:
            rng = request.http_range
        except ValueError:
            return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"},
                                content_type="application/octet-stream")
        start = rng.start or 0
        end = size if rng.stop is None else min(rng.stop, size)
        if start < 0:
            start, end = max(0, size + start), size
        if start >= size:
            return web.Response(status=416, headers={**headers, "Content-Range": f"bytes */{size}"},
                                content_type="application/octet-stream")
        body = self.read(i, start, end)
        self.stats["log_body_bytes"] += len(body)
        status = 206 if request.headers.get("Range") else 200
        if status == 206:
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        return web.Response(status=status, body=body, headers=headers, content_type="application/octet-stream")

    async def get_stats(self, request: web.Request) -> web.Response:
        return web.json_response(self.stats)


async def serve(args: argparse.Namespace) -> None:
    fake = FakeRay(args.jobs, args.initial_bytes, args.growth_bytes, args.interval)
    dashboard, agent = web.Application(), web.Application()
    dashboard.router.add_get("/api/jobs/{job_or_submission_id}", fake.job)
    dashboard.router.add_get("/api/jobs/{job_or_submission_id}/logs", fake.whole_log)
    dashboard.router.add_get("/_stats", fake.get_stats)
    agent.router.add_get("/logs/{name}", fake.log_file)
    runners = []
    urls = []
    for app, port in ((dashboard, args.port), (agent, args.agent_port)):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=4096).start()
        runners.append(runner)
        urls.append(f"http://127.0.0.1:{runner.addresses[0][1]}")
    fake.agent_url = urls[1]
    print(json.dumps({"dashboard_url": urls[0], "agent_url": urls[1]}), flush=True)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--agent-port", type=int, default=0)
    p.add_argument("--initial-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--growth-bytes", type=int, default=5 * 1024)
    p.add_argument("--interval", type=float, default=10.0)
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
