"""A small client for Ray's dashboard HTTP API (Jobs API + node state), sync and async.

Status, logs and stop go straight to the REST endpoints (``requests`` / ``aiohttp``) so the
triggerer never blocks its event loop and never imports Ray. Submission uses Ray's own
``JobSubmissionClient`` because it uploads local ``working_dir``/``py_modules`` packages.

Each client carries its cluster's auth mode and token: one process may talk to a token-auth
cluster and an auth-disabled one, so nothing here reads or writes ``RAY_AUTH_MODE`` in the process
environment (see :func:`_ray_sdk_adds_no_auth` for the one place Ray's SDK would).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import requests

from verl_pipeline.constants import JobState
from verl_pipeline.exceptions import ClusterError, JobError
from verl_pipeline.jobs.gpu_usage import GpuReading, readings_from_summary

if TYPE_CHECKING:
    # Imported where used: ``verl_pipeline.cluster`` imports this module (cluster.base).
    from verl_pipeline.auth import AuthMode

log = logging.getLogger(__name__)

#: The driver's log file in the Ray log directory of its node (Ray's ``JOB_LOGS_PATH_TEMPLATE``).
JOB_LOG_FILE = "job-driver-{submission_id}.log"
_CONTENT_RANGE = re.compile(r"bytes (?:(\d+)-\d+|\*)/(\d+)")
_CHUNK = 64 * 1024
#: Bytes one ranged read of :func:`follow_log` asks for (it reads again until caught up).
FOLLOW_READ_BYTES = 1024 * 1024
#: Ray's node summary: every node, alive or dead, with its resources and each GPU's utilisation and memory.
_NODE_SUMMARY = "/nodes?view=summary"
#: Seconds a client reads a job's log through the state API after its dashboard agent could not be
#: reached, before it tries the agent again (a busy moment must not cost the whole file every poll for good).
AGENT_RETRY_S = 600.0
#: Ray's answer (HTTP 500) to a submission that reached its head before the head's job agent registered,
#: and the seconds a submission keeps trying again after it (Ray created no job: the id stays free).
NO_AGENT = "No available agent to submit job"
NO_AGENT_WAIT_S = 60.0
#: Seconds to wait for a job the pipeline stopped to end, before a restart submits the next attempt or a
#: teardown goes on. Ray sends SIGTERM, then SIGKILL after ``RAY_JOB_STOP_WAIT_TIME_S`` (3 s by default;
#: a site may raise it so a job can finish writing); the wait returns as soon as Ray says the job ended,
#: so the bound costs time only when the stop does not work, and a next attempt started beside a job
#: that still holds the GPUs would fail.
STOP_WAIT_S = 60.0
#: The most rows one read of Ray's state API asks for (a week on a large cluster: thousands of workers).
STATE_LIST_LIMIT = 10_000


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
    #: The dashboard agent of the driver's node (``http://ip:port``): it serves the driver's log file.
    driver_agent_http_address: str | None = None
    driver_node_id: str | None = None
    #: Ray's id of the job (``driver_info.id``, e.g. ``02000000``) once its driver started: what Ray's
    #: state API files the job's tasks and actors under.
    ray_job_id: str | None = None

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
            driver_agent_http_address=data.get("driver_agent_http_address") or None,
            driver_node_id=data.get("driver_node_id") or None,
            ray_job_id=(data.get("driver_info") or {}).get("id") or None,
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
            "driver_agent_http_address": self.driver_agent_http_address,
            "driver_node_id": self.driver_node_id,
            "ray_job_id": self.ray_job_id,
        }


@dataclass(frozen=True)
class NodeInfo:
    node_id: str
    alive: bool
    is_head: bool
    ip: str
    resources: dict[str, float]
    #: Each GPU of the node as the node's dashboard agent last read it (empty: no GPU, or not reported).
    gpus: tuple[GpuReading, ...] = ()


# The parts of Ray's node summary (``GET /nodes?view=summary``) the pipeline reads. A summary is
# ~15 KB per node (process command lines, disks, the agent's own stats): decoding into these types
# skips the rest instead of building it (~5x less CPU than ``json.loads`` for a waiter polling it).
class _Raylet(msgspec.Struct, frozen=True):
    nodeId: str | None = None
    state: str | None = None
    isHeadNode: bool | None = None
    nodeManagerAddress: str | None = None
    resourcesTotal: dict[str, float] | None = None


class _NodeSummary(msgspec.Struct, frozen=True):
    ip: str | None = None
    raylet: _Raylet | None = None
    #: Ray's ``GpuUtilizationInfo`` dicts, read by :func:`verl_pipeline.jobs.gpu_usage.readings_from_summary`.
    gpus: list[dict[str, Any]] | None = None


class _SummaryData(msgspec.Struct, frozen=True):
    summary: list[_NodeSummary]


class _SummaryResponse(msgspec.Struct, frozen=True):
    data: _SummaryData


_SUMMARY_DECODER = msgspec.json.Decoder(_SummaryResponse)


def _parse_nodes(body: bytes) -> list[NodeInfo]:
    """Ray's node summary (the response body) as one :class:`NodeInfo` per node, alive or dead."""
    try:
        summary = _SUMMARY_DECODER.decode(body).data.summary
    except msgspec.DecodeError as e:  # ValidationError included
        raise ClusterError(f"GET /nodes?view=summary answered something that is not Ray's node summary: {e}") from e
    out = []
    for n in summary:
        raylet = n.raylet or _Raylet()
        out.append(
            NodeInfo(
                node_id=raylet.nodeId or "",
                alive=raylet.state == "ALIVE",
                is_head=bool(raylet.isHeadNode),
                ip=n.ip or raylet.nodeManagerAddress or "",
                resources=dict(raylet.resourcesTotal or {}),
                gpus=readings_from_summary(n.gpus),
            )
        )
    return out


