"""Reading a job's driver log from a byte cursor: the agent's file route, and the state API fallback."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.client import JobInfo, LogSource, LogStream, RayJobsClient
from verl_pipeline.jobs.logstream import LineReader

JOB = "raysubmit-x"


@pytest.fixture
async def agent(tmp_path: Path) -> AsyncIterator[tuple[str, Path]]:
    """A stand-in for Ray's dashboard agent: ``/logs`` is aiohttp's file response, as in Ray's
    ``routes.static("/logs", log_dir)`` (Range requests, 206/416 with Content-Range)."""

    async def log_file(request: web.Request) -> web.StreamResponse:
        path = tmp_path / request.match_info["name"]
        if not path.is_file():
            raise web.HTTPNotFound()
        return web.FileResponse(path)

    app = web.Application()
    app.router.add_get("/logs/{name}", log_file)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    yield f"http://127.0.0.1:{port}", tmp_path
    await runner.cleanup()


async def _read(client: RayJobsClient, info: JobInfo, start: int, max_bytes: int = 1 << 20) -> tuple[bytes, LogStream]:
    async with client.alog_stream(info, start, max_bytes=max_bytes) as stream:
        data = b"".join([c async for c in stream.chunks()])
    return data, stream


async def test_only_the_bytes_after_the_cursor_are_read(agent: tuple[str, Path]) -> None:
    url, logdir = agent
    info = JobInfo.from_api({"submission_id": JOB, "status": "RUNNING", "driver_agent_http_address": url})
    async with aiohttp.ClientSession() as session:
        client = RayJobsClient("http://127.0.0.1:1", session=session)
        data, stream = await _read(client, info, 0)
        assert data == b"" and stream.size is None  # nothing written yet
        (logdir / f"job-driver-{JOB}.log").write_bytes(b"first\nsecond\n")
        data, stream = await _read(client, info, 6)
        assert data == b"second\n" and stream.size == 13 and stream.source is LogSource.AGENT
        data, stream = await _read(client, info, 13)  # at the end: 416 from the server, no bytes
        assert data == b"" and stream.size == 13


async def test_a_reader_far_behind_reads_only_the_last_max_bytes(agent: tuple[str, Path]) -> None:
    url, logdir = agent
    body = b"".join(b"line %d\n" % i for i in range(1000))
    (logdir / f"job-driver-{JOB}.log").write_bytes(body)
    info = JobInfo.from_api({"submission_id": JOB, "status": "RUNNING", "driver_agent_http_address": url})
    async with aiohttp.ClientSession() as session:
        data, stream = await _read(RayJobsClient("http://127.0.0.1:1", session=session), info, 0, max_bytes=100)
    assert data == body[-100:]
    assert stream.skipped_bytes == len(body) - 100 and stream.mid_line
    reader = LineReader(stream.start, mid_line=True)
    lines = list(reader.feed(data))
    assert lines == [f"line {i}" for i in range(1000)][-len(lines):] and reader.cursor == len(body)


@pytest.mark.integration
async def test_agent_and_state_api_serve_the_same_bytes_of_a_real_job(ray_cluster: ClusterHandle) -> None:
    sync = ray_cluster.client()
    job_id = f"logs-real-{int(time.time() * 1000)}"
    sync.submit(entrypoint="python -c \"print('é€🚀 line one'); print('step:1 - perf/throughput:12.5')\"",
                submission_id=job_id, runtime_env={})
    deadline = time.monotonic() + 120
    while (info := sync.get_job(job_id)) is None or not info.status.is_terminal():
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    assert info.driver_agent_http_address
    async with aiohttp.ClientSession() as session:
        client = ray_cluster.client(session=session)  # with the cluster's token
        whole, stream = await _read(client, info, 0)
        assert stream.source is LogSource.AGENT
        assert "é€🚀 line one\n".encode() in whole and b"step:1 - perf/throughput:12.5\n" in whole
        offset = whole.index("é€🚀".encode()) + 2  # inside the euro sign
        tail, _ = await _read(client, info, offset)
        assert tail == whole[offset:]
        # The agent's port closed to us: the dashboard's state API serves the same file.
        moved = JobInfo.from_api({**info.to_dict(), "driver_agent_http_address": "http://127.0.0.1:1"})
        fallback, stream = await _read(client, moved, offset)
        assert stream.source is LogSource.STATE_API and fallback == tail
