"""The run reports app: which files it may serve (pure), and its auth inside Airflow's API server
machinery (the plugin loaded from plugins/ and mounted by Airflow's ``init_plugins``, the simple auth
manager's JWTs, a DAG run and its XCom in the metadata DB)."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.airflow import api_server
from tests.airflow.api_server import jwt
from verl_pipeline.airflow.report_app import (
    URL_PREFIX,
    ReportNotFound,
    RunReport,
    report_file,
    report_path,
    report_url,
    view_href,
)
from verl_pipeline.airflow.report_link import RunReportLink

REPO = Path(__file__).resolve().parents[2]
DAG_ID = "vp_report_app_test"


def png_bytes() -> bytes:
    """A valid 1x1 PNG."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 1, 1, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"\x00\xff\x00\x00")) + chunk(b"IEND", b""))


def make_report(root: Path) -> RunReport:
    """A report directory as the report task leaves it, plus a secret beside it."""
    d = root / "run" / "report"
    d.mkdir(parents=True)
    (d / "report.html").write_text("<html><body><h1>Run report</h1><img src='reward.png'></body></html>")
    (d / "report.json").write_text('{"steps_done": 0}')
    (d / "reward.png").write_bytes(png_bytes())
    (d / "notes.txt").write_text("not part of a report")
    (d / "plots").mkdir()
    (d / "plots" / "x.png").write_bytes(png_bytes())
    (root / "run" / "secret.json").write_text('{"token": "s3cret"}')
    (d / "leak.json").symlink_to(root / "run" / "secret.json")
    return RunReport(report_dir=d, html=d / "report.html")


# -- pure ---------------------------------------------------------------------------------------------

def test_report_file_serves_only_plain_names_of_report_files(tmp_path: Path) -> None:
    report = make_report(tmp_path)
    for name in ("report.html", "report.json", "reward.png"):
        assert report_file(report, name) == (report.report_dir / name).resolve()
    refused = ["../secret.json", "..", ".", "", "plots/x.png", "plots", "/etc/passwd", "..\\secret.json",
               "leak.json",  # a symlink out of the directory
               "notes.txt",  # not a suffix a report has
               "missing.png", ".hidden.png"]
    for name in refused:
        with pytest.raises(ReportNotFound):
            report_file(report, name)


def test_report_location_is_read_from_the_xcom_and_checked() -> None:
    value = {"report_dir": "/data/runs/r1/report", "html": "/data/runs/r1/report/report.html", "steps": 3}
    expected = RunReport(Path("/data/runs/r1/report"), Path("/data/runs/r1/report/report.html"))
    assert RunReport.from_xcom(value) == expected
    assert RunReport.from_xcom('{"report_dir": "/r", "html": "/r/report.html"}').html == Path("/r/report.html")
    for bad in (None, "not json", [], {"report_dir": "/r"}, {"report_dir": "r", "html": "r/report.html"},
                {"report_dir": "/r", "html": "/elsewhere/report.html"}):
        with pytest.raises(ReportNotFound):
            RunReport.from_xcom(bad)


def test_addresses_quote_the_run_id_and_share_one_prefix() -> None:
    run_id = "manual__2026-12-01T15:46:29.123+00:00"
    path = report_path("verl_ppo", run_id)
    assert path == f"{URL_PREFIX}/runs/verl_ppo/manual__2026-12-01T15%3A46%3A29.123%2B00%3A00/report/"
    assert report_url("verl_ppo", run_id, base_url="http://h:8080/airflow/") == "http://h:8080/airflow" + path
    assert report_url("verl_ppo", run_id, base_url="") == path
    # The UI puts the view's address under its <base href>: relative, with the UI's placeholders.
    assert view_href() == f"{URL_PREFIX.lstrip('/')}/runs/{{DAG_ID}}/{{RUN_ID}}/report/"


# -- inside Airflow's API server app ------------------------------------------------------------------

