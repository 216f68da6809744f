"""The Airflow UI in a real browser (Debian's Chromium driven by Playwright, no downloaded browser).

Logs in, opens ``verl_ppo``'s trigger form, checks the Params and their descriptions, changes one,
triggers, and follows the run to its end. Beside it a training run (the stand-in trainer) is held at
a step while its wait task's "Ray job" button opens the job's page of the run's token-auth Ray
dashboard through Airflow's proxy: the job shown, no token prompt, the token nowhere the browser keeps
anything, a user who may not read the run refused. Then the run reports: the run's "Run report" tab,
and the "Run report" button of the training run's wait task opening its report; the report's and the
dashboard's addresses from a fresh browser without a session are refused. Screenshots go to
test-artifacts/ (the report's and the proxied job page's also to docs/images/).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.integration import secret_canary
from tests.integration.airflow_stack import (
    ADMIN_USER,
    OUTSIDER_USER,
    STACK_TRAIN_PROFILE,
    AirflowStack,
    run_task_states,
    run_xcom,
)
from verl_pipeline.airflow.links import job_link
from verl_pipeline.airflow.params import build_params
from verl_pipeline.airflow.report_app import dashboard_url, report_path
from verl_pipeline.airflow.task_ids import PROVISION_TASK, REPORT_TASK, SUBMIT_TASK, WAIT_TASK

# Above the sum of the waits below; pytest-timeout also counts the session's Airflow stack start.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(2400)]

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
#: docs/reports.md's picture of a run report (refreshed by every run of this test).
README_REPORT_PICTURE = REPO / "docs" / "images" / "run-report.png"
#: docs/reports.md's picture of the "Ray job" button's page (the job page of the proxied dashboard).
RAY_JOB_PICTURE = REPO / "docs" / "images" / "ray-job-proxied.png"
#: What Ray's dashboard shows when it wants a token (it must never show up through the proxy).
TOKEN_PROMPT = "Authentication Token Required"
DAG = "verl_ppo"
# A verl key preflight composes and checks, harmless for the run.
OVERRIDE = "actor_rollout_ref.actor.optim.lr=2e-6"
# How the drop-downs model_profile / cluster_profile label their empty choice.
DEFAULT_CHOICE = "(the run profile's)"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    msg = "Chromium not installed (apt-get install -y chromium chromium-driver)"
    if os.environ.get("CI"):
        pytest.fail(f"CI: {msg}")
    pytest.skip(msg)


@pytest.fixture
def browser(airflow_stack: AirflowStack) -> Iterator[tuple[Any, str]]:
    """Playwright and Debian's Chromium binary."""
    executable = _chromium()
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as p:
        yield p, executable


@pytest.fixture
def page(browser: tuple[Any, str]) -> Iterator[Any]:
    p, executable = browser
    profile_dir = tempfile.mkdtemp(prefix="vp-chromium-")
    ctx = p.chromium.launch_persistent_context(
        profile_dir, executable_path=executable, headless=True, args=CHROMIUM_ARGS,
        viewport={"width": 1400, "height": 1000}, timeout=180_000,  # a cold start on a busy machine
    )
    ctx.set_default_timeout(60_000)
    try:
        yield ctx.new_page()
    finally:
        ctx.close()
        shutil.rmtree(profile_dir, ignore_errors=True)


def _label(dialog: Any, name: str) -> str:
    """The form's label of one Param: its name, then " *" when the form marks it required."""
    label = dialog.locator("label").filter(has_text=re.compile(rf"^\s*{re.escape(name)}\b"))
    return " ".join(label.first.inner_text().split())


