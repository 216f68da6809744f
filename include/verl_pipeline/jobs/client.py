"""A small client for Ray's dashboard HTTP API (Jobs API + node state), sync and async.

Status, logs and stop go straight to the REST endpoints (``requests`` / ``aiohttp``) so the
triggerer never blocks its event loop and never imports Ray. Submission uses Ray's own
``JobSubmissionClient`` because it uploads local ``working_dir``/``py_modules`` packages.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import requests

from verl_pipeline.constants import JobState
from verl_pipeline.exceptions import ClusterError, JobError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class JobInfo:
    """The parts of Ray's JobDetails the pipeline uses."""

    submission_id: str
    status: JobState
    message: str = ""
    entrypoint: str = ""
    driver_exit_code: int | None = None
    start_time: int | None = None
    end_time: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_api(cls, data: dict[str, Any]) -> JobInfo:
        return cls(
            submission_id=str(data.get("submission_id") or data.get("job_id") or ""),
            status=JobState(data["status"]),
            message=data.get("message") or "",
            entrypoint=data.get("entrypoint") or "",
            driver_exit_code=data.get("driver_exit_code"),
            start_time=data.get("start_time"),
            end_time=data.get("end_time"),
            metadata=dict(data.get("metadata") or {}),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "submission_id": self.submission_id,
            "status": self.status.value,
            "message": self.message,
            "entrypoint": self.entrypoint,
            "driver_exit_code": self.driver_exit_code,
            "start_time": self.start_time,
            "end_time": self.end_time,
            "metadata": self.metadata,
        }


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    alive: bool
    is_head: bool
    ip: str
    resources: dict[str, float]


def _parse_nodes(data: dict[str, Any]) -> list[NodeInfo]:
    out = []
    for n in data["data"]["summary"]:
        raylet = n.get("raylet", {})
        out.append(
            NodeInfo(
                node_id=raylet.get("nodeId", ""),
                alive=raylet.get("state") == "ALIVE",
                is_head=bool(raylet.get("isHeadNode")),
                ip=n.get("ip") or raylet.get("nodeManagerAddress", ""),
                resources={k: float(v) for k, v in (raylet.get("resourcesTotal") or {}).items()},
            )
        )
    return out


class RayJobsClient:
    """Talks to one Ray cluster's dashboard (``http://host:port``).

    Construction does no I/O, so it is safe in a trigger's ``__init__`` or at DAG-parse time.
    """

    def __init__(self, dashboard_url: str, *, token: str | None = None, timeout_s: float = 30.0) -> None:
        self.dashboard_url = dashboard_url.rstrip("/")
        self._token = token
        self.timeout_s = timeout_s

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._token}"} if self._token else {}

    def _url(self, path: str) -> str:
        return f"{self.dashboard_url}{path}"

    # -- sync -------------------------------------------------------------------------------------
    def _get(self, path: str, *, ok404: bool = False) -> Any:
        try:
            r = requests.get(self._url(path), headers=self.headers, timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ClusterError(f"Ray dashboard {self.dashboard_url} is unreachable: {e}") from e
        if ok404 and r.status_code == 404:
            return None
        if r.status_code in (401, 403):
            raise ClusterError(
                f"Ray dashboard {self.dashboard_url} refused the request ({r.status_code}: {r.text.strip()}); "
                "set the cluster's token (Airflow connection password or VERL_PIPELINE_RAY_TOKEN) and "
                "RAY_AUTH_MODE to match the cluster"
            )
        if r.status_code >= 400:
            raise ClusterError(f"GET {path} on {self.dashboard_url} failed ({r.status_code}): {r.text[:500]}")
        return r.json()

    def version(self) -> dict[str, Any]:
        """Ray's ``/api/version``: answers once the Jobs API is up."""
        data: dict[str, Any] = self._get("/api/version")
        return data

    def nodes(self) -> list[NodeInfo]:
        """Every node the cluster knows, alive or dead, with its total resources."""
        return _parse_nodes(self._get("/nodes?view=summary"))

    async def anodes(self) -> list[NodeInfo]:
        return _parse_nodes(await self._aget("/nodes?view=summary"))

    def get_job(self, submission_id: str) -> JobInfo | None:
        data = self._get(f"/api/jobs/{submission_id}", ok404=True)
        return JobInfo.from_api(data) if data else None

    def list_jobs(self) -> list[JobInfo]:
        return [JobInfo.from_api(d) for d in self._get("/api/jobs/")]

    def logs(self, submission_id: str) -> str:
        data = self._get(f"/api/jobs/{submission_id}/logs")
        return str(data.get("logs", ""))

    def stop(self, submission_id: str) -> bool:
        """Ask Ray to stop the job. True when a running job was told to stop."""
        try:
            r = requests.post(self._url(f"/api/jobs/{submission_id}/stop"), headers=self.headers,
                              timeout=self.timeout_s)
        except requests.RequestException as e:
            raise ClusterError(f"Ray dashboard {self.dashboard_url} is unreachable: {e}") from e
        if r.status_code == 404:
            return False
        if r.status_code >= 400:
            raise JobError(f"Stopping Ray job {submission_id} failed ({r.status_code}): {r.text[:500]}")
        return bool(r.json().get("stopped", False))

    def submit(
        self,
        *,
        entrypoint: str,
        submission_id: str,
        runtime_env: dict[str, Any],
        metadata: dict[str, str] | None = None,
        entrypoint_num_cpus: float | None = None,
        entrypoint_num_gpus: float | None = None,
    ) -> str:
        """Submit a job through Ray's SDK (uploads local ``py_modules``/``working_dir``)."""
        from ray.job_submission import JobSubmissionClient

        try:
            sdk = JobSubmissionClient(self.dashboard_url, headers=self.headers or None)
            return str(
                sdk.submit_job(
                    entrypoint=entrypoint,
                    submission_id=submission_id,
                    runtime_env=runtime_env,
                    metadata=metadata,
                    entrypoint_num_cpus=entrypoint_num_cpus,
                    entrypoint_num_gpus=entrypoint_num_gpus,
                )
            )
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise JobError(f"Submitting Ray job {submission_id} to {self.dashboard_url} failed: {e}") from e

    # -- async (for triggers) ---------------------------------------------------------------------
    async def _aget(self, path: str, *, ok404: bool = False) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout, headers=self.headers) as session:
            async with session.get(self._url(path)) as r:
                if ok404 and r.status == 404:
                    return None
                if r.status >= 400:
                    text = await r.text()
                    raise ClusterError(f"GET {path} on {self.dashboard_url} failed ({r.status}): {text[:500]}")
                return await r.json(content_type=None)

    async def aget_job(self, submission_id: str) -> JobInfo | None:
        data = await self._aget(f"/api/jobs/{submission_id}", ok404=True)
        return JobInfo.from_api(data) if data else None

    async def alogs(self, submission_id: str) -> str:
        data = await self._aget(f"/api/jobs/{submission_id}/logs")
        return str(data.get("logs", ""))