@pytest.fixture
def repo_plugins(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    with api_server.repo_plugins(monkeypatch):
        yield


def test_wait_task_gets_both_links_when_the_api_server_loads_the_dag(repo_plugins: None) -> None:
    """The API server deserializes DAGs: the plugin attaches "Run report" to the wait task by its class,
    beside the operator's own "Ray job"."""
    from airflow.dag_processing.dagbag import DagBag
    from airflow.serialization.serialized_objects import DagSerialization

    from verl_pipeline.airflow.task_ids import WAIT_TASK

    dag = DagBag(dag_folder=str(REPO / "dags" / "verl_ppo.py")).dags["verl_ppo"]
    served = DagSerialization.from_dict(DagSerialization.to_dict(dag))
    links = served.get_task(WAIT_TASK).extra_links
    assert {"Ray job", "Run report"} <= set(links), links


@pytest.fixture
def report_run(airflow_db: Path, tmp_path: Path) -> tuple[str, RunReport]:
    """A DAG run in the metadata DB whose report task's XCom return value is the location of
    ``make_report``."""
    from verl_pipeline.airflow.task_ids import REPORT_TASK

    report = make_report(tmp_path)
    run_id = api_server.dag_run(tmp_path, DAG_ID, REPORT_TASK)
    api_server.set_xcom(DAG_ID, run_id, REPORT_TASK, "return_value",
                        {"report_dir": str(report.report_dir), "html": str(report.html)})
    return run_id, report


@pytest.fixture
def api(repo_plugins: None, report_run: Any) -> Iterator[Any]:
    with api_server.served_plugins() as client:
        yield client


def test_reports_are_served_only_to_users_who_may_read_the_runs(api: Any, report_run: Any, tmp_path: Path) -> None:
    run_id, _ = report_run
    page = report_path(DAG_ID, run_id)
    viewer = {"Authorization": f"Bearer {jwt('viewer')}"}

    # Refused: no credential, a malformed or forged one (an admin's claims, another key), a user
    # without a role (who may read no DAG).
    import jwt as pyjwt

    forged = pyjwt.encode({"sub": "admin", "role": "admin", "aud": "apache-airflow"}, "x" * 64, algorithm="HS512")
    assert api.get(page).status_code == 401
    assert api.get(page, headers={"Authorization": "Bearer not-a-jwt"}).status_code == 403
    assert api.get(page, headers={"Authorization": f"Bearer {forged}"}).status_code == 403
    assert api.get(page, headers={"Authorization": f"Bearer {jwt(None)}"}).status_code == 403
    assert api.get(page + "reward.png").status_code == 401

    # Served: the page (Bearer, and the UI's session cookie), its plot, its JSON.
    r = api.get(page, headers=viewer)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/html") and "<img src='reward.png'>" in r.text
    assert "default-src 'none'" in r.headers["content-security-policy"]
    api.cookies.set("_token", jwt("viewer"))
    assert api.get(page).status_code == 200
    api.cookies.clear()
    r = api.get(page + "reward.png", headers=viewer)
    assert r.status_code == 200 and r.headers["content-type"] == "image/png" and r.content == png_bytes()
    assert api.get(page + "report.json", headers=viewer).json() == {"steps_done": 0}
    # Without the trailing slash the page's relative plot names would miss: redirected to it.
    r = api.get(page.rstrip("/"), headers=viewer, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "report/"

    # Nothing outside the report's directory, however spelled.
    for name in ("..%2Fsecret.json", "%2E%2E%2Fsecret.json", "leak.json", "notes.txt", "plots%2Fx.png"):
        r = api.get(page + name, headers=viewer)
        assert r.status_code == 404, (name, r.status_code)
        assert "s3cret" not in r.text
    assert api.get(page + "../../secret.json", headers=viewer).status_code == 404

    # A run without a report: 404 with the reason, for the UI's view.
    r = api.get(report_path(DAG_ID, "no_such_run"), headers=viewer)
    assert r.status_code == 404 and "has no report" in r.text and "Restart budget" not in r.text
    # A run still training, restarted after a lost node: its page shows the restart budget so far.
    from verl_pipeline.airflow.task_ids import RESTART_BUDGET_KEY, WAIT_TASK
    from verl_pipeline.jobs.restart_budget import AttemptProgress, RestartBudget, RestartOutcome
    from verl_pipeline.restarts import RestartPolicy

    running = api_server.dag_run(tmp_path, "vp_report_app_running", WAIT_TASK)
    decided = RestartBudget(RestartPolicy(), (AttemptProgress(1, "j-a1", 0, 4, 5),))
    api_server.set_xcom("vp_report_app_running", running, WAIT_TASK, RESTART_BUDGET_KEY,
                        decided.record(outcome=RestartOutcome.RESTART, reason="node died"))
    r = api.get(report_path("vp_report_app_running", running), headers=viewer)
    assert r.status_code == 404 and "has no report" in r.text
    assert ("Restart budget, as last decided after attempt 1 (node died): attempt 1 moved the checkpoint from step "
            "0 to 4; 2 of 2 restarts without progress left") in r.text


def test_run_report_button_points_at_the_page_once_there_is_a_report(report_run: Any) -> None:
    from airflow.configuration import conf
    from airflow.models.taskinstancekey import TaskInstanceKey

    from verl_pipeline.airflow.task_ids import WAIT_TASK

    run_id, _ = report_run
    link = RunReportLink()
    base_url = conf.get("api", "base_url", fallback="")
    assert link.get_link(None, ti_key=TaskInstanceKey(DAG_ID, WAIT_TASK, run_id)) == report_url(
        DAG_ID, run_id, base_url=base_url)
    assert link.get_link(None, ti_key=TaskInstanceKey(DAG_ID, WAIT_TASK, "no_such_run")) == ""
