"""A stand-in for a Ray 2.60 head serving N RUNNING jobs with big, growing logs (for benchmarks).

Serves what the wait path reads, in Ray's formats (read from ``ray/dashboard/modules/job/job_head.py``
and ``ray/dashboard/modules/log/log_agent.py``, checked against a real local job):

- dashboard port: ``GET /api/jobs/{id}`` (JobDetails JSON, ``application/json; charset=utf-8``), ``GET /api/jobs/``
  (every job's JobDetails in one array) and
  ``GET /api/jobs/{id}/logs`` (``{"logs": "<whole log>"}``: what the trigger before streaming read);
- dashboard port: ``GET /nodes?view=summary`` (``dashboard/modules/node/node_head.py``): the node
  summary an owned cluster's waiter reads, ``--nodes`` nodes shaped like the one recorded from a
  real local Ray 2.60 head (``tests/jobs/ray_node_summary.json``, ~15 KB a node), each with
  ``--gpus-per-node`` GPUs in Ray's ``GpuUtilizationInfo`` shape
  (``dashboard/modules/reporter/reporter_models.py``); like Ray's ``aiohttp_cache``, one body
  serves every request for 2 s;
- agent port (``driver_agent_http_address``): ``GET /logs/job-driver-{id}.log``, the agent's
  ``routes.static("/logs", log_dir)``, i.e. aiohttp's file response: ``Range: bytes=N-`` gives 206
  with ``Content-Range: bytes N-M/SIZE``, N at or past the end gives 416 with ``bytes */SIZE``,
  an unknown file 404; ``application/octet-stream``.

With ``--step-seconds``, each job trains: its log shows verl's console metric line of a step
(``step:N - training/global_step:N - …``) every that many seconds of output; with ``--metrics-path``
(a path with ``{job}``) the job's verl file-logger JSONL also gets the step's row
(``{"step": n, "data": {…}}``, ~60 metrics) once the log shows it, as verl's trainer writes both.

Each job's log is virtual (no 20 GB on disk): 100-byte lines whose content is a function of the
offset, ``initial_bytes`` long at start and ``growth_bytes`` longer every ``interval`` seconds
(each job at its own phase). ``GET /_stats`` (not a Ray route) reports the body bytes and requests
served, for the benchmark's bytes-per-poll figure. With ``--hosts K`` the same head answers on K
loopback addresses (job ``i`` on the ``i % K``-th, its agent too): K clusters, each with its own
connections, as the owned clusters of K runs are.

    python bench/fake_ray_jobs_api.py --jobs 1000 --port 0 --agent-port 0
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import time
from email.utils import formatdate
from pathlib import Path
from typing import Any

from aiohttp import web

LINE = 100
#: One node of a real local Ray 2.60 head's node summary (a CPU node: its ``gpus`` list is empty).
RECORDED_SUMMARY = Path(__file__).resolve().parents[1] / "tests" / "jobs" / "ray_node_summary.json"
#: How long Ray's dashboard serves one node summary body (``aiohttp_cache``, ``AIOHTTP_CACHE_TTL_SECONDS``).
SUMMARY_CACHE_S = 2.0


def _line(job: int, n: int) -> bytes:
    head = f"(TaskRunnerV1 pid={1000 + job}) job {job} line {n:012d} "
    return (head + "x" * (LINE - 1 - len(head))).encode() + b"\n"


def _step_line(job: int, step: int) -> bytes:
    """verl's console metric line of ``step`` (cut to the fixed line length; the parts kept parse)."""
    text = f"(TaskRunnerV1 pid={1000 + job}) step:{step} - training/global_step:{step} - perf/time_per_step:60.0"
    return text[:LINE - 1].ljust(LINE - 1).encode() + b"\n"


