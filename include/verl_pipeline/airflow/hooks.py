"""All Ray I/O for the Airflow layer: a cluster handle + an optional Airflow connection for the token."""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager
from functools import cached_property
from types import TracebackType
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from verl_pipeline.cluster.address import Endpoint
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.client import JobInfo, LogStream, RayJobsClient


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

    Async use opens one HTTP session and looks the connection's token up once, for as long as the
    hook is entered (a trigger enters it once per run)::

        async with RayJobsHook(cluster, conn_id=...) as hook:
            info = await hook.aget_job(job_id)

    :param cluster: a ``ClusterHandle`` dict (as the provision task returns it).
    :param conn_id: Airflow connection holding the Ray token (password), for token-auth clusters.
        Without one (or without a password), a cluster the pipeline started is reached with the
        token in its handle's ``token_file``.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "ray_default"
    conn_type = "http"
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
        import aiohttp
        from asgiref.sync import sync_to_async

        token = None
        if self.conn_id:
            conn = await sync_to_async(self.get_connection)(self.conn_id)
            token = endpoint_from_connection(conn).token
        if token is None:
            token = await sync_to_async(self.handle.token)()
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30.0))
        self._aclient = self.handle.client(token, session=self._session)
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        session, self._session, self._aclient = self._session, None, None
        if session is not None:
            await session.close()

    def _entered(self) -> RayJobsClient:
        if self._aclient is None:
            raise RuntimeError("use the hook's async methods inside `async with hook:`")
        return self._aclient

    async def aget_job(self, submission_id: str) -> JobInfo | None:
        return await self._entered().aget_job(submission_id)

    def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int) -> AbstractAsyncContextManager[LogStream]:
        """New bytes of the job's driver log from byte ``start`` (see :meth:`RayJobsClient.alog_stream`)."""
        return self._entered().alog_stream(info, start, max_bytes=max_bytes)

    async def alogs(self, submission_id: str) -> str:
        return await self._entered().alogs(submission_id)

    async def anodes_alive(self) -> int:
        return sum(1 for n in await self._entered().anodes() if n.alive)
