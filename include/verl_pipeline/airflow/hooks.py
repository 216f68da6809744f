"""All Ray I/O for the Airflow layer: a cluster handle + an optional Airflow connection for the token."""

from __future__ import annotations

import asyncio
from contextlib import AbstractAsyncContextManager
from functools import cached_property
from types import TracebackType
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from verl_pipeline.airflow.provider import CONNECTION_TYPE
from verl_pipeline.cluster.address import Endpoint
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.client import JobInfo, LogStream, NodeInfo, RayJobsClient

#: Seconds one HTTP request of a waiter may take, connecting included.
REQUEST_TIMEOUT_S = 30.0
#: Seconds an idle connection is kept for the next request: longer than a waiter's gap between two
#: reads of one host (its log every other poll: 20 s at 10 s polls), shorter than the time after which
#: Ray's dashboard and agent (aiohttp servers) close an idle connection themselves (75 s in older
#: aiohttp releases, an hour in 3.14).
KEEPALIVE_S = 60.0


class _SharedSession:
    """One aiohttp session (one connection pool) per event loop, for every hook entered in it.

    The triggerer runs every waiter in one event loop: sharing the pool lets the waiters of one
    cluster reuse each other's kept-alive connections (a process holds a few sockets per cluster
    instead of two per waiter), and connections are kept ``KEEPALIVE_S``, so a waiter's next read of
    a host finds its connection still open.
    Nothing of one cluster leaks to another: each request carries its own cluster's token and TLS
    settings, and no cookies are kept. The pool has no connection limit, so one unreachable cluster's
    waiters never queue another's requests. Closed when the last hook of its loop exits.
    """

    _by_loop: dict[asyncio.AbstractEventLoop, _SharedSession] = {}

    def __init__(self, session: Any) -> None:
        self.session = session
        self.users = 0

    @classmethod
    def acquire(cls) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        shared = cls._by_loop.get(loop)
        if shared is None or shared.session.closed:
            session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
                                            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
                                            cookie_jar=aiohttp.DummyCookieJar())
            shared = cls._by_loop[loop] = cls(session)
        shared.users += 1
        return shared.session

    @classmethod
    async def release(cls, session: Any) -> None:
        loop = asyncio.get_running_loop()
        shared = cls._by_loop.get(loop)
        if shared is None or shared.session is not session:  # its loop's pool was replaced: close this one
            await session.close()
            return
        shared.users -= 1
        if shared.users <= 0:
            del cls._by_loop[loop]
            await session.close()


def endpoint_from_connection(conn: Any) -> Endpoint:
    """The dashboard of an Airflow connection: ``(dashboard_url, token, ca_bundle)``.

    Either the ``dashboard_url`` extra, or ``schema://host:port`` (schema defaults to http, port to
    8265). The password, when set, is the Ray auth token; the ``ca_bundle`` extra verifies https.
    """
    extra = conn.extra_dejson or {}
    url = extra.get("dashboard_url")
    if not url:
        scheme = conn.schema or "http"
        port = conn.port or 8265
        url = f"{scheme}://{conn.host}:{port}"
    return Endpoint(str(url).rstrip("/"), conn.password or None, extra.get("ca_bundle") or None)


class RayJobsHook(BaseHook):
    """Sync and async access to one Ray cluster's Jobs API.

    Async use looks the connection's token up once, for as long as the hook is entered (a trigger
    enters it once per run), and shares one HTTP session with every hook entered in the same event
    loop (see :class:`_SharedSession`)::

        async with RayJobsHook(cluster, conn_id=...) as hook:
            info = await hook.aget_job(job_id)

    :param cluster: a ``ClusterHandle`` dict (as the provision task returns it).
    :param conn_id: Airflow connection holding the Ray token (password), for token-auth clusters.
        Without one (or without a password), a cluster the pipeline started is reached with the
        token in its handle's ``token_file``.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "ray_default"
    #: The provider's connection type (its form in the UI); a connection of any type with the same fields
    #: (``http``, or an ``AIRFLOW_CONN_*`` URI) works as well.
    conn_type = CONNECTION_TYPE
    hook_name = "Ray (verl pipeline)"

    def __init__(self, cluster: dict[str, Any], conn_id: str | None = None) -> None:
        super().__init__()
        self.handle = ClusterHandle.from_dict(cluster)
        self.conn_id = conn_id or self.handle.conn_id
        self._session: Any = None
        self._aclient: RayJobsClient | None = None

    def token(self) -> str | None:
        if not self.conn_id:
            return None
        return endpoint_from_connection(self.get_connection(self.conn_id))[1]

    @cached_property
    def client(self) -> RayJobsClient:
        return self.handle.client(self.token())

    def get_job(self, submission_id: str) -> JobInfo | None:
        return self.client.get_job(submission_id)

    def logs(self, submission_id: str) -> str:
        return self.client.logs(submission_id)

    def stop(self, submission_id: str) -> bool:
        return self.client.stop(submission_id)

    async def __aenter__(self) -> RayJobsHook:
        from asgiref.sync import sync_to_async

        token = None
        if self.conn_id:
            conn = await sync_to_async(self.get_connection)(self.conn_id)
            token = endpoint_from_connection(conn).token
        if token is None:
            token = await sync_to_async(self.handle.token)()
        self._session = _SharedSession.acquire()
        self._aclient = self.handle.client(token, session=self._session)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        session, self._session, self._aclient = self._session, None, None
        if session is not None:
            await _SharedSession.release(session)

    def _entered(self) -> RayJobsClient:
        if self._aclient is None:
            raise RuntimeError("use the hook's async methods inside `async with hook:`")
        return self._aclient

    async def aget_job(self, submission_id: str) -> JobInfo | None:
        return await self._entered().aget_job(submission_id)

    async def ajob_details(self) -> dict[str, dict[str, Any]]:
        """Every submitted job of the cluster, by submission id (Ray's job list)."""
        return await self._entered().ajob_details()

    def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> AbstractAsyncContextManager[LogStream]:
        """New bytes of the job's driver log from byte ``start`` (see :meth:`RayJobsClient.alog_stream`)."""
        return self._entered().alog_stream(info, start, max_bytes=max_bytes)

    async def alogs(self, submission_id: str) -> str:
        return await self._entered().alogs(submission_id)

    async def anodes(self) -> list[NodeInfo]:
        """Every node of the cluster, alive or dead, with its GPUs' readings (Ray's node summary)."""
        return await self._entered().anodes()

    async def aactor_starts(self, ray_job_id: str, *, alive_only: bool) -> tuple[list[Any], list[Any]]:
        """Ray's records of a job's actor creations and of the cluster's workers (see
        :meth:`RayJobsClient.aactor_starts`)."""
        return await self._entered().aactor_starts(ray_job_id, alive_only=alive_only)
