"""The hook's async side: one HTTP session (one connection pool) for every waiter of an event loop."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from verl_pipeline.airflow.hooks import RayJobsHook
from verl_pipeline.cluster.base import ClusterHandle


@pytest.fixture
async def dashboard() -> AsyncIterator[tuple[str, list[Any]]]:
    """A stand-in for the Jobs API's status route; also returns the peer of each request's connection."""
    peers: list[Any] = []

    async def job(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        return web.json_response({"submission_id": request.match_info["id"], "status": "RUNNING"})

    app = web.Application()
    app.router.add_get("/api/jobs/{id}", job)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", peers
    await runner.cleanup()


async def test_the_waiters_of_one_loop_share_one_session_and_its_connections(
        dashboard: tuple[str, list[Any]]) -> None:
    url, peers = dashboard
    cluster = ClusterHandle(backend="local", name="c", dashboard_url=url, owned=True).to_dict()
    hooks = [RayJobsHook(cluster) for _ in range(5)]
    for hook in hooks:
        await hook.__aenter__()
    session = hooks[0]._session
    assert session is not None and all(h._session is session for h in hooks)
    for _ in range(3):  # waiters poll one after another, as a triggerer's do
        for i, hook in enumerate(hooks):
            info = await hook.aget_job(f"job-{i}")
            assert info is not None and info.submission_id == f"job-{i}"
    assert len(set(peers)) == 1  # 15 polls of 5 waiters over one kept-alive connection
    for hook in hooks[:-1]:
        await hook.__aexit__(None, None, None)
    assert not session.closed  # the last waiter still uses it
    await hooks[-1].__aexit__(None, None, None)
    assert session.closed
    again = RayJobsHook(cluster)
    async with again:
        assert again._session is not session and again._session is not None and not again._session.closed


def test_each_event_loop_has_its_own_session() -> None:
    cluster = ClusterHandle(backend="local", name="c", dashboard_url="http://127.0.0.1:1", owned=True).to_dict()

    async def entered() -> Any:
        async with RayJobsHook(cluster) as hook:
            return hook._session

    first, second = asyncio.run(entered()), asyncio.run(entered())
    assert first is not second and first.closed and second.closed