def test_trigger_form_shows_params_and_starts_a_run(airflow_stack: AirflowStack, page: Any,
                                                    browser: tuple[Any, str], canaries: dict[str, str]) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    api = airflow_stack.client()
    airflow_stack.wait_for_dag(api, DAG)
    api.patch(f"/api/v2/dags/{DAG}", json={"is_paused": False}).raise_for_status()
    before = {r["dag_run_id"] for r in api.get(f"/api/v2/dags/{DAG}/dagRuns").json()["dag_runs"]}
    # A short training run (the stand-in trainer) beside the form's preflight run, held at a step (gate
    # closed) until its "Ray job" button was checked; its report has plots by the time the form's run is
    # followed to its end.
    airflow_stack.close_gate()
    r = api.post(f"/api/v2/dags/{DAG}/dagRuns",
                 json={"logical_date": None, "conf": {"profile": STACK_TRAIN_PROFILE}})
    assert r.status_code == 200, r.text
    train_run_id = r.json()["dag_run_id"]

    # Log in (SimpleAuthManager's form) and land on the DAG's page.
    page.goto(f"{airflow_stack.base_url}/dags/{DAG}")
    page.get_by_label("Username").fill(ADMIN_USER)
    page.get_by_label("Password").fill(airflow_stack.password)
    page.get_by_role("button", name="Sign in").click()
    page.wait_for_url(f"**/dags/{DAG}**")

    # The trigger form: every Param with its description.
    page.get_by_role("button", name="Trigger").first.click()
    dialog = page.get_by_role("dialog")
    dialog.get_by_text("Run Parameters").wait_for()
    text = dialog.inner_text()
    for name, param in build_params().items():
        assert name in text, f"param {name} missing from the trigger form"
        assert param.description and param.description in " ".join(text.split()), f"{name}: no description"

    # The drop-downs label their empty choice (values_display), never "null"; only `profile` is required.
    words = text.split()
    assert "null" not in words, text
    assert DEFAULT_CHOICE in text, text
    for field in dialog.locator("input, textarea").all():
        assert field.input_value() != "null", field.get_attribute("name")
    assert _label(dialog, "profile").endswith("*")  # the marker this test looks for
    assert "*" not in _label(dialog, "verl_overrides")

    # Change two params (one a verl override, cheap and valid in preflight) and trigger.
    steps = dialog.locator("input[name=element_total_training_steps]")
    steps.fill("4")
    assert steps.input_value() == "4"
    overrides = dialog.locator("textarea[name=element_verl_overrides]")
    overrides.fill(OVERRIDE)
    assert overrides.input_value() == OVERRIDE
    page.screenshot(path=str(ARTIFACTS / "ui-trigger-form.png"), full_page=True)
    dialog.get_by_role("button", name="Trigger").click()

    # The UI navigates to the new run; it is the one we asked for (conf from the form).
    page.wait_for_url(f"**/dags/{DAG}/runs/**")
    run_id = page.url.rsplit("/runs/", 1)[1].split("?")[0]
    from urllib.parse import unquote

    run_id = unquote(run_id)
    assert run_id not in before
    run = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}").json()
    assert run["conf"]["total_training_steps"] == 4 and run["conf"]["profile"] == "smoke", run["conf"]
    assert run["conf"]["verl_overrides"] == [OVERRIDE] and run["conf"]["model_profile"] is None, run["conf"]
    page.get_by_text(run_id).first.wait_for()

    # While the form's run runs: the training run's "Ray job" button, its job held at the gate.
    t0 = time.monotonic()
    try:
        airflow_stack.wait_held_at_gate(api, train_run_id)
        t1 = time.monotonic()
        _check_ray_job_button(airflow_stack, page, run_id=train_run_id, secrets={**canaries})
    finally:
        airflow_stack.open_gate()
    print(f"training run held at the gate after {t1 - t0:.1f} s more; Ray job button checks: "
          f"{time.monotonic() - t1:.1f} s")

    # Follow it to the end in the UI: the run page shows the final state.
    from urllib.parse import quote

    page.goto(f"{airflow_stack.base_url}/dags/{DAG}/runs/{quote(run_id, safe='')}")
    run = airflow_stack.wait_for_run(api, DAG, run_id, timeout_s=600)
    failed = [t for t, state in run_task_states(api, run_id).items() if state == "failed"]
    assert run["state"] == "success", (f"{run_id} {run['state']}: {run_task_states(api, run_id)}\n"
                                       + "\n".join(airflow_stack.task_log_tail(run_id, t) for t in failed))
    deadline = time.monotonic() + 60
    while True:
        page.reload()
        page.get_by_text(run_id).first.wait_for()
        if page.get_by_text("Success", exact=False).count() > 0:
            break
        assert time.monotonic() < deadline, "the run page never showed the run's success"
        time.sleep(2)
    page.screenshot(path=str(ARTIFACTS / "ui-finished-run.png"), full_page=True)
    assert (ARTIFACTS / "ui-trigger-form.png").stat().st_size > 10_000
    assert (ARTIFACTS / "ui-finished-run.png").stat().st_size > 10_000

    t0 = time.monotonic()
    try:
        _wait_for_report(api, train_run_id, timeout_s=600)
    finally:
        airflow_stack.close_gate()
    _check_run_reports(airflow_stack, page, browser, run_id=run_id, train_run_id=train_run_id)
    print(f"run report checks: {time.monotonic() - t0:.1f} s")


