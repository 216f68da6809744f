"""The run's Ray dashboard through Airflow: what the proxy forwards either way (pure), and the proxy inside
Airflow's API server machinery (the repo's plugin, the simple auth manager's JWTs, a DAG run whose
provision XCom names a run directory) in front of the session's real token-auth Ray cluster."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.airflow import api_server
from tests.airflow.api_server import jwt
from tests.integration.secret_canary import ray_token, scan_text
from verl_pipeline.airflow.dashboard_proxy import (
    SECURITY_HEADERS,
    DashboardUnavailable,
    forwarded_request_headers,
    forwarded_response_headers,
    proxied_location,
    run_dir_from_xcom,
    upstream_path,
)
from verl_pipeline.airflow.report_app import dashboard_url
from verl_pipeline.airflow.task_ids import PROVISION_TASK, RUN_DIR_KEY
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.rundir import RunDir

DAG_ID = "vp_dashboard_proxy_test"


# -- pure ---------------------------------------------------------------------------------------------

def test_paths_are_forwarded_below_the_dashboard_and_profilers_are_refused() -> None:
    for path, upstream in [("", "/"), ("static/js/main.84605326.js", "/static/js/main.84605326.js"),
                           ("api/jobs/", "/api/jobs/"), ("api/jobs/verl-x-a1/logs", "/api/jobs/verl-x-a1/logs"),
                           ("worker/traceback", "/worker/traceback"), ("api/v0/logs/file", "/api/v0/logs/file"),
                           ("logs/a b.log", "/logs/a%20b.log"), ("x%41", "/x%2541")]:
        assert upstream_path(path) == upstream, path
    refused = ["../api/jobs/", "api/../../x", "./api", "a/./b", "/etc/passwd", "a\\b", "a\x00",
               "memory_profile", "worker/cpu_profile", "worker//cpu_profile", "worker/gpu_profile",
               "worker/jax_profile", "task/cpu_profile", "api/packages/gcs/_ray_pkg_x.zip"]
    for path in refused:
        with pytest.raises(DashboardUnavailable) as e:
            upstream_path(path)
        assert e.value.status == 403, path


def test_only_content_headers_cross_the_proxy() -> None:
    browser = {"Accept": "application/json", "Accept-Encoding": "gzip", "Range": "bytes=0-9",
               "Cookie": "_token=airflow-jwt; ray-authentication-token=t", "Authorization": "Bearer airflow-jwt",
               "X-Ray-Authorization": "Bearer t", "Host": "airflow:8080", "User-Agent": "Chromium",
               "If-None-Match": '"e"'}
    assert forwarded_request_headers(browser) == {"Accept": "application/json", "Accept-Encoding": "gzip",
                                                  "Range": "bytes=0-9", "If-None-Match": '"e"'}
    ray = {"Content-Type": "application/json", "Content-Length": "2", "Set-Cookie": "ray-authentication-token=t",
           "Server": "aiohttp", "Cache-Control": "max-age=31536000", "ETag": '"e"'}
    out = forwarded_response_headers(ray, "api/jobs/")
    assert out == {"content-type": "application/json", "content-length": "2", "etag": '"e"',
                   "cache-control": "private, no-store", **SECURITY_HEADERS}
    assert forwarded_response_headers(ray, "static/js/main.js")["cache-control"] == "private, max-age=86400"
    assert "script-src 'self'" in SECURITY_HEADERS["Content-Security-Policy"]


def test_redirects_stay_under_the_proxy() -> None:
    base = "/verl-pipeline/runs/d/r/dashboard/"
    kw = {"dashboard_url": "http://127.0.0.1:8265", "base_path": base}
    assert proxied_location("/api/jobs/", **kw) == base + "api/jobs/"
    assert proxied_location("http://127.0.0.1:8265/#/jobs", **kw) == base + "#/jobs"
    assert proxied_location("jobs/", **kw) == "jobs/"
    assert proxied_location("http://elsewhere/x", **kw) is None
    assert proxied_location("//elsewhere/x", **kw) is None


def test_run_dir_is_read_from_the_provision_xcom() -> None:
    assert run_dir_from_xcom('"/data/runs/r1"') == Path("/data/runs/r1")
    assert run_dir_from_xcom("/data/runs/r1") == Path("/data/runs/r1")
    for bad in (None, "runs/r1", '"runs/r1"', {"run_dir": "/x"}, "[1]"):
        with pytest.raises(DashboardUnavailable):
            run_dir_from_xcom(bad)


# -- inside Airflow's API server app, in front of a real token-auth cluster ---------------------------------

@pytest.fixture
def job(ray_cluster: ClusterHandle) -> str:
    """A finished job on the session's cluster, with a line of its own in its log."""
    client = ray_cluster.client()
    sub_id = client.submit(entrypoint="echo proxied-job-says-hi", runtime_env={},
                           submission_id=f"proxy-{os.getpid()}-{time.monotonic_ns()}")
    deadline = time.monotonic() + 120
    while not ((info := client.get_job(sub_id)) and info.status.is_terminal()):
        assert time.monotonic() < deadline, f"job {sub_id} did not finish: {info}"
        time.sleep(0.5)
    return sub_id


