"""A run's Ray dashboard through Airflow: the API server forwards the browser's reads to the run's
cluster and adds the cluster's token itself.

Every cluster the pipeline starts uses Ray's token auth, and the token is a 0600 file on the worker's
host: a person looking at the run in Airflow has no token to type into the dashboard's prompt, and
often cannot reach the dashboard's port at all. :func:`add_dashboard_routes` adds, to the report app
(behind the same ``requires_access_dag`` check as the report), a read-only reverse proxy:

``GET|HEAD <prefix>/runs/{dag_id}/{run_id}/dashboard/{path}`` → ``<the run's dashboard>/{path}``

- The cluster is the run's current one, ``cluster.json`` of the run directory named by the provision
  task's XCom ``run_dir``; its token is found as the wait task's hook finds it (the Airflow
  connection's password, else the handle's token file). Once the run's teardown retired the record,
  the proxy answers 404 and says so.
- What reaches the browser: the dashboard's bytes and a short list of content headers
  (:data:`RESPONSE_HEADERS`; never ``Set-Cookie``). What reaches Ray: the path, the query and a short
  list of content-negotiation headers (:data:`REQUEST_HEADERS`; never the browser's cookies, which
  carry the Airflow session) plus ``Authorization``. The token is in no URL, cookie, page or log.
- Read-only: ``GET`` and ``HEAD``, as Ray's own dashboard allows browsers; the few GET endpoints that
  attach a profiler to a live process or hand out a job's code package are refused
  (:data:`REFUSED_PATHS`). A 401/403 from Ray becomes a 502 naming the cluster: passed through, it
  would make the dashboard show its token prompt.
- Bounded: at most :data:`MAX_ACTIVE` requests forwarded at once per API-server worker, each with a
  connect, read and total timeout, streamed in chunks (a large log file never sits in memory).

Ray's dashboard is a single-page app whose every request is relative to its page (``./static/…``,
``api/…``) and whose pages live in the URL fragment (``#/jobs/<id>``), so it works under this path.
"""

from __future__ import annotations

import functools
import json
import logging
import posixpath
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote, urlsplit

from verl_pipeline.airflow.task_ids import PROVISION_TASK, RUN_DIR_KEY, TEARDOWN_TASK, stored_xcom
from verl_pipeline.exceptions import PipelineError

if TYPE_CHECKING:
    from fastapi import FastAPI
    from sqlalchemy.orm import Session

    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.jobs.client import RayJobsClient

log = logging.getLogger(__name__)

#: Browser request headers that reach Ray (content negotiation and ranged or conditional reads).
REQUEST_HEADERS = ("accept", "accept-encoding", "range", "if-range", "if-none-match", "if-modified-since")
#: Ray's response headers that reach the browser (what the content is; nothing that sets state).
RESPONSE_HEADERS = ("content-type", "content-length", "content-encoding", "content-range", "accept-ranges",
                    "etag", "last-modified")
#: Dashboard paths the proxy refuses, by prefix: each attaches a profiler to a live worker process
#: (py-spy record, memray, the torch and JAX profilers) or hands out a job's uploaded code package.
#: ``worker/traceback`` and ``task/traceback`` (a py-spy dump of the stacks) stay: a hung run needs them.
REFUSED_PATHS = ("memory_profile", "task/cpu_profile", "worker/cpu_profile", "worker/gpu_profile",
                 "worker/jax_profile", "api/packages/")
#: Ray's static files are named by content hash: the browser may keep them (its own cache only).
STATIC_PREFIX = "static/"
#: Requests forwarded at once by one API-server worker; more get a 503 (the dashboard asks again).
MAX_ACTIVE = 64
#: Seconds to connect, to wait for each read, and for a whole response (a log file included).
CONNECT_TIMEOUT_S = 10.0
READ_TIMEOUT_S = 60.0
TOTAL_TIMEOUT_S = 300.0
CHUNK_BYTES = 64 * 1024
#: The dashboard runs Ray's own scripts from this origin; nothing else runs, and it talks to nothing else.
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
                           "img-src 'self' data: blob:; font-src 'self' data:; connect-src 'self'; "
                           "object-src 'none'; base-uri 'self'; form-action 'none'; frame-ancestors 'self'")