def _task_state(api: Any, run_id: str, task_id: str) -> str | None:
    from urllib.parse import quote

    r = api.get(f"/api/v2/dags/{DAG}/dagRuns/{quote(run_id, safe='')}/taskInstances/{task_id}")
    return r.json().get("state") if r.status_code == 200 else None


def _wait_for_report(api: Any, run_id: str, timeout_s: float) -> None:
    """Until the run's training succeeded and its report task wrote the report (the tasks after it,
    such as the model export, do not matter here)."""
    deadline = time.monotonic() + timeout_s
    while (report := _task_state(api, run_id, REPORT_TASK)) not in ("success", "failed", "upstream_failed"):
        assert time.monotonic() < deadline, f"run {run_id}: {REPORT_TASK} still {report} after {timeout_s}s"
        time.sleep(2)
    assert (report, _task_state(api, run_id, WAIT_TASK)) == ("success", "success"), run_id


def _check_ray_job_button(stack: AirflowStack, page: Any, *, run_id: str, secrets: dict[str, str]) -> None:
    """The wait task's "Ray job" button opens the job's page of the run's token-auth dashboard, proxied by
    the API server: the job shown, running, and no token prompt. The cluster's token (and every canary)
    is in no address the browser asked for, no answer it got, nothing it stores, no log of the stack; a
    user who may not read the run is refused the same addresses."""
    from urllib.parse import quote

    api = stack.client()
    cluster = run_xcom(api, run_id, PROVISION_TASK)
    job_id = run_xcom(api, run_id, SUBMIT_TASK)["submission_id"]
    token = secret_canary.ray_token(cluster)
    assert cluster["auth_mode"] == "token" and token, cluster
    secrets = {**secrets, "ray token": token}
    url = job_link(DAG, run_id, job_id, base_url=stack.base_url)
    dashboard = url.split("#", 1)[0]

    page.goto(f"{stack.base_url}/dags/{DAG}/runs/{quote(run_id, safe='')}/tasks/{WAIT_TASK}/details")
    button = page.get_by_role("link", name="Ray job")
    button.wait_for()
    assert button.get_attribute("href") == url
    answers: list[Any] = []

    def answered(response: Any) -> None:
        answers.append(response)

    page.on("response", answered)
    page.set_viewport_size({"width": 1280, "height": 800})
    try:
        button.click()
        page.wait_for_url(url)
        # The job's page: its submission id and state, and its driver log (the stand-in's step lines).
        page.get_by_text(job_id).first.wait_for()
        page.get_by_text("RUNNING", exact=True).first.wait_for()
        page.get_by_text("training/global_step:1", exact=False).first.wait_for()
        assert page.get_by_text(TOKEN_PROMPT).count() == 0
        page.screenshot(path=str(ARTIFACTS / "ui-ray-job-proxied.png"))
    finally:
        page.remove_listener("response", answered)
        page.set_viewport_size({"width": 1400, "height": 1000})
    RAY_JOB_PICTURE.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ARTIFACTS / "ui-ray-job-proxied.png", RAY_JOB_PICTURE)

    # Everything the page asked for went through the proxy and was answered (no 401/403: the dashboard
    # shows its token prompt on either); nothing went to the cluster's own address.
    proxied = [a for a in answers if a.url.startswith(dashboard)]
    assert any(a.url.endswith("/api/jobs/" + job_id) for a in proxied), [a.url for a in answers]
    assert not [a.url for a in answers if a.url.startswith(cluster["dashboard_url"])]
    assert not [(a.url, a.status) for a in proxied if a.status in (401, 403)]
    # The token in no address, no answer (its body as the browser got it), nothing the browser keeps.
    leaks = [leak for a in answers for leak in secret_canary.scan_text(a.url, secrets, "an address the page asked for")]
    for a in proxied:
        body = a.body() if a.status < 300 else b""
        leaks += secret_canary.scan_text(body.decode("utf-8", "replace") + json.dumps(a.all_headers()), secrets,
                                         f"the proxy's answer to {a.url}")
    stored = json.dumps(page.context.storage_state(indexed_db=True)) + page.evaluate(
        "JSON.stringify(sessionStorage) + JSON.stringify(localStorage) + document.cookie")
    leaks += secret_canary.scan_text(stored, secrets, "the browser's cookies and storage")
    assert "ray-authentication-token" not in stored
    leaks += secret_canary.scan_files(secret_canary.stack_log_dirs(stack), secrets)
    assert leaks == [], [str(leak) for leak in leaks]

    # Who may: a user without read access to the run is refused the page and what it loads (403).
    outsider = {"Authorization": f"Bearer {stack.token(OUTSIDER_USER)}"}
    for address in (dashboard, dashboard + "api/jobs/", dashboard + f"api/jobs/{job_id}"):
        r = httpx.get(address, headers=outsider, timeout=60)
        assert r.status_code == 403 and token not in r.text, (address, r.status_code, r.text[:200])
    r = httpx.get(f"{stack.base_url}/api/v2/dags/{DAG}/dagRuns/{quote(run_id, safe='')}", headers=outsider, timeout=60)
    assert r.status_code == 403, r.text  # the same user may not read the run in Airflow either


