"""Reading a job's driver log from a byte cursor: the agent's file route, and the state API fallback."""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from urllib.parse import urlsplit

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


async def _read(client: RayJobsClient, info: JobInfo, start: int, max_bytes: int = 1 << 20, *,
                jump_to_tail: bool = True) -> tuple[bytes, LogStream]:
    async with client.alog_stream(info, start, max_bytes=max_bytes, jump_to_tail=jump_to_tail) as stream:
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


async def test_a_pending_job_whose_driver_has_no_node_is_read_as_nothing_yet(ray_cluster: ClusterHandle) -> None:
    """A job Ray has not placed (its entrypoint asks for more CPUs than the cluster has) has no driver node:
    the state API answers 500 for its log, so the read asks nothing and returns no bytes."""
    sync = ray_cluster.client()
    job_id = f"logs-pending-{int(time.time() * 1000)}"
    sync.submit(entrypoint="echo never", submission_id=job_id, runtime_env={}, entrypoint_num_cpus=1000)
    try:
        info = sync.get_job(job_id)
        assert info is not None and info.status.value == "PENDING" and not info.driver_node_id
        async with aiohttp.ClientSession() as session:
            client = ray_cluster.client(session=session)
            data, stream = await _read(client, info, 0)
            assert (data, stream.source, stream.size) == (b"", LogSource.NOT_PLACED, None)
            # What the read no longer asks: the state API without the driver's node.
            params = {"submission_id": job_id, "lines": "-1"}
            async with session.get(f"{client.dashboard_url}/api/v0/logs/file", params=params,
                                   headers=client.headers) as r:
                assert r.status == 500, r.status
    finally:
        sync.stop(job_id)


async def test_a_reader_that_wants_every_byte_reads_max_bytes_at_a_time(agent: tuple[str, Path]) -> None:
    url, logdir = agent
    body = b"".join(b"line %d\n" % i for i in range(1000))
    (logdir / f"job-driver-{JOB}.log").write_bytes(body)
    info = JobInfo.from_api({"submission_id": JOB, "status": "RUNNING", "driver_agent_http_address": url})
    got, cursor = b"", 0
    async with aiohttp.ClientSession() as session:
        client = RayJobsClient("http://127.0.0.1:1", session=session)
        while True:
            data, stream = await _read(client, info, cursor, max_bytes=1000, jump_to_tail=False)
            assert stream.skipped_bytes == 0 and len(data) <= 1000
            if not data:
                break
            got, cursor = got + data, cursor + len(data)
    assert got == body