class FakeRay:
    def __init__(self, jobs: int, initial_bytes: int, growth_bytes: int, interval: float, *, nodes: int = 2,
                 gpus_per_node: int = 8, step_seconds: float = 0.0) -> None:
        self.jobs = jobs
        self.nodes = nodes
        self.gpus_per_node = gpus_per_node
        self._summary: tuple[float, bytes] = (float("-inf"), b"")
        self.initial = initial_bytes - initial_bytes % LINE
        self.growth = growth_bytes - growth_bytes % LINE
        self.interval = interval
        #: Lines of log per training step (0: no steps): the step's console line ends each stretch.
        self.lines_per_step = round(step_seconds / interval * self.growth / LINE) if step_seconds else 0
        self.t0 = time.monotonic()
        self.started_ms = int(time.time() * 1000)
        #: The agent of each host (``http://address:port``); job ``i`` runs on host ``i % hosts``.
        self.agent_urls: list[str] = []
        self.stats: dict[str, int] = {"status_requests": 0, "whole_log_requests": 0, "range_requests": 0,
                                      "log_body_bytes": 0, "node_requests": 0, "node_body_bytes": 0,
                                      "list_requests": 0, "list_body_bytes": 0}

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

    def steps(self, job: int, size: int | None = None) -> int:
        """Training steps the job's log shows at ``size`` bytes (now, by default)."""
        if not self.lines_per_step:
            return 0
        return max(0, ((self.size(job) if size is None else size) - self.initial) // LINE // self.lines_per_step)

    def line(self, job: int, n: int) -> bytes:
        k = n - self.initial // LINE + 1
        if self.lines_per_step and k > 0 and k % self.lines_per_step == 0:
            return _step_line(job, k // self.lines_per_step)
        return _line(job, n)

    def read(self, job: int, start: int, end: int) -> bytes:
        first, last = start // LINE, (end + LINE - 1) // LINE
        data = b"".join(self.line(job, n) for n in range(first, last))
        return data[start - first * LINE:end - first * LINE]

    # -- dashboard ----------------------------------------------------------------------------------
    async def job(self, request: web.Request) -> web.Response:
        sid = request.match_info["job_or_submission_id"]
        i = self.job_index(sid)
        self.stats["status_requests"] += 1
        if i is None:
            return web.Response(status=404, text=f"Job {sid} does not exist")
        return web.Response(text=json.dumps(self.details(i)), content_type="application/json")

    async def job_list(self, request: web.Request) -> web.Response:
        """Every job's JobDetails in one JSON array, as Ray's ``GET /api/jobs/``."""
        body = json.dumps([self.details(i) for i in range(self.jobs)])
        self.stats["list_requests"] += 1
        self.stats["list_body_bytes"] += len(body)
        return web.Response(text=body, content_type="application/json")

    def details(self, i: int) -> dict[str, Any]:
        sid = f"bench-job-{i}"
        return {
            "type": "SUBMISSION", "job_id": None, "submission_id": sid, "driver_info": None,
            "status": "RUNNING", "entrypoint": "python -m verl.trainer.main_ppo",
            "message": "Job is currently running.",
            "error_type": None, "start_time": self.started_ms, "end_time": None, "metadata": {}, "runtime_env": {},
            "driver_agent_http_address": self.agent_urls[i % len(self.agent_urls)], "driver_node_id": "f" * 56,
            "driver_exit_code": None,
        }

    async def whole_log(self, request: web.Request) -> web.Response:
        i = self.job_index(request.match_info["job_or_submission_id"])
        if i is None:
            return web.Response(status=404, text="Job does not exist")
        self.stats["whole_log_requests"] += 1
        body = json.dumps({"logs": self.read(i, 0, self.size(i)).decode()})
        self.stats["log_body_bytes"] += len(body)
        return web.Response(text=body, content_type="application/json")

    def node_summary(self) -> bytes:
        """``{"result", "msg", "data": {"summary": [node…], "nodeLogicalResources": {}}}``: every node alive."""
        recorded = json.loads(RECORDED_SUMMARY.read_text())
        template = recorded["data"]["summary"][0]
        now = time.time()
        summary = []
        for n in range(self.nodes):
            node = copy.deepcopy(template)
            node_id = f"{n:02x}" * 28
            ip = f"10.0.0.{n + 1}"
            node["now"], node["ip"], node["hostname"] = now, ip, f"gpu-node-{n}"
            raylet = node["raylet"]
            raylet.update(nodeId=node_id, nodeManagerAddress=ip, nodeName=ip, isHeadNode=n == 0, state="ALIVE")
            raylet["resourcesTotal"] = {"CPU": 64.0, "GPU": float(self.gpus_per_node), "memory": 1.0e12,
                                        f"node:{ip}": 1.0, "objectStoreMemory": 2.0e11}
            node["gpus"] = [{
                "index": g, "name": "NVIDIA H200", "uuid": f"GPU-{n:04x}{g:04x}-0000-0000-0000-000000000000",
                "utilizationGpu": int(80 + 20 * ((now / 7 + g) % 1)), "memoryUsed": 101_000 + 100 * g,
                "memoryTotal": 143_771, "processesPids": [{"pid": 4000 + g, "gpuMemoryUsage": 100_900}],
                "powerMw": 512_000, "temperatureC": 55,
            } for g in range(self.gpus_per_node)]
            summary.append(node)
        return json.dumps({"result": True, "msg": "Node summary fetched.",
                           "data": {"summary": summary, "nodeLogicalResources": {}}}).encode()

    async def nodes_view(self, request: web.Request) -> web.Response:
        if request.query.get("view") != "summary":
            return web.json_response({"result": False, "msg": "Unknown view", "data": {}}, status=500)
        self.stats["node_requests"] += 1
        made_at, body = self._summary
        if time.monotonic() - made_at > SUMMARY_CACHE_S:
            body = self.node_summary()
            self._summary = (time.monotonic(), body)
        self.stats["node_body_bytes"] += len(body)
        return web.Response(body=body, content_type="application/json", charset="utf-8")

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


def host_addresses(hosts: int) -> list[str]:
    """Loopback addresses of ``hosts`` clusters: 127.0.0.1 for one, else 127.1.x.y (Linux routes all of 127/8)."""
    if hosts == 1:
        return ["127.0.0.1"]
    return [f"127.1.{h // 250}.{h % 250 + 1}" for h in range(hosts)]


async def write_metrics(fake: FakeRay, template: str) -> None:
    """Append verl's file-logger row of each step to each job's metrics file once its log shows the
    step's console line (verl writes both for one step)."""
    paths = [Path(template.format(job=i)) for i in range(fake.jobs)]
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    written = [0] * fake.jobs
    names = [f"actor/metric_{k:02d}" for k in range(56)]
    while True:
        for i, path in enumerate(paths):
            shown = fake.steps(i)
            rows = []
            while written[i] < shown:
                written[i] += 1
                step = written[i]
                data = {"training/global_step": step, "perf/time_per_step": 60.0, "critic/score/mean": 0.25,
                        "perf/throughput": 1172.0, **{k: 0.5 for k in names}}
                rows.append(json.dumps({"step": step, "data": data}) + "\n")
            if rows:
                with path.open("a") as f:
                    f.writelines(rows)
        await asyncio.sleep(0.5)


async def serve(args: argparse.Namespace) -> None:
    fake = FakeRay(args.jobs, args.initial_bytes, args.growth_bytes, args.interval, nodes=args.nodes,
                   gpus_per_node=args.gpus_per_node, step_seconds=args.step_seconds)
    dashboard, agent = web.Application(), web.Application()
    dashboard.router.add_get("/nodes", fake.nodes_view)
    dashboard.router.add_get("/api/jobs/", fake.job_list)
    dashboard.router.add_get("/api/jobs/{job_or_submission_id}", fake.job)
    dashboard.router.add_get("/api/jobs/{job_or_submission_id}/logs", fake.whole_log)
    dashboard.router.add_get("/_stats", fake.get_stats)
    agent.router.add_get("/logs/{name}", fake.log_file)
    addresses = host_addresses(args.hosts)
    ports = []
    for app, port in ((dashboard, args.port), (agent, args.agent_port)):
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        for address in addresses:  # the first picks the port, the others listen on it too
            await web.TCPSite(runner, address, port, backlog=4096).start()
            port = port or runner.addresses[0][1]
        ports.append(port)
    fake.agent_urls = [f"http://{a}:{ports[1]}" for a in addresses]
    print(json.dumps({"dashboard_urls": [f"http://{a}:{ports[0]}" for a in addresses],
                      "agent_urls": fake.agent_urls}), flush=True)
    if args.metrics_path:
        await write_metrics(fake, args.metrics_path)
    await asyncio.Event().wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--jobs", type=int, default=10)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--agent-port", type=int, default=0)
    p.add_argument("--initial-bytes", type=int, default=20 * 1024 * 1024)
    p.add_argument("--growth-bytes", type=int, default=5 * 1024)
    p.add_argument("--interval", type=float, default=10.0)
    p.add_argument("--hosts", type=int, default=1,
                   help="clusters: the dashboard and agent listen on this many loopback addresses, job i on the "
                        "i %% hosts-th")
    p.add_argument("--nodes", type=int, default=2, help="nodes in the node summary, all alive")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--metrics-path", help="each job's verl metrics JSONL, with {job} (none: not written)")
    p.add_argument("--step-seconds", type=float, default=0.0,
                   help="seconds per training step: the log shows verl's console line of each (0: no steps)")
    asyncio.run(serve(p.parse_args()))


if __name__ == "__main__":
    main()