def _check_run_reports(stack: AirflowStack, page: Any, browser: tuple[Any, str], *, run_id: str,
                       train_run_id: str) -> None:
    """The form's run shows its report in its "Run report" tab; the training run's wait task has a
    "Run report" button (beside "Ray job") that opens the report with its plots; without a session the
    same addresses are refused."""
    from urllib.parse import quote

    # The DAG run's tab: the report page of the (preflight) run in the UI's frame.
    page.goto(f"{stack.base_url}/dags/{DAG}/runs/{quote(run_id, safe='')}")
    page.get_by_text("Run report", exact=True).first.click()
    iframe = page.locator("iframe[title='Run report']")
    iframe.wait_for()
    assert iframe.get_attribute("src") == report_path(DAG, run_id).lstrip("/"), iframe.get_attribute("src")
    page.frame_locator("iframe[title='Run report']").get_by_role(
        "heading", name=re.compile(r"^Run report")).wait_for()
    page.screenshot(path=str(ARTIFACTS / "ui-run-report-tab.png"), full_page=True)

    # The training run's wait task (its Details tab lists the task's buttons): "Ray job" and "Run
    # report", which opens the report in the UI's window.
    page.goto(f"{stack.base_url}/dags/{DAG}/runs/{quote(train_run_id, safe='')}/tasks/{WAIT_TASK}/details")
    report_link = page.get_by_role("link", name="Run report")
    report_link.wait_for()
    assert page.get_by_role("link", name="Ray job").count() == 1
    url = stack.base_url + report_path(DAG, train_run_id)
    assert report_link.get_attribute("href") == url
    report_link.click()
    page.wait_for_url(url)
    page.get_by_role("heading", name=re.compile(r"^Run report")).wait_for()
    images = page.locator("img")
    assert images.count() >= 3, page.content()[:2000]  # reward, response length, throughput, timing
    page.wait_for_function("Array.from(document.images).every(i => i.complete && i.naturalWidth > 0)")
    plot = images.first.get_attribute("src")
    page.screenshot(path=str(ARTIFACTS / "ui-run-report.png"), full_page=True)
    assert (ARTIFACTS / "ui-run-report.png").stat().st_size > 20_000
    README_REPORT_PICTURE.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(ARTIFACTS / "ui-run-report.png", README_REPORT_PICTURE)

    # A fresh browser, no session: the page and its plot are refused.
    p, executable = browser
    fresh = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS, timeout=180_000)
    try:
        anonymous = fresh.new_context()
        response = anonymous.new_page().goto(url)
        assert response is not None and response.status == 401, response and response.status
        assert anonymous.request.get(url + str(plot)).status == 401
        # The "Ray job" button's address, and what its page loads: refused before any cluster is asked.
        dashboard = stack.base_url + dashboard_url(DAG, train_run_id, base_url="")
        response = anonymous.new_page().goto(dashboard)
        assert response is not None and response.status == 401, response and response.status
        assert anonymous.request.get(dashboard + "api/jobs/").status == 401
    finally:
        fresh.close()