class LogSource(str, Enum):
    """Where a log read came from."""

    #: The driver node's dashboard agent serves the file itself (``/logs/<file>``) and honours
    #: HTTP ``Range``: only the bytes after the cursor are read.
    AGENT = "agent"
    #: The state API through the dashboard (``/api/v0/logs/file?submission_id=…&lines=-1``): the
    #: whole file is streamed and the part before the cursor discarded. Used when the agent's port
    #: cannot be reached from here.
    STATE_API = "state_api"
    #: Nothing read: a PENDING job's driver has no node yet, so neither route can find its log (the
    #: state API answers 500 without the node). Its first lines are read once Ray places it.
    NOT_PLACED = "not_placed"


@dataclass(frozen=True)
class LogStream:
    """New bytes of a job's driver log, from byte offset ``start`` on.

    ``size`` is the file's size when it was read (None when unknown); ``skipped_bytes`` are bytes
    after the cursor that were jumped over because the reader fell too far behind, so ``start``
    may lie inside a line (``mid_line``).
    """

    start: int
    size: int | None
    skipped_bytes: int
    source: LogSource
    body: Any = None  # the aiohttp response's content, or None when there is nothing to read
    discard: int = 0  # leading bytes of ``body`` that lie before ``start``
    limit: int | None = None  # stop after this many bytes from ``start``

    @property
    def mid_line(self) -> bool:
        return self.skipped_bytes > 0

    async def chunks(self) -> AsyncIterator[bytes]:
        if self.body is None:
            return
        discard, left = self.discard, self.limit
        if not discard and left is None and self.size is not None:
            # A bounded range (the agent path): one read, no per-chunk overhead.
            data = await self.body.read()
            if data:
                yield data
            return
        async for chunk in self.body.iter_chunked(_CHUNK):
            if discard:
                dropped = min(discard, len(chunk))
                chunk, discard = chunk[dropped:], discard - dropped
            if left is not None:
                chunk, left = chunk[:left], left - min(left, len(chunk))
            if chunk:
                yield chunk
            if left == 0:
                return


#: Held while Ray's SDK builds a client with :func:`_ray_sdk_adds_no_auth` in effect.
_RAY_SDK_AUTH_LOCK = threading.Lock()


@contextmanager
def _ray_sdk_adds_no_auth() -> Iterator[None]:
    """While Ray's ``SubmissionClient`` is built, it adds no ``Authorization`` header of its own.

    Why: Ray's SDK picks its headers once, in ``SubmissionClient.__init__``, from this *process's*
    Ray auth mode: in token mode, and when the caller gave no ``Authorization`` header, it adds the
    process's token (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``), or raises
    when that file is missing. That mode is ``RAY_AUTH_MODE`` as Ray's C++ config read it the first
    time anything asked (``RayConfig::AUTH_MODE``, read once per process): setting and restoring
    the environment around a call changes nothing after that. So the client gives its own header
    (its cluster's token, or none for an auth-disabled cluster) and, under a lock, Ray's
    ``dashboard_sdk.get_auth_headers_if_auth_enabled`` answers "nothing to add" while the SDK
    client is built. Every request of that SDK client uses the headers fixed there.
    """
    from ray.dashboard.modules import dashboard_sdk

    with _RAY_SDK_AUTH_LOCK:
        original = dashboard_sdk.get_auth_headers_if_auth_enabled
        dashboard_sdk.get_auth_headers_if_auth_enabled = _no_headers
        try:
            yield
        finally:
            dashboard_sdk.get_auth_headers_if_auth_enabled = original