SECURITY_HEADERS = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
                    "Referrer-Policy": "same-origin"}


class DashboardUnavailable(LookupError):
    """The run's dashboard cannot be shown; the message says why (for the page), ``status`` how."""

    def __init__(self, message: str, status: int = 404) -> None:
        super().__init__(message)
        self.status = status


def upstream_path(path: str) -> str:
    """``path`` (below the proxy's prefix, already percent-decoded) as the dashboard path to request,
    quoted again; :class:`DashboardUnavailable` (403) for a path the proxy does not forward."""
    if "\\" in path or "\x00" in path or path.startswith("/"):
        raise DashboardUnavailable(f"no dashboard path {path!r}", 403)
    parts = path.split("/")
    if any(p in (".", "..") for p in parts):
        raise DashboardUnavailable(f"no dashboard path {path!r}: '.' and '..' are not forwarded", 403)
    if posixpath.normpath("/" + path).lstrip("/").startswith(REFUSED_PATHS):
        raise DashboardUnavailable(
            f"{path!r} attaches a profiler to a live process or hands out a job's code: the run's dashboard "
            "in Airflow is read-only (use Ray's own dashboard with the cluster's token for profiling)", 403)
    return "/" + quote(path, safe="/:@!$&'()*+,;=-._~")


def forwarded_request_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The browser's headers that may reach Ray (:data:`REQUEST_HEADERS`); cookies never do."""
    return {name: value for name, value in headers.items() if name.lower() in REQUEST_HEADERS}


def forwarded_response_headers(headers: Mapping[str, str], path: str) -> dict[str, str]:
    """Ray's headers that may reach the browser (:data:`RESPONSE_HEADERS`), plus the proxy's own:
    security headers and a ``Cache-Control`` that keeps everything but Ray's static files uncached."""
    out = {name.lower(): value for name, value in headers.items() if name.lower() in RESPONSE_HEADERS}
    out["cache-control"] = "private, max-age=86400" if path.startswith(STATIC_PREFIX) else "private, no-store"
    return {**out, **SECURITY_HEADERS}


def proxied_location(location: str, *, dashboard_url: str, base_path: str) -> str | None:
    """A redirect of the dashboard as an address under the proxy (``base_path`` ends with ``/``);
    None when it points away from the dashboard (it is then not followed)."""
    parts = urlsplit(location)
    if parts.scheme or parts.netloc:
        if not location.startswith(dashboard_url.rstrip("/") + "/"):
            return None
        location = location[len(dashboard_url.rstrip("/")):]
    if location.startswith("/"):
        return base_path + location.lstrip("/")
    return location  # relative: the browser resolves it against the proxied address as Ray meant


def run_dir_from_xcom(value: Any) -> Path:
    """The provision task's ``run_dir`` XCom (a path, or its JSON text) as an absolute path."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            pass
    if not isinstance(value, str) or not Path(value).is_absolute():
        raise DashboardUnavailable(f"the provision task's {RUN_DIR_KEY!r} XCom is not an absolute path: "
                                   f"{value!r}"[:200])
    return Path(value)


def find_cluster(dag_id: str, run_id: str, *, session: Session) -> ClusterHandle:
    """The run's current cluster: ``cluster.json`` of the run directory its provision task named."""
    from verl_pipeline.cluster.base import ClusterHandle
    from verl_pipeline.rundir import RunDir

    row = stored_xcom(session, dag_id=dag_id, run_id=run_id, task_id=PROVISION_TASK, key=RUN_DIR_KEY)
    if row is None:
        raise DashboardUnavailable(f"run {run_id!r} of DAG {dag_id!r} has no cluster yet (its task "
                                   f"{PROVISION_TASK!r} has not recorded a run directory)")
    recorded = RunDir(run_dir_from_xcom(row.value)).cluster()
    if recorded is None:
        raise DashboardUnavailable(f"run {run_id!r} of DAG {dag_id!r} has no live cluster: {TEARDOWN_TASK!r} "
                                   "released it (the job's log is in the wait task's log, its figures in the "
                                   "run report)")
    return ClusterHandle.from_dict(recorded)