@pytest.fixture
def proxied_run(airflow_db: Path, tmp_path: Path, ray_cluster: ClusterHandle) -> tuple[str, RunDir]:
    """A DAG run whose provision XCom names a run directory recording the session's cluster."""
    run_id = api_server.dag_run(tmp_path, DAG_ID, PROVISION_TASK)
    run_dir = RunDir(tmp_path / "runs" / "r1")
    run_dir.path.mkdir(parents=True)
    run_dir.save_cluster(ray_cluster.to_dict())
    api_server.set_xcom(DAG_ID, run_id, PROVISION_TASK, RUN_DIR_KEY, str(run_dir.path))
    return run_id, run_dir


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch, proxied_run: Any) -> Iterator[Any]:
    # What the API server's entry module (airflow.api_fastapi.main) sets: the task SDK's connection look-up
    # then reads the metadata DB, as in the API server.
    monkeypatch.setenv("_AIRFLOW_PROCESS_CONTEXT", "server")
    with api_server.repo_plugins(monkeypatch), api_server.served_plugins() as client:
        yield client


@pytest.mark.integration
def test_the_dashboard_is_served_to_readers_of_the_run_with_the_token_added_by_the_server(
        api: Any, proxied_run: tuple[str, RunDir], ray_cluster: ClusterHandle, job: str, tmp_path: Path) -> None:
    run_id, run_dir = proxied_run
    root = dashboard_url(DAG_ID, run_id, base_url="")
    viewer = {"Authorization": f"Bearer {jwt('viewer')}"}
    token = ray_token(ray_cluster.to_dict())
    assert token and ray_cluster.auth_mode == "token"
    seen: list[Any] = []

    def get(path: str, **kw: Any) -> Any:
        r = api.get(root + path, **kw)
        seen.append(r)
        return r

    # Refused: no credential; a user without a role (who may read no DAG run); before the cluster is asked.
    assert get("").status_code == 401
    assert get("api/jobs/").status_code == 401
    nobody = {"Authorization": f"Bearer {jwt(None)}"}
    assert get("").status_code == 401 and get("", headers=nobody).status_code == 403
    assert get("api/jobs/", headers=nobody).status_code == 403

    # The app: its page and what the page loads, relative to it, the token added by the server.
    r = get("", headers=viewer)
    assert r.status_code == 200 and "<title>Ray Dashboard</title>" in r.text, r.text[:300]
    assert r.headers["cache-control"] == "private, no-store" and "set-cookie" not in r.headers
    script = r.text.split('<script defer="defer" src="./', 1)[1].split('"', 1)[0]
    r = get(script, headers=viewer)
    assert r.status_code == 200 and "javascript" in r.headers["content-type"] and len(r.content) > 100_000
    assert r.headers["cache-control"] == "private, max-age=86400"
    assert api.head(root + script, headers=viewer).status_code == 200
    # The UI's session cookie works as well as a bearer JWT; the cookie does not reach Ray.
    api.cookies.set("_token", jwt("viewer"))
    r = get("api/jobs/")
    api.cookies.clear()
    assert r.status_code == 200 and job in {j["submission_id"] for j in r.json()}, r.text[:500]
    info = get(f"api/jobs/{job}", headers=viewer).json()
    assert info["status"] == "SUCCEEDED"
    assert "proxied-job-says-hi" in get(f"api/jobs/{job}/logs", headers=viewer).json()["logs"]
    # The job page's log view reads the driver's log file through the state API, as the page asks for it.
    r = get(f"api/v0/logs/file?node_id={info['driver_node_id']}&filename=job-driver-{job}.log&lines=50000"
            "&filter_ansi_code=true", headers=viewer)
    assert r.status_code == 200 and "proxied-job-says-hi" in r.text, r.text[:300]
    # Ray's auth mode answers as it is (token): no cookie of Ray's reaches the browser.
    r = get("api/authentication_mode", headers=viewer)
    assert r.json() == {"authentication_mode": "token"} and "set-cookie" not in r.headers
    # Without the slash the page's relative requests would miss: redirected to it.
    r = api.get(root.rstrip("/"), headers=viewer, follow_redirects=False)
    assert r.status_code == 307 and r.headers["location"] == "dashboard/"

    # Read-only: no other method, no profiler.
    assert api.post(root + "api/jobs/", headers=viewer, json={"entrypoint": "id"}).status_code == 405
    assert api.delete(root + f"api/jobs/{job}", headers=viewer).status_code == 405
    r = get("worker/cpu_profile?pid=1&ip=127.0.0.1", headers=viewer)
    assert r.status_code == 403 and "read-only" in r.text

    # The token is in no answer: bodies, headers (the JS bundle included).
    leaks = [leak for r in seen for leak in scan_text(
        r.text + json.dumps(dict(r.headers)), {"ray token": token}, str(r.request.url))]
    assert leaks == [], leaks

    # A cluster reached through an Airflow connection (the address backend): its password is the token,
    # read by the API server from the metadata DB as the wait task's hook reads it.
    from airflow.models.connection import Connection
    from airflow.utils.session import create_session

    conn_id = f"ray_proxy_test_{time.monotonic_ns()}"
    with create_session() as session:
        session.add(Connection(conn_id=conn_id, conn_type="http", host="127.0.0.1", password=token))
    run_dir.save_cluster({**ray_cluster.to_dict(), "token_file": None, "conn_id": conn_id})
    r = get("api/jobs/", headers=viewer)
    assert r.status_code == 200 and job in {j["submission_id"] for j in r.json()}, r.text[:300]
    run_dir.save_cluster({**ray_cluster.to_dict(), "token_file": None, "conn_id": conn_id + "_missing"})
    r = get("api/jobs/", headers=viewer)
    assert r.status_code == 502 and "no credentials" in r.text and conn_id in r.text, r.text

    # A cluster that refuses the pipeline's token: a 502 that says so (a 401 would raise Ray's token prompt).
    wrong = tmp_path / "wrong.auth" / "ray_auth_token"
    wrong.parent.mkdir(mode=0o700)
    wrong.write_text("0" * 64)
    wrong.chmod(0o600)
    run_dir.save_cluster({**ray_cluster.to_dict(), "token_file": str(wrong)})
    r = get("api/jobs/", headers=viewer)
    assert r.status_code == 502 and "refused the credentials" in r.text, r.text
    # A cluster that does not answer.
    run_dir.save_cluster({**ray_cluster.to_dict(), "dashboard_url": "http://127.0.0.1:9"})
    r = get("api/jobs/", headers=viewer)
    assert r.status_code == 502 and "does not answer" in r.text, r.text
    # Torn down: the record retired, nothing to proxy.
    run_dir.retire_cluster()
    r = get("api/jobs/", headers=viewer)
    assert r.status_code == 404 and "no live cluster" in r.text, r.text
    # A run that has not provisioned (no such run here).
    r = api.get(dashboard_url(DAG_ID, "no_such_run", base_url=""), headers=viewer)
    assert r.status_code == 404 and "has no cluster yet" in r.text, r.text