def _no_headers(user_headers: dict[str, str]) -> dict[str, str]:
    return {}


class RayJobsClient:
    """Talks to one Ray cluster's dashboard (``http://host:port``).

    Construction does no I/O, so it is safe in a trigger's ``__init__`` or at DAG-parse time.
    ``auth_mode``: the cluster's Ray auth mode (default: ``token`` when a token is given, else
    ``disabled``); a token-auth client sends ``token`` as a bearer token with every request, an
    auth-disabled one sends no ``Authorization`` header, whatever this process's ``RAY_AUTH_MODE``.
    ``session``: one ``aiohttp.ClientSession`` for every async call (the hook opens it per trigger
    run); without it each async call opens its own. ``ca_bundle``: a CA file (or directory) that
    verifies an ``https`` dashboard signed by a private CA, for every sync, async and SDK request.
    """

    def __init__(self, dashboard_url: str, *, token: str | None = None, auth_mode: AuthMode | str | None = None,
                 timeout_s: float = 30.0, session: Any = None, ca_bundle: str | None = None) -> None:
        from verl_pipeline.auth import AuthMode

        self.dashboard_url = dashboard_url.rstrip("/")
        if auth_mode is None:
            auth_mode = AuthMode.TOKEN if token else AuthMode.DISABLED
        try:
            self.auth_mode = AuthMode(auth_mode)
        except ValueError:
            raise ClusterError(f"auth_mode={auth_mode!r} for the Ray dashboard {self.dashboard_url} is not a Ray auth "
                               "mode: use 'token' or 'disabled' (the cluster profile's auth_mode)") from None
        self._token = token
        self.timeout_s = timeout_s
        self._session = session
        self._agent_unreachable_until = float("-inf")  # monotonic time
        self._parsed_urls: dict[str, Any] = {}
        self.ca_bundle = ca_bundle
        self._ssl_context: ssl.SSLContext | None = None

    @property
    def headers(self) -> dict[str, str]:
        """The ``Authorization`` header of a token-auth cluster; none for an auth-disabled one.

        A token-auth client without a token sends none either: the cluster's refusal (401) names the fix.
        """
        if self.auth_mode.value != "token" or not self._token:
            return {}
        return {"Authorization": f"Bearer {self._token}"}

    @property
    def verify(self) -> str | bool:
        """``requests``' ``verify``: the CA bundle when one is set, else the system's CAs."""
        return self.ca_bundle or True

    @property
    def ssl_context(self) -> ssl.SSLContext | bool:
        """aiohttp's ``ssl``: a context trusting the CA bundle, else True (the system's CAs)."""
        if not self.ca_bundle:
            return True
        if self._ssl_context is None:
            path = Path(self.ca_bundle)
            self._ssl_context = ssl.create_default_context(
                cafile=None if path.is_dir() else str(path), capath=str(path) if path.is_dir() else None)
        return self._ssl_context

    def _url(self, path: str) -> str:
        return f"{self.dashboard_url}{path}"

    def _aurl(self, url: str) -> Any:
        """``url`` as a parsed ``yarl.URL``, parsed once per client: a waiter asks for the same few
        URLs every poll, and aiohttp would parse a string again each time."""
        parsed = self._parsed_urls.get(url)
        if parsed is None:
            import yarl

            parsed = self._parsed_urls[url] = yarl.URL(url)
        return parsed

    # -- sync -------------------------------------------------------------------------------------
    def _get(self, path: str, *, ok404: bool = False) -> Any:
        body = self._get_bytes(path, ok404=ok404)
        return None if body is None else json.loads(body)

    def _get_bytes(self, path: str, *, ok404: bool = False) -> bytes | None:
        try:
            r = requests.get(self._url(path), headers=self.headers, timeout=self.timeout_s, verify=self.verify)
        except requests.RequestException as e:
            raise ClusterError(f"Ray dashboard {self.dashboard_url} is unreachable: {e}") from e
        if ok404 and r.status_code == 404:
            return None
        if r.status_code in (401, 403):
            raise ClusterError(
                f"Ray dashboard {self.dashboard_url} refused the request ({r.status_code}: {r.text.strip()}); "
                "give the cluster's token (its token file for a cluster the pipeline started, else the Airflow "
                "connection password or VERL_PIPELINE_RAY_TOKEN) and set auth_mode to match the cluster"
            )
        if r.status_code >= 400:
            raise ClusterError(f"GET {path} on {self.dashboard_url} failed ({r.status_code}): {r.text[:500]}")
        return r.content

    def version(self) -> dict[str, Any]:
        """Ray's ``/api/version``: answers once the Jobs API is up."""
        data: dict[str, Any] = self._get("/api/version")
        return data

    def nodes(self) -> list[NodeInfo]:
        """Every node the cluster knows, alive or dead, with its total resources."""
        return _parse_nodes(self._get_bytes(_NODE_SUMMARY) or b"")

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
                              timeout=self.timeout_s, verify=self.verify)
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

        headers = self.headers
        deadline = time.monotonic() + NO_AGENT_WAIT_S
        while True:
            try:
                with _ray_sdk_adds_no_auth():
                    sdk = JobSubmissionClient(self.dashboard_url, headers=headers, verify=self.verify)
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
                # Ray created no job: its head's job agent has not registered yet (a head just started on a
                # busy machine). Ray asks to try again; the same submission_id is then still free.
                if NO_AGENT in str(e) and time.monotonic() < deadline:
                    log.info("Ray job %s: %s; submitting again", submission_id, NO_AGENT)
                    time.sleep(2)
                    continue
                raise JobError(f"Submitting Ray job {submission_id} to {self.dashboard_url} failed: {e}") from e

    # -- async (for triggers) ---------------------------------------------------------------------
    @asynccontextmanager
    async def _asession(self) -> AsyncIterator[Any]:
        if self._session is not None:
            yield self._session
            return
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s)) as session:
            yield session

    async def _aget(self, path: str, *, ok404: bool = False) -> Any:
        body = await self._aget_bytes(path, ok404=ok404)
        return None if body is None else json.loads(body)

    async def _aget_bytes(self, path: str, *, ok404: bool = False) -> bytes | None:
        async with self._asession() as session, \
                session.get(self._aurl(self._url(path)), headers=self.headers, ssl=self.ssl_context) as r:
            if ok404 and r.status == 404:
                return None
            if r.status >= 400:
                text = await r.text()
                raise ClusterError(f"GET {path} on {self.dashboard_url} failed ({r.status}): {text[:500]}")
            body: bytes = await r.read()
            return body

    async def aget_job(self, submission_id: str) -> JobInfo | None:
        data = await self._aget(f"/api/jobs/{submission_id}", ok404=True)
        return JobInfo.from_api(data) if data else None

    async def ajob_details(self) -> dict[str, dict[str, Any]]:
        """Every submitted job the cluster knows (Ray's job list, each as its JobDetails JSON), by
        submission id: one read that answers the status of many jobs (parse one with :meth:`JobInfo.from_api`)."""
        data = await self._aget("/api/jobs/")
        return {str(d["submission_id"]): d for d in data or [] if isinstance(d, dict) and d.get("submission_id")}

    async def alogs(self, submission_id: str) -> str:
        """The whole log (Ray reads and sends all of it): for one-off reads, never for polling."""
        data = await self._aget(f"/api/jobs/{submission_id}/logs")
        return str(data.get("logs", ""))

    @asynccontextmanager
    async def alog_stream(self, info: JobInfo, start: int, *, max_bytes: int,
                          jump_to_tail: bool = True) -> AsyncIterator[LogStream]:
        """The job's driver log from byte ``start`` on, at most ``max_bytes`` of it.

        Read from the driver node's dashboard agent with ``Range: bytes=<start>-<start+max_bytes-1>``:
        the agent reads and sends only that range, however far behind ``start`` is. When more than
        ``max_bytes`` are new, ``jump_to_tail`` (a waiter that must keep up) jumps to the last
        ``max_bytes`` of the file (``skipped_bytes``); without it the next ``max_bytes`` are read
        (a reader that wants every byte reads again from the new cursor). When the agent cannot be
        reached, the state API serves the file through the dashboard instead (whole file streamed;
        bounded memory) for the next ``AGENT_RETRY_S`` seconds; then the agent is tried again. A pending
        job that Ray has not placed yet has no log to read (``LogSource.NOT_PLACED``, no bytes).
        """
        import aiohttp

        name = JOB_LOG_FILE.format(submission_id=info.submission_id)
        agent = info.driver_agent_http_address
        if info.status is JobState.PENDING and not agent and not info.driver_node_id:
            yield LogStream(start=start, size=None, skipped_bytes=0, source=LogSource.NOT_PLACED)
            return
        if agent and time.monotonic() >= self._agent_unreachable_until:
            reading = False
            try:
                async with self._agent_range(f"{agent.rstrip('/')}/logs/{name}", start, max_bytes,
                                             jump_to_tail=jump_to_tail) as stream:
                    reading = True
                    yield stream
                return
            except (aiohttp.ClientConnectorError, asyncio.TimeoutError) as e:
                if reading:  # the agent answered; this is a failure while reading, not a closed port
                    raise
                self._agent_unreachable_until = time.monotonic() + AGENT_RETRY_S
                log.warning("The dashboard agent %s of job %s is unreachable (%s): reading its log through the "
                            "state API at %s instead (the whole file each poll) for %.0f s, then trying the agent "
                            "again; open the agent's port to the triggerer to read only new bytes", agent,
                            info.submission_id, e, self.dashboard_url, AGENT_RETRY_S)
        async with self._state_api_file(info, start, max_bytes) as stream:
            yield stream

    @asynccontextmanager
    async def _agent_range(self, url: str, start: int, max_bytes: int, *,
                           jump_to_tail: bool) -> AsyncIterator[LogStream]:
        import aiohttp

        if max_bytes < 1:
            raise ValueError(f"max_bytes={max_bytes}: a log read needs at least 1 byte (e.g. max_bytes=1048576)")
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=min(5.0, self.timeout_s))
        async with self._asession() as session:
            async with session.get(self._aurl(url),
                                   headers={**self.headers, "Range": f"bytes={start}-{start + max_bytes - 1}"},
                                   timeout=timeout) as r:
                if r.status == 404:  # the driver has not written anything yet
                    yield LogStream(start=start, size=None, skipped_bytes=0, source=LogSource.AGENT)
                    return
                first, size = _range_of(r, url)
                if r.status == 416 or size - start <= max_bytes or not jump_to_tail:
                    body = r.content if r.status != 416 else None
                    yield LogStream(start=start, size=size, skipped_bytes=0, source=LogSource.AGENT, body=body,
                                    discard=max(0, start - first), limit=max_bytes if r.status == 200 else None)
                    return
                # Far behind: this range's body is left unread (leaving the response closes the
                # connection, so the agent stops sending it) and the tail is asked for instead.
            jump = size - max_bytes
            async with session.get(url, headers={**self.headers, "Range": f"bytes={jump}-{size - 1}"},
                                   timeout=timeout) as r:
                first, _ = _range_of(r, url)
                yield LogStream(start=jump, size=size, skipped_bytes=jump - start, source=LogSource.AGENT,
                                body=r.content, discard=max(0, jump - first), limit=max_bytes)

    @asynccontextmanager
    async def _state_api_file(self, info: JobInfo, start: int, max_bytes: int) -> AsyncIterator[LogStream]:
        params = {"submission_id": info.submission_id, "lines": "-1"}
        if info.driver_node_id:
            params["node_id"] = info.driver_node_id
        async with self._asession() as session:
            async with session.get(self._url("/api/v0/logs/file"), params=params, headers=self.headers,
                                   ssl=self.ssl_context) as r:
                if r.status >= 400:
                    text = await r.text()
                    raise ClusterError(f"GET /api/v0/logs/file on {self.dashboard_url} failed ({r.status}): "
                                       f"{text[:300]}")
                yield LogStream(start=start, size=None, skipped_bytes=0, source=LogSource.STATE_API, body=r.content,
                                discard=start, limit=max_bytes)

    async def aactor_starts(self, ray_job_id: str, *, alive_only: bool) -> tuple[list[Any], list[Any]]:
        """Ray's records of the actors a job created (its ``ACTOR_CREATION_TASK`` tasks, with their events
        and profiling) and of the cluster's worker processes (``alive_only``: those alive now; a running
        job's actors are), from the state API: two reads, for :func:`verl_pipeline.jobs.startup.actors.from_ray`."""
        tasks = await self._astate("tasks", [("job_id", ray_job_id), ("type", "ACTOR_CREATION_TASK")])
        workers = await self._astate("workers", [("worker_type", "WORKER"),
                                                 *([("is_alive", "True")] if alive_only else [])])
        return tasks, workers

    async def _astate(self, resource: str, filters: list[tuple[str, str]]) -> list[Any]:
        """One list of Ray's state API (``/api/v0/<resource>``), in detail, filtered by equality."""
        from urllib.parse import urlencode

        query = [("detail", "1"), ("limit", str(STATE_LIST_LIMIT))]
        for key, value in filters:
            query += [("filter_keys", key), ("filter_predicates", "="), ("filter_values", value)]
        data = await self._aget(f"/api/v0/{resource}?{urlencode(query)}")
        result = ((data or {}).get("data") or {}).get("result") or {}
        rows = result.get("result") if isinstance(result, dict) else None
        return rows if isinstance(rows, list) else []

    async def anodes(self) -> list[NodeInfo]:
        """Every node the cluster knows, alive or dead, with its total resources and its GPUs' readings."""
        return _parse_nodes(await self._aget_bytes(_NODE_SUMMARY) or b"")