def cluster_client(handle: ClusterHandle) -> RayJobsClient:
    """A client carrying the cluster's address, auth and CA bundle, as the wait task's hook builds it
    (the Airflow connection's password, else the handle's token file). Reads the token; no request."""
    from verl_pipeline.airflow.hooks import RayJobsHook

    return RayJobsHook(handle.to_dict()).client


def _unavailable_page(message: str) -> str:
    from html import escape

    return (f"<!doctype html><meta charset='utf-8'><title>Ray dashboard unavailable</title>"
            f"<p style='font-family:sans-serif'>Ray dashboard unavailable: {escape(message)}</p>")


@dataclass
class _Slots:
    """Requests forwarded right now (one event loop per API-server worker: no lock needed)."""

    active: int = 0


def add_dashboard_routes(app: FastAPI, *, route: str, dependencies: list[Any]) -> None:
    """Add the proxy to ``app`` at ``route`` (``…/{dag_id}/{run_id}/dashboard``), each request
    behind ``dependencies`` (Airflow's read access to the DAG's runs)."""
    from fastapi import Request
    from fastapi.responses import RedirectResponse

    forward = _Forwarder()

    @app.get(route, dependencies=dependencies, include_in_schema=False)
    def dashboard_without_slash(dag_id: str, run_id: str) -> Any:
        # Relative, so any base_url path is kept; the slash makes the app's relative requests land below.
        return RedirectResponse(url="dashboard/", status_code=307)

    async def dashboard(request: Request, dag_id: str, run_id: str, path: str) -> Any:
        return await forward(request, dag_id, run_id, path)

    # FastAPI resolves a string annotation in the module's globals, where Request is not (imported here,
    # at the first request, like the rest of FastAPI): give it the class.
    dashboard.__annotations__["request"] = Request
    app.add_api_route(route + "/{path:path}", dashboard, methods=["GET", "HEAD"], dependencies=dependencies,
                      include_in_schema=False, response_model=None)


def _page(message: str, status: int) -> Any:
    """The proxy's own page saying why the dashboard is not shown."""
    from fastapi.responses import HTMLResponse

    return HTMLResponse(_unavailable_page(message), status_code=status,
                        headers={**SECURITY_HEADERS, "Cache-Control": "private, no-store"})


def _client_of(dag_id: str, run_id: str) -> RayJobsClient:
    """A client of the run's cluster with its credentials; DashboardUnavailable saying why there is none."""
    from airflow.sdk.exceptions import AirflowNotFoundException
    from airflow.utils.session import create_session

    with create_session() as session:
        handle = find_cluster(dag_id, run_id, session=session)
    try:
        return cluster_client(handle)
    except (PipelineError, AirflowNotFoundException) as e:  # the token file or connection is missing
        raise DashboardUnavailable(f"no credentials for the run's Ray dashboard at {handle.dashboard_url}: {e}",
                                   502) from e


@functools.cache
def _upstream_response() -> type:
    """The response class streaming Ray's answer (FastAPI is imported at the first request, not with the module)."""
    from fastapi.responses import StreamingResponse

    class UpstreamResponse(StreamingResponse):
        """Ray's answer, streamed; the upstream connection and the slot are released however the
        response ends (sent, failed, or the browser gone before its first byte)."""

        def __init__(self, body: AsyncIterator[bytes], *, release: Callable[[], Any], **kwargs: Any) -> None:
            super().__init__(body, **kwargs)
            self._release = release

        async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
            try:
                await super().__call__(scope, receive, send)
            finally:
                await self._release()

    return UpstreamResponse