async def test_after_the_agent_could_not_be_reached_it_is_tried_again_later(
        agent: tuple[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """A busy moment (a connect that timed out) must not cost the whole file every poll for good."""
    from verl_pipeline.jobs import client as client_module

    url, logdir = agent
    (logdir / f"job-driver-{JOB}.log").write_bytes(b"one\ntwo\n")

    async def state_api(request: web.Request) -> web.Response:
        assert request.query["submission_id"] == JOB
        return web.Response(body=(logdir / f"job-driver-{JOB}.log").read_bytes())

    app = web.Application()
    app.router.add_get("/api/v0/logs/file", state_api)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    dashboard = f"http://127.0.0.1:{runner.addresses[0][1]}"
    closed = JobInfo.from_api({"submission_id": JOB, "status": "RUNNING", "driver_agent_http_address":
                               "http://127.0.0.1:1"})
    reachable = JobInfo.from_api({**closed.to_dict(), "driver_agent_http_address": url})
    try:
        for retry_s, source_after in ((client_module.AGENT_RETRY_S, LogSource.STATE_API), (0.0, LogSource.AGENT)):
            monkeypatch.setattr(client_module, "AGENT_RETRY_S", retry_s)
            client = RayJobsClient(dashboard)
            data, stream = await _read(client, closed, 4)
            assert (data, stream.source) == (b"two\n", LogSource.STATE_API)
            data, stream = await _read(client, reachable, 4)  # the port is open again
            assert (data, stream.source) == (b"two\n", source_after)
    finally:
        await runner.cleanup()


class CountingProxy:
    """A TCP proxy in front of one ``host:port`` that counts the bytes the server sent through it."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port, self.received = host, port, 0

    async def _pipe(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, count: bool) -> None:
        try:
            while data := await src.read(64 * 1024):
                if count:
                    self.received += len(data)
                dst.write(data)
                await dst.drain()
        except ConnectionError:
            pass
        finally:
            dst.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        await asyncio.gather(self._pipe(reader, up_writer, count=False), self._pipe(up_reader, writer, count=True))

    @asynccontextmanager
    async def running(self) -> AsyncIterator[str]:
        server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        async with server:
            yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"


@pytest.mark.integration
async def test_a_far_behind_read_of_a_large_real_log_transfers_only_a_bounded_range(
        ray_cluster: ClusterHandle) -> None:
    """The real dashboard agent, a 16 MB driver log, a fresh reader at byte 0 with a 1 MiB budget."""
    sync = ray_cluster.client()
    job_id = f"logs-large-{int(time.time() * 1000)}"
    code = "import sys\nfor i in range(150000): sys.stdout.write('line %07d %s\\n' % (i, 'x' * 100))"
    sync.submit(entrypoint=f"python -c {shlex.quote(code)}", submission_id=job_id, runtime_env={})
    deadline = time.monotonic() + 180
    while (info := sync.get_job(job_id)) is None or not info.status.is_terminal():
        assert time.monotonic() < deadline, "the job did not finish"
        await asyncio.sleep(0.2)
    assert info.driver_agent_http_address
    path = Path(ray_cluster.extra["temp_dir"]) / "session_latest" / "logs" / f"job-driver-{job_id}.log"
    whole = path.read_bytes()
    assert len(whole) > 16_000_000
    agent = urlsplit(info.driver_agent_http_address)
    proxy = CountingProxy(str(agent.hostname), int(agent.port or 80))
    received: dict[int, int] = {}
    async with proxy.running() as proxied, aiohttp.ClientSession() as session:
        client = ray_cluster.client(session=session)
        behind = JobInfo.from_api({**info.to_dict(), "driver_agent_http_address": proxied})
        for max_bytes in (64 * 1024, 1 << 20):
            proxy.received = 0
            data, stream = await _read(client, behind, 0, max_bytes=max_bytes)
            received[max_bytes] = proxy.received
            assert data == whole[-max_bytes:] and stream.skipped_bytes == len(whole) - max_bytes
            assert stream.source is LogSource.AGENT
            reader = LineReader(stream.start, mid_line=True)
            lines = list(reader.feed(data))
            assert reader.cursor == len(whole) and lines[-1] == "line 0149999 " + "x" * 100
        # Caught up: the next read asks for the new bytes only (here the last line's).
        proxy.received = 0
        data, stream = await _read(client, behind, len(whole) - 114, max_bytes=1 << 20)
        assert data == whole[-114:] and stream.skipped_bytes == 0
        near_end = proxy.received
    print(f"log {len(whole)} B: far behind, bytes received by max_bytes {received}; caught up {near_end} B")
    # The first range is cut off at max_bytes and the tail is max_bytes: never more than the budget twice.
    for max_bytes, got in received.items():
        assert got <= 2 * max_bytes + 16 * 1024, (max_bytes, got)
    assert near_end < 2048, near_end


@pytest.mark.integration
async def test_rays_job_list_gives_each_job_as_its_own_read_does(ray_cluster: ClusterHandle) -> None:
    """The shared status read (``GET /api/jobs/``) against a real head: the job is in it, parsed the same."""
    sync = ray_cluster.client()
    job_id = f"list-real-{int(time.time() * 1000)}"
    sync.submit(entrypoint="python -c pass", submission_id=job_id, runtime_env={})
    deadline = time.monotonic() + 120
    while (info := sync.get_job(job_id)) is None or not info.status.is_terminal():
        assert time.monotonic() < deadline, "the job did not finish"
        time.sleep(0.2)
    async with aiohttp.ClientSession() as session:
        client = ray_cluster.client(session=session)  # with the cluster's token
        jobs = await client.ajob_details()
        assert job_id in jobs and all(isinstance(k, str) and k for k in jobs)
        assert JobInfo.from_api(jobs[job_id]) == await client.aget_job(job_id) == info