async def follow_log(client: RayJobsClient, submission_id: str, write: Callable[[bytes], None], *, follow: bool,
                     poll_s: float = 2.0, max_bytes: int = FOLLOW_READ_BYTES) -> JobInfo:
    """Hand ``write`` the job's driver log from its first byte, each byte once; with ``follow``,
    then its new bytes every ``poll_s`` seconds until the job is terminal. Returns the job's last info.

    Each poll reads the job's status first and then every byte after the cursor, ``max_bytes``
    per ranged read (:meth:`RayJobsClient.alog_stream` without jumping), so the poll that sees the job
    terminal also writes the end of its log.
    """
    cursor = 0
    while True:
        info = await client.aget_job(submission_id)
        if info is None:
            raise JobError(f"no Ray job {submission_id!r} on {client.dashboard_url}: check the job id "
                           "(`verl-pipeline status`) or the run's cluster")
        terminal = info.status.is_terminal()
        if info.driver_agent_http_address:
            cursor = await _write_new_bytes(client, info, cursor, write, max_bytes=max_bytes)
        elif terminal:  # ended before a driver ran (no agent to range-read): Ray's whole-log endpoint
            data = (await client.alogs(submission_id)).encode()
            if data[cursor:]:
                write(data[cursor:])
        if not follow or terminal:
            return info
        await asyncio.sleep(poll_s)


