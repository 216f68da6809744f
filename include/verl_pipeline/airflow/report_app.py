"""Run reports and Ray dashboards in the Airflow UI: a FastAPI app the API server mounts under :data:`URL_PREFIX`.

Routes (behind Airflow's own auth: the UI's session cookie or an ``Authorization: Bearer`` JWT, and
read access to the DAG's runs through the configured auth manager):

``GET /verl-pipeline/runs/{dag_id}/{run_id}/report/``           the run's ``report.html``
``GET /verl-pipeline/runs/{dag_id}/{run_id}/report/{name}``     one file of that report's directory
                                                                 (its plots, ``report.json``)
``GET /verl-pipeline/runs/{dag_id}/{run_id}/dashboard/{path}``  the run's Ray dashboard, read-only, with
                                                                 the cluster's token added by the server
                                                                 (:mod:`verl_pipeline.airflow.dashboard_proxy`)

The report of a run is found through the XCom return value of its report task,
``{"report_dir": ..., "html": ...}``. Only a plain file name directly inside that directory, with a
suffix the report uses, is ever served. Until the run has a report, its page says why, and shows the
run's restart budget as the wait task last decided it (its ``restart_budget`` XCom): a run that
trains for a week shows what it has survived, and what it can still afford, on its "Run report" tab.

Every Airflow process that loads plugins imports this module; only the API server serves it. So
nothing here imports FastAPI or Airflow's API modules (seconds of imports) before the first request.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

from verl_pipeline.airflow.task_ids import REPORT_TASK, RESTART_BUDGET_KEY, WAIT_TASK, stored_xcom

if TYPE_CHECKING:
    from fastapi import FastAPI
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)

#: Where the API server mounts the app (the plugin registers it there; links and the view point here).
URL_PREFIX = "/verl-pipeline"
#: The report page of one run, below :data:`URL_PREFIX`. The trailing slash matters: the page refers
#: to its plots by relative name, which the browser resolves against this directory-like path.
REPORT_ROUTE = "/runs/{dag_id}/{run_id}/report/"
#: The run's Ray dashboard, below :data:`URL_PREFIX`; the slash matters as for the report (the
#: dashboard's own requests are relative to its page).
DASHBOARD_ROUTE = "/runs/{dag_id}/{run_id}/dashboard/"
#: The files a report consists of, by suffix, with the media type they are served as.
MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".png": "image/png",
    ".json": "application/json",
}
#: The report page may show its own images and styles, nothing else (its text comes from run data).
CONTENT_SECURITY_POLICY = ("default-src 'none'; img-src 'self' data:; style-src 'self' 'unsafe-inline'; "
                           "base-uri 'none'; form-action 'none'; frame-ancestors 'self'")


def report_path(dag_id: str, run_id: str) -> str:
    """The report page of a run, from the API server's root (run ids carry ``:`` and ``+``: quoted)."""
    return URL_PREFIX + REPORT_ROUTE.format(dag_id=quote(dag_id, safe=""), run_id=quote(run_id, safe=""))


def report_url(dag_id: str, run_id: str, *, base_url: str) -> str:
    """The report page's address under Airflow's ``[api] base_url`` (empty: the server's root)."""
    return base_url.rstrip("/") + report_path(dag_id, run_id)


def dashboard_url(dag_id: str, run_id: str, *, base_url: str) -> str:
    """The run's Ray dashboard through the API server, under Airflow's ``[api] base_url`` (empty: an
    address from the server's root, which the UI's links resolve against its own origin)."""
    return base_url.rstrip("/") + URL_PREFIX + DASHBOARD_ROUTE.format(
        dag_id=quote(dag_id, safe=""), run_id=quote(run_id, safe=""))


def view_href() -> str:
    """The DAG-run view's address template: relative to the UI's ``<base href>`` (so it works under a
    ``base_url`` path too); the UI fills in ``{DAG_ID}`` and ``{RUN_ID}``."""
    return URL_PREFIX.lstrip("/") + REPORT_ROUTE.format(dag_id="{DAG_ID}", run_id="{RUN_ID}")


class ReportNotFound(LookupError):
    """The run has no (readable) report; the message says why, for the 404 page."""


@dataclass(frozen=True)
class RunReport:
    """Where one run's report lies: its directory and the HTML page in it."""

    report_dir: Path
    html: Path

    @classmethod
    def from_xcom(cls, value: Any) -> RunReport:
        """The report task's XCom return value (a dict, or its JSON text) → the report's location.

        Both paths must be absolute and the page must lie directly in the directory; anything else is
        :class:`ReportNotFound` (the app then serves nothing rather than a guessed file).
        """
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise ReportNotFound(f"the report task's XCom is not JSON: {value[:80]!r}") from None
        if not isinstance(value, dict) or not value.get("report_dir") or not value.get("html"):
            raise ReportNotFound(f"the report task's XCom has no report_dir/html: {value!r}"[:200])
        report_dir, html = Path(str(value["report_dir"])), Path(str(value["html"]))
        if not report_dir.is_absolute() or html.parent != report_dir:
            raise ReportNotFound(f"report html {str(html)!r} is not a file directly in report_dir "
                                 f"{str(report_dir)!r}")
        return cls(report_dir=report_dir, html=html)