class _Forwarder:
    """Forwards a request to the run's dashboard with the cluster's token; at most :data:`MAX_ACTIVE` at once."""

    def __init__(self) -> None:
        import aiohttp

        self.slots = _Slots()
        self.timeout = aiohttp.ClientTimeout(total=TOTAL_TIMEOUT_S, sock_connect=CONNECT_TIMEOUT_S,
                                             sock_read=READ_TIMEOUT_S)

    async def __call__(self, request: Any, dag_id: str, run_id: str, path: str) -> Any:
        import aiohttp
        import anyio
        from starlette.concurrency import run_in_threadpool

        try:
            target = upstream_path(path)
            client = await run_in_threadpool(_client_of, dag_id, run_id)
        except DashboardUnavailable as e:
            log.info("Ray dashboard of %s/%s: %s", dag_id, run_id, e)
            return _page(str(e), e.status)
        if self.slots.active >= MAX_ACTIVE:
            return _page(f"{MAX_ACTIVE} dashboard requests are being served: try again", 503)
        url = client.dashboard_url + target + (f"?{request.url.query}" if request.url.query else "")
        headers = {**forwarded_request_headers(request.headers), **client.headers}
        self.slots.active += 1
        session = aiohttp.ClientSession(timeout=self.timeout, auto_decompress=False,
                                        cookie_jar=aiohttp.DummyCookieJar())
        upstream: Any = None

        async def release() -> None:
            self.slots.active -= 1  # first: a cancelled close below must not leak the slot
            if upstream is not None:
                upstream.close()
            with anyio.CancelScope(shield=True):  # the browser may be gone: close anyway
                await session.close()

        try:
            upstream = await session.request(request.method, url, headers=headers, allow_redirects=False,
                                             ssl=client.ssl_context)
        except (aiohttp.ClientError, TimeoutError) as e:
            await release()
            log.warning("Ray dashboard of %s/%s at %s: %s", dag_id, run_id, client.dashboard_url, type(e).__name__)
            return _page(f"the run's Ray dashboard at {client.dashboard_url} does not answer "
                         f"({type(e).__name__}: {e})", 502)
        try:
            out_headers = _passed_headers(upstream, request, path, client)
        except DashboardUnavailable as e:
            await release()
            log.warning("Ray dashboard of %s/%s: %s", dag_id, run_id, e)
            return _page(str(e), e.status)

        async def body() -> AsyncIterator[bytes]:
            if request.method == "HEAD":
                return
            async for chunk in upstream.content.iter_chunked(CHUNK_BYTES):
                yield chunk

        return _upstream_response()(body(), release=release, status_code=upstream.status, headers=out_headers)


def _passed_headers(upstream: Any, request: Any, path: str, client: RayJobsClient) -> dict[str, str]:
    """The headers passed on with Ray's answer (a redirect within the dashboard rewritten to stay under the
    proxy); DashboardUnavailable when the answer is not passed on: Ray refused the credentials, or it
    redirected away from itself."""
    if upstream.status in (401, 403):
        raise DashboardUnavailable(f"the run's Ray dashboard at {client.dashboard_url} refused the credentials the "
                                   f"pipeline has for it ({upstream.status}): the cluster's token or auth_mode "
                                   "changed", 502)
    out_headers = forwarded_response_headers(upstream.headers, path)
    if 300 <= upstream.status < 400 and "location" in upstream.headers:
        base_path = request.url.path[:len(request.url.path) - len(path)]
        location = proxied_location(upstream.headers["location"], dashboard_url=client.dashboard_url,
                                    base_path=base_path)
        if location is None:
            raise DashboardUnavailable("the run's Ray dashboard redirected away from itself", 502)
        out_headers["location"] = location
    return out_headers


__all__ = ["DashboardUnavailable", "add_dashboard_routes", "cluster_client", "find_cluster",
           "forwarded_request_headers", "forwarded_response_headers", "proxied_location", "run_dir_from_xcom",
           "upstream_path"]