async def _write_new_bytes(client: RayJobsClient, info: JobInfo, cursor: int, write: Callable[[bytes], None], *,
                           max_bytes: int) -> int:
    """Every byte of the driver log after ``cursor`` to ``write``; the new cursor."""
    while True:
        read = 0
        async with client.alog_stream(info, cursor, max_bytes=max_bytes, jump_to_tail=False) as stream:
            async for chunk in stream.chunks():
                write(chunk)
                read += len(chunk)
        log.info("Ray job %s: %d new log bytes from byte %d (%s)", info.submission_id, read, cursor,
                 stream.source.value)
        cursor += read
        if read < max_bytes:
            return cursor


def wait_job_ended(client: RayJobsClient, job_id: str, timeout_s: float = STOP_WAIT_S) -> bool:
    """Wait (bounded) until Ray says a stopped job ended: True when it did."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = client.get_job(job_id)
        if info is None or info.status.is_terminal():
            return True
        time.sleep(0.5)
    log.warning("Ray job %s did not stop within %.0fs", job_id, timeout_s)
    return False


def _range_of(r: Any, url: str) -> tuple[int, int]:
    """``(first byte, file size)`` of a ranged response."""
    if r.status in (401, 403):
        raise ClusterError(f"The Ray dashboard agent refused {url} ({r.status}): set the cluster's token")
    if r.status == 200:  # Range ignored: the whole file
        return 0, int(r.headers.get("Content-Length", 0))
    m = _CONTENT_RANGE.fullmatch(r.headers.get("Content-Range", "").strip())
    if r.status not in (206, 416) or m is None:
        raise ClusterError(f"GET {url} failed ({r.status}, Content-Range {r.headers.get('Content-Range')!r})")
    return int(m.group(1) or 0), int(m.group(2))