def report_file(report: RunReport, name: str) -> Path:
    """The file ``name`` of a report, if it may be served: a plain name (no separator, not hidden),
    a suffix of :data:`MEDIA_TYPES`, a regular file that resolves (symlinks followed) to directly
    inside the report's directory. Anything else is :class:`ReportNotFound`."""
    if (not name or name != Path(name).name or "\\" in name or name.startswith(".")
            or Path(name).suffix.lower() not in MEDIA_TYPES):
        raise ReportNotFound(f"no file {name!r} in this run's report")
    root = report.report_dir.resolve()
    path = (root / name).resolve()
    if path.parent != root or not path.is_file():
        raise ReportNotFound(f"no file {name!r} in this run's report")
    return path


def find_report(dag_id: str, run_id: str, *, session: Session) -> RunReport:
    """The report of a DAG run, from the XCom return value of its report task."""
    row = stored_xcom(session, dag_id=dag_id, run_id=run_id, task_id=REPORT_TASK)
    if row is None:
        raise ReportNotFound(f"run {run_id!r} of DAG {dag_id!r} has no report (its task {REPORT_TASK!r} "
                             "has not finished, or the DAG has no such task)")
    return RunReport.from_xcom(row.value)


def restart_budget(dag_id: str, run_id: str, *, session: Session) -> str | None:
    """The run's restart budget as the wait task last decided it (its ``restart_budget`` XCom), in words;
    None when it decided none (no infrastructure failure yet) or the value is not the wait task's."""
    row = stored_xcom(session, dag_id=dag_id, run_id=run_id, task_id=WAIT_TASK, key=RESTART_BUDGET_KEY)
    value = row.value if row is not None else None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, dict) or not value.get("account"):
        return None
    outcome = "the budget is used up: the run failed" if value.get("outcome") == "exhausted" else "restarted"
    return f"after attempt {value.get('attempt')} ({value.get('reason')}): {value['account']}; {outcome}"


def _not_found_page(message: str, budget: str | None = None) -> str:
    from html import escape

    restarts = (f"<p style='font-family:sans-serif'>Restart budget, as last decided {escape(budget)}.</p>"
                if budget else "")
    return (f"<!doctype html><meta charset='utf-8'><title>No run report</title>"
            f"<p style='font-family:sans-serif'>No run report: {escape(message)}</p>{restarts}")


def create_app() -> FastAPI:
    """The FastAPI app (imports FastAPI and Airflow's API security modules: call it in the API server)."""
    from airflow.api_fastapi.auth.managers.models.resource_details import DagAccessEntity
    from airflow.api_fastapi.core_api.security import requires_access_dag
    from airflow.utils.session import create_session
    from fastapi import Depends, FastAPI
    from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse

    from verl_pipeline.airflow.dashboard_proxy import add_dashboard_routes

    app = FastAPI(title="verl pipeline: run reports and Ray dashboards", docs_url=None, redoc_url=None,
                  openapi_url=None)
    # Airflow's own check: a valid JWT (cookie `_token` or Bearer) of a user who may read this DAG's runs.
    may_read_runs = [Depends(requires_access_dag("GET", DagAccessEntity.RUN))]
    headers = {"Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Content-Type-Options": "nosniff",
               "Cache-Control": "private, no-store"}
    route = REPORT_ROUTE.rstrip("/")

    @app.get(route, dependencies=may_read_runs, include_in_schema=False)
    def report_without_slash(dag_id: str, run_id: str) -> Any:
        return RedirectResponse(url="report/", status_code=307)  # relative: keeps any base_url path

    def serve(dag_id: str, run_id: str, name: str | None) -> Any:
        """One file of the run's report (``None``: its page), or a 404 page saying why not."""
        try:
            with create_session() as session:
                report = find_report(dag_id, run_id, session=session)
            path = report_file(report, report.html.name if name is None else name)
        except ReportNotFound as e:
            log.info("run report %s/%s: %s", dag_id, run_id, e)
            budget = None
            if name is None:  # the page itself: what the run has survived so far
                with create_session() as session:
                    budget = restart_budget(dag_id, run_id, session=session)
            return HTMLResponse(_not_found_page(str(e), budget), status_code=404, headers=headers)
        return FileResponse(path, media_type=MEDIA_TYPES[path.suffix.lower()], headers=headers)

    @app.get(route + "/", dependencies=may_read_runs, response_model=None)
    def report_page(dag_id: str, run_id: str) -> Any:
        return serve(dag_id, run_id, None)

    @app.get(route + "/{name}", dependencies=may_read_runs, response_model=None)
    def report_asset(dag_id: str, run_id: str, name: str) -> Any:
        return serve(dag_id, run_id, name)

    add_dashboard_routes(app, route=DASHBOARD_ROUTE.rstrip("/"), dependencies=may_read_runs)
    return app


class ReportApp:
    """The ASGI app the plugin registers: builds :func:`create_app` on its first request, so that
    loading the plugin (scheduler, workers, DAG processor) never imports FastAPI or Airflow's API."""

    def __init__(self) -> None:
        self._app: FastAPI | None = None
        self._lock = threading.Lock()

    def app(self) -> FastAPI:
        with self._lock:
            if self._app is None:
                self._app = create_app()
            return self._app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app()(scope, receive, send)
