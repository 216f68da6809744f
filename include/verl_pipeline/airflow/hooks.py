"""All Ray I/O for the Airflow layer: a cluster handle + an optional Airflow connection for the token."""

from __future__ import annotations

from functools import cached_property
from typing import Any

from airflow.sdk.bases.hook import BaseHook

from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.jobs.client import JobInfo, RayJobsClient


def endpoint_from_connection(conn: Any) -> tuple[str, str | None]:
    """``(dashboard_url, token)`` from an Airflow connection.

    Either the ``dashboard_url`` extra, or ``schema://host:port`` (schema defaults to http, port to
    8265). The password, when set, is the Ray auth token.
    """
    extra = conn.extra_dejson or {}
    url = extra.get("dashboard_url")
    if not url:
        scheme = conn.schema or "http"
        port = conn.port or 8265
        url = f"{scheme}://{conn.host}:{port}"
    return str(url).rstrip("/"), conn.password or None


class RayJobsHook(BaseHook):
    """Sync and async access to one Ray cluster's Jobs API.

    :param cluster: a ``ClusterHandle`` dict (as the provision task returns it).
    :param conn_id: Airflow connection holding the Ray token (password), for token-auth clusters.
    """

    conn_name_attr = "conn_id"
    default_conn_name = "ray_default"
    conn_type = "http"
    hook_name = "Ray (verl pipeline)"

    def __init__(self, cluster: dict[str, Any], conn_id: str | None = None) -> None:
        super().__init__()
        self.handle = ClusterHandle.from_dict(cluster)
        self.conn_id = conn_id or self.handle.conn_id

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

    async def aclient(self) -> RayJobsClient:
        token = None
        if self.conn_id:
            from asgiref.sync import sync_to_async

            conn = await sync_to_async(self.get_connection)(self.conn_id)
            token = endpoint_from_connection(conn)[1]
        return RayJobsClient(self.handle.dashboard_url, token=token)

    async def aget_job(self, submission_id: str) -> JobInfo | None:
        return await (await self.aclient()).aget_job(submission_id)

    async def alogs(self, submission_id: str) -> str:
        return await (await self.aclient()).alogs(submission_id)

    async def anodes_alive(self) -> int:
        return sum(1 for n in await (await self.aclient()).anodes() if n.alive)
