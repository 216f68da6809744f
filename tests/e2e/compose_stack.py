"""The docker-compose stack built, started and used end to end, faults included, with the time of each step.

Usage: .venv/bin/python tests/e2e/compose_stack.py [--gpu] [--wheels DIR] [--no-faults] [--no-celery]
                                                    [--reuse-images] [--screenshots DIR]
       (``make stack-e2e STACK_ARGS="..."``; needs a Docker engine, Compose v2 (``make compose-plugin``),
       the base images (python:3.11-slim, postgres:16, redis:7.4; ``../shared/docker/standin-images.sh`` where
       no registry is reachable), and Debian's Chromium + the playwright package for the browser step)

In order, from a clean state (this script's own compose project, env files and configs directory under
``.work/stack/``; the user's ``.env`` and stack are never touched):
 1. a missing ``.env`` value: compose refuses it in one line, nothing is created;
 2. cold build (the project's images removed first), then a warm build (nothing changed);
 3. a wrong ``.env`` value: env-check refuses it in one line, nothing else starts;
 4. ``up``: every service healthy (timed); security as deployed: ports on 127.0.0.1 only, no
    process running as root, Ray refusing a request without the token, the token in no image, no
    image history and (after the runs) no log;
 5. ``verl_ppo`` triggered through the stack's Airflow REST API with its auth, profile ``compose``:
    the run reaches success on the stack's Ray head + worker (CPU way: preflight);
 6. the run's report and its proxied Ray dashboard opened through the Airflow UI in headless Chromium
    (screenshots compose-run-report.png, compose-ray-dashboard.png in --screenshots, by default
    .work/stack/screenshots; ``--screenshots docs/images`` replaces the published ones);
 7. faults (a training-like job from the stand-in trainer tests/fakes/fake_verl_trainer.py, which the
    Ray images carry, held at a step by a gate file on the shared volume): the Ray worker container
    killed mid-run (its init process SIGKILLed, as an OOM kill or a crash does; Docker restarts it) ->
    the run resumes from its checkpoint; the scheduler and the triggerer restarted mid-wait -> the
    deferred wait survives (one attempt); PostgreSQL stopped -> the API server's health check fails
    until it is back; PostgreSQL killed mid-run -> Docker restarts it, the run succeeds (one attempt);
    ``down`` then ``up`` without ``-v`` -> run history, checkpoints and reports kept;
 8. the Celery way (second pass, on the same volumes): ``.env`` switched to CeleryExecutor + the celery
    profile, ``up -d`` -> redis and airflow-worker healthy; a run whose every task runs on the worker;
    Redis killed mid-run -> Docker restarts it, the run succeeds through it; ``.env`` switched back,
    ``up -d`` + ``rm -sfv redis airflow-worker`` -> neither left, the scheduler runs tasks again;
 9. ``down -v``: no container, volume or network of the project left.
The timings are printed as a table and written to .work/stack/timings.json.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "include"), str(REPO / "bench")]

from verl_pipeline.airflow.dashboard_proxy import run_dir_from_xcom  # noqa: E402
from verl_pipeline.airflow.links import job_link  # noqa: E402
from verl_pipeline.airflow.report_app import report_path  # noqa: E402
from verl_pipeline.airflow.task_ids import PROVISION_TASK, RUN_DIR_KEY, SUBMIT_TASK, WAIT_TASK  # noqa: E402
from verl_pipeline.report.write import REPORT_HTML  # noqa: E402
from verl_pipeline.rundir import RunDir  # noqa: E402
from verl_pipeline.spec import RunSpec  # noqa: E402

WORK = REPO / ".work" / "stack"
PROJECT = "verl-pipeline-e2e"
DAG = "verl_ppo"
ADMIN = "admin"
PROFILE = "compose"
#: The fault runs' profile (written into this script's configs copy, never into configs/).
FAULT_PROFILE = "compose-faults"
FAKE_TRAINER = "/opt/verl-pipeline/tests/fakes/fake_verl_trainer.py"
GATE = "/shared/runs/.compose-e2e-gate"
FAULT_STEPS, SAVE_FREQ, GATE_AFTER_STEP = 6, 2, 3
#: The screenshots, written to --screenshots (default .work/stack/screenshots; docs/images holds the published ones).
IMAGES = ("compose-run-report.png", "compose-ray-dashboard.png")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage"]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(what: str, check: Callable[[], Any], timeout_s: float, poll_s: float = 2.0) -> Any:
    """``check()``'s first truthy value, polled until ``timeout_s``; TimeoutError naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not after {timeout_s:.0f} s")
        time.sleep(poll_s)


# -- the env file and the configs this script's project uses ---------------------------------------
def new_secrets() -> dict[str, str]:
    return {
        "POSTGRES_PASSWORD": secrets.token_hex(24),
        "AIRFLOW_ADMIN_PASSWORD": secrets.token_urlsafe(18),
        "AIRFLOW_FERNET_KEY": base64.urlsafe_b64encode(os.urandom(32)).decode(),
        "AIRFLOW_JWT_SECRET": secrets.token_hex(32),
        "AIRFLOW_API_SECRET_KEY": secrets.token_hex(32),
        "RAY_AUTH_TOKEN": secrets.token_hex(32),
    }


def write_env(path: Path, values: dict[str, str], *, drop: tuple[str, ...] = ()) -> None:
    """.env.example with ``values`` in place of its assignments (and ``drop``'s lines removed), mode 0600."""
    lines = []
    for line in (REPO / ".env.example").read_text().splitlines():
        m = re.match(r"([A-Z_][A-Z0-9_]*)=", line)
        if m and m.group(1) in drop:
            continue
        if m and m.group(1) in values:
            line = f"{m.group(1)}={values[m.group(1)]}"
        lines.append(line)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    path.chmod(0o600)


def write_configs(directory: Path) -> None:
    """A copy of configs/ plus the fault runs' profile: the stand-in trainer in train mode on the stack's
    cluster, holding after GATE_AFTER_STEP until the gate file exists."""
    shutil.rmtree(directory, ignore_errors=True)
    shutil.copytree(REPO / "configs", directory)
    profile = {
        "description": "compose stack faults: the stand-in trainer (tests/fakes) on the stack's Ray cluster",
        "model_profile": "tiny-ppo",
        "cluster_profile": PROFILE,
        "data": {"source": "builtin:arithmetic", "train_size": 32, "val_size": 8},
        "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": FAULT_STEPS},
        "mode": "train",
        "trainer_command": ["python", FAKE_TRAINER],
        "export": False,
        "verl": {"trainer": {"save_freq": SAVE_FREQ},
                 "+fake": {"step_seconds": 2, "gate_file": GATE, "gate_after_step": GATE_AFTER_STEP}},
    }
    (directory / "profiles" / f"{FAULT_PROFILE}.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))


# -- the compose project --------------------------------------------------------------------------
@dataclass
class Stack:
    env_file: Path
    files: tuple[str, ...]
    env: dict[str, str]
    screenshots: Path
    timings: dict[str, float] = field(default_factory=dict)

    def compose(self, *args: str, env_file: Path | None = None, check: bool = True,
                capture: bool = True, timeout: float = 3600) -> subprocess.CompletedProcess[str]:
        cmd = ["docker", "compose", "-p", PROJECT, "--project-directory", str(REPO),
               "--env-file", str(env_file or self.env_file)]
        for f in self.files:
            cmd += ["-f", str(REPO / f)]
        environ = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
        environ.update({"DOCKER_BUILDKIT": "0", "DOCKER_CONFIG": os.environ.get("DOCKER_CONFIG",
                                                                                str(REPO / ".work" / "docker"))})
        r = subprocess.run([*cmd, *args], capture_output=capture, text=True, env=environ, timeout=timeout)
        if check and r.returncode != 0:
            raise RuntimeError(f"docker compose {' '.join(args)}: rc={r.returncode}\n{r.stderr or ''}")
        return r

    def exec(self, service: str, *cmd: str, stdin: str | None = None) -> str:
        r = self.compose("exec", "-T", service, *cmd, check=False) if stdin is None else subprocess.run(
            ["docker", "exec", "-i", self.container(service), *cmd], input=stdin, capture_output=True, text=True)
        return r.stdout

    def services(self) -> list[dict[str, Any]]:
        out = self.compose("ps", "-a", "--format", "json").stdout
        rows = [json.loads(line) for line in out.splitlines() if line.strip().startswith("{")]
        if len(rows) == 1 and isinstance(rows[0], list):
            rows = rows[0]
        return rows

    def container(self, service: str) -> str:
        return next(r["Name"] for r in self.services() if r["Service"] == service)

    def unhealthy(self) -> list[str]:
        """Services not (yet) healthy: long-running ones without ``healthy``, one-shot ones not exited 0."""
        bad = []
        for r in self.services():
            if r["Service"] in ("env-check", "airflow-init"):
                if r["State"] != "exited" or int(r.get("ExitCode", 1)) != 0:
                    bad.append(f"{r['Service']}:{r['State']}")
            elif r.get("Health") != "healthy":
                bad.append(f"{r['Service']}:{r['State']}/{r.get('Health') or '-'}")
        return bad

    def wait_healthy(self, timeout_s: float = 900) -> None:
        wait_until("every service healthy", lambda: self.services() and not self.unhealthy(), timeout_s, 3)

    def project_leftovers(self) -> dict[str, list[str]]:
        label = f"label=com.docker.compose.project={PROJECT}"
        kinds = {"containers": ["ps", "-a"], "volumes": ["volume", "ls"], "networks": ["network", "ls"]}
        out = {}
        for kind, cmd in kinds.items():
            r = subprocess.run(["docker", *cmd, "-q", "--filter", label], capture_output=True, text=True)
            out[kind] = r.stdout.split()
        return out

    @contextmanager
    def timed(self, name: str) -> Iterator[None]:
        t0 = time.monotonic()
        yield
        self.timings[name] = round(time.monotonic() - t0, 1)
        log(f"{name}: {self.timings[name]} s")


# -- Airflow's REST API ----------------------------------------------------------------------------
def api_client(stack: Stack) -> httpx.Client:
    base = f"http://127.0.0.1:{stack.env['AIRFLOW_API_PORT']}"
    r = httpx.post(f"{base}/auth/token", json={"username": ADMIN, "password": stack.env["AIRFLOW_ADMIN_PASSWORD"]},
                   timeout=60)
    r.raise_for_status()
    return httpx.Client(base_url=base, headers={"Authorization": f"Bearer {r.json()['access_token']}"}, timeout=60)


def trigger(api: httpx.Client, profile: str) -> str:
    wait_until("verl_ppo parsed", lambda: api.get(f"/api/v2/dags/{DAG}").status_code == 200, 300)
    api.patch(f"/api/v2/dags/{DAG}", json={"is_paused": False}).raise_for_status()
    r = api.post(f"/api/v2/dags/{DAG}/dagRuns", json={"logical_date": None, "conf": {"profile": profile}})
    r.raise_for_status()
    return str(r.json()["dag_run_id"])


def task_states(api: httpx.Client, run_id: str) -> dict[str, str]:
    tis = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    return {t["task_id"]: t["state"] for t in tis}


def wait_run(api: httpx.Client, run_id: str, timeout_s: float = 1200) -> dict[str, Any]:
    def ended() -> dict[str, Any] | None:
        run = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}").json()
        return run if run.get("state") in ("success", "failed") else None

    run = wait_until(f"run {run_id} ended", ended, timeout_s, 3)
    if run["state"] != "success":
        raise RuntimeError(f"run {run_id} ended {run['state']}: {task_states(api, run_id)}")
    return dict(run)


def xcom(api: httpx.Client, run_id: str, task_id: str, key: str = "return_value") -> Any:
    r = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/{key}")
    return r.json()["value"] if r.status_code == 200 else None


def run_dir(api: httpx.Client, run_id: str) -> RunDir | None:
    """The run's directory on the shared volume, as its provision task recorded it (None before that)."""
    value = xcom(api, run_id, PROVISION_TASK, RUN_DIR_KEY)
    return RunDir(run_dir_from_xcom(value)) if value else None


# -- the steps -------------------------------------------------------------------------------------
#: The label every layer of the project's images carries (docker/*.Dockerfile, right after FROM).
IMAGE_LABEL = "io.verl-pipeline.image"


def clean_state(stack: Stack, *, remove_images: bool) -> None:
    """No container, volume or network of the project; with ``remove_images`` none of its images and no
    layer of their earlier builds either (the classic builder's cache), as on a machine that never built
    them; the base images stay (they come from a registry)."""
    stack.compose("down", "-v", "--remove-orphans", check=False)
    if remove_images:
        images = [stack.env[k] for k in ("AIRFLOW_IMAGE", "RAY_IMAGE", "RAY_CPU_IMAGE")]
        subprocess.run(["docker", "image", "rm", "-f", *images], capture_output=True, text=True)
        subprocess.run(["docker", "image", "prune", "-f", "--filter", f"label={IMAGE_LABEL}"], capture_output=True,
                       text=True, check=True)
        cached = subprocess.run(["docker", "images", "-a", "-q", "--filter", f"label={IMAGE_LABEL}"],
                                capture_output=True, text=True).stdout.split()
        assert not cached, f"layers of earlier builds are left: {cached}"
    left = stack.project_leftovers()
    assert not any(left.values()), f"not a clean state: {left}"


def refused_missing_value(stack: Stack) -> str:
    """An env file without RAY_AUTH_TOKEN: compose refuses it in one line and creates nothing."""
    bad = WORK / "missing.env"
    write_env(bad, stack.env, drop=("RAY_AUTH_TOKEN",))
    r = stack.compose("up", "-d", "--no-build", env_file=bad, check=False)
    line = next((ln for ln in r.stderr.splitlines() if "RAY_AUTH_TOKEN" in ln), r.stderr.strip())
    assert r.returncode != 0 and "required variable RAY_AUTH_TOKEN is missing a value" in line, r.stderr
    assert not any(stack.project_leftovers().values()), stack.project_leftovers()
    return line


def refused_wrong_value(stack: Stack) -> str:
    """RAY_AUTH_TOKEN left at the placeholder: env-check refuses it in one line, no other service starts."""
    bad = WORK / "wrong.env"
    write_env(bad, {**stack.env, "RAY_AUTH_TOKEN": "CHANGE_ME_ray_auth_token"})
    r = stack.compose("up", "-d", "--no-build", env_file=bad, check=False)
    try:
        assert r.returncode != 0, r.stdout + r.stderr
        started = [s["Service"] for s in stack.services() if s["Service"] != "env-check" and s["State"] != "created"]
        assert not started, f"started despite env-check: {started}"
        logs = stack.compose("logs", "--no-log-prefix", "env-check", env_file=bad).stdout.strip().splitlines()
        assert len(logs) == 1 and "RAY_AUTH_TOKEN" in logs[0], logs
        host = subprocess.run([sys.executable, str(REPO / "docker" / "check_env.py"), "--env-file", str(bad)],
                              capture_output=True, text=True)
        assert host.returncode == 1 and host.stderr.strip() == logs[0], (host.stderr, logs)
        return logs[0]
    finally:
        stack.compose("down", "-v", "--remove-orphans", env_file=bad)


def check_security(stack: Stack) -> list[str]:
    """What the deployment exposes: published ports, processes' users, Ray's auth, the token in images."""
    notes = []
    for svc in stack.services():
        for pub in svc.get("Publishers") or []:
            if pub.get("PublishedPort"):
                assert pub["URL"] == "127.0.0.1", f"{svc['Service']} publishes {pub}"
                notes.append(f"{svc['Service']}: 127.0.0.1:{pub['PublishedPort']} -> {pub['TargetPort']}")
    for svc in stack.services():
        if svc["State"] != "running":
            continue
        top = subprocess.run(["docker", "top", svc["Name"], "-eo", "pid,uid,args"], capture_output=True, text=True)
        rows = [ln.split(None, 2)[1:] for ln in top.stdout.splitlines()[1:] if ln.strip()]
        # Docker runs a health check as the image's user: root in postgres and redis, whose entrypoints drop
        # to their own user for the server itself. Such a check caught running is not the service.
        check = " ".join((json.loads(inspect(svc["Name"], "{{json .Config.Healthcheck.Test}}")) or [])[1:])
        root = [args for uid, args in rows if uid == "0" and not (check and args.removeprefix("/bin/sh -c ") in check)]
        assert rows and not root, f"{svc['Service']} runs as root: {root or top.stderr}"
        notes.append(f"{svc['Service']}: {len(rows)} processes, uids {sorted({uid for uid, _ in rows})}")
    dashboard = f"http://127.0.0.1:{stack.env['RAY_DASHBOARD_PORT']}/api/jobs/"
    anonymous = httpx.get(dashboard, timeout=30).status_code
    with_token = httpx.get(dashboard, headers={"Authorization": f"Bearer {stack.env['RAY_AUTH_TOKEN']}"},
                           timeout=30).status_code
    assert anonymous in (401, 403) and with_token == 200, (anonymous, with_token)
    notes.append(f"Ray Jobs API without the token: {anonymous}; with it: {with_token}")
    for image in {stack.env["AIRFLOW_IMAGE"], image_of(stack, "ray-head")}:
        text = subprocess.run(["docker", "image", "inspect", image], capture_output=True, text=True).stdout
        text += subprocess.run(["docker", "history", "--no-trunc", image], capture_output=True, text=True).stdout
        assert text and stack.env["RAY_AUTH_TOKEN"] not in text, f"the token is in image {image}"
    notes.append("the token in no image's configuration or history (docker image inspect, docker history)")
    return notes


def image_of(stack: Stack, service: str) -> str:
    return str(next(s["Image"] for s in stack.services() if s["Service"] == service))


def token_in_logs(stack: Stack) -> list[str]:
    """Where the Ray token shows in a log: compose's logs of every service, Airflow's task logs, Ray's logs."""
    token = stack.env["RAY_AUTH_TOKEN"]
    # The search itself works: it finds the token where it must be (the Ray head's environment).
    control = stack.exec("ray-head", "grep", "-lF", "-f", "/dev/stdin", "/proc/1/environ", stdin=token + "\n")
    assert control.strip() == "/proc/1/environ", f"the log search finds nothing, not even the control: {control!r}"
    found = []
    logs = stack.compose("logs", "--no-color").stdout
    if token in logs:
        found.append("docker compose logs")
    for service, directory in (("airflow-scheduler", "/opt/airflow/logs"), ("ray-head", "/tmp/ray"),
                               ("ray-worker", "/tmp/ray")):
        hits = stack.exec(service, "grep", "-rlF", "-f", "/dev/stdin", directory, stdin=token + "\n")
        found += [f"{service}:{path}" for path in hits.split()]
    return found


def preflight_run(stack: Stack, api: httpx.Client) -> str:
    """verl_ppo with profile `compose`, through the REST API: success, on the stack's Ray cluster."""
    run_id = trigger(api, PROFILE)
    wait_run(api, run_id)
    submitted = xcom(api, run_id, SUBMIT_TASK) or {}
    states = task_states(api, run_id)
    log(f"run {run_id}: {states}; job {submitted.get('submission_id')} ({submitted.get('mode')})")
    jobs = httpx.get(f"http://127.0.0.1:{stack.env['RAY_DASHBOARD_PORT']}/api/jobs/", timeout=30,
                     headers={"Authorization": f"Bearer {stack.env['RAY_AUTH_TOKEN']}"}).json()
    job = next(j for j in jobs if j.get("submission_id") == submitted.get("submission_id"))
    assert job["status"] == "SUCCEEDED", job
    return run_id


@contextmanager
def signed_in(stack: Stack) -> Iterator[Any]:
    """A page of headless Chromium (Debian's, driven by Playwright) signed in to the stack's Airflow UI."""
    import tempfile

    from playwright.sync_api import sync_playwright
    from report_png import chromium as find_chromium  # bench/ is on the path (above)

    chromium = find_chromium()
    base = f"http://127.0.0.1:{stack.env['AIRFLOW_API_PORT']}"
    profile_dir = tempfile.mkdtemp(prefix="vp-compose-chromium-")
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(profile_dir, executable_path=chromium, headless=True,
                                                   args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000},
                                                   timeout=180_000)
        ctx.set_default_timeout(120_000)
        try:
            page = ctx.new_page()
            page.goto(f"{base}/dags/{DAG}")
            page.get_by_label("Username").fill(ADMIN)
            page.get_by_label("Password").fill(stack.env["AIRFLOW_ADMIN_PASSWORD"])
            page.get_by_role("button", name="Sign in").click()
            page.wait_for_url(f"**/dags/{DAG}**")
            yield page
        finally:
            ctx.close()
            shutil.rmtree(profile_dir, ignore_errors=True)


def report_in_browser(stack: Stack, run_id: str) -> None:
    """The run's "Run report" tab in the Airflow UI; screenshot IMAGES[0] in ``stack.screenshots``."""
    from urllib.parse import quote

    with signed_in(stack) as page:
        page.goto(f"http://127.0.0.1:{stack.env['AIRFLOW_API_PORT']}/dags/{DAG}/runs/{quote(run_id, safe='')}")
        page.get_by_text("Run report", exact=True).first.click()
        frame = page.frame_locator("iframe[title='Run report']")
        frame.get_by_role("heading", name=re.compile(r"^Run report")).wait_for()
        src = page.locator("iframe[title='Run report']").get_attribute("src")
        assert src == report_path(DAG, run_id).lstrip("/"), src
        page.screenshot(path=str(stack.screenshots / IMAGES[0]), full_page=True)


def dashboard_in_browser(stack: Stack, run_id: str, job_id: str) -> None:
    """The run's job page of the stack's Ray dashboard, proxied by the Airflow API server (the "Ray job"
    button's address; the server adds the token): the job RUNNING with its step lines, no token prompt,
    every request of the page answered through the proxy; screenshot IMAGES[1] in ``stack.screenshots``."""
    base = f"http://127.0.0.1:{stack.env['AIRFLOW_API_PORT']}"
    url = job_link(DAG, run_id, job_id, base_url=base)
    answers: list[Any] = []
    with signed_in(stack) as page:
        page.on("response", lambda response: answers.append(response))
        page.set_viewport_size({"width": 1280, "height": 800})
        page.goto(url)
        page.get_by_text(job_id).first.wait_for()
        page.get_by_text("RUNNING", exact=True).first.wait_for()
        page.get_by_text("training/global_step:1", exact=False).first.wait_for()
        assert page.get_by_text("Authentication Token Required").count() == 0
        page.screenshot(path=str(stack.screenshots / IMAGES[1]))
        stored = json.dumps(page.context.storage_state()) + page.evaluate("document.cookie")
    dashboard = url.split("#", 1)[0]
    proxied = [a for a in answers if a.url.startswith(dashboard)]
    assert proxied and not [(a.url, a.status) for a in proxied if a.status in (401, 403)], proxied
    direct = [a.url for a in answers if a.url.startswith(("http://ray-head", f"http://127.0.0.1:{stack.env['RAY_DASHBOARD_PORT']}"))]
    assert not direct, f"the page reached the dashboard past the proxy: {direct}"
    assert stack.env["RAY_AUTH_TOKEN"] not in stored and not any(stack.env["RAY_AUTH_TOKEN"] in a.url for a in answers)


def fault_lines(stack: Stack, api: httpx.Client, run_id: str, attempt: int) -> int:
    """Steps logged so far by one attempt of a fault run (its metrics file on the shared volume)."""
    rd = run_dir(api, run_id)
    text = stack.exec("ray-head", "cat", str(rd.metrics_file(attempt))) if rd else ""
    return sum(1 for ln in text.splitlines() if ln.strip())


def attempts(stack: Stack, api: httpx.Client, run_id: str) -> list[dict[str, Any]]:
    rd = run_dir(api, run_id)
    assert rd, f"run {run_id} has no run directory"
    return [json.loads(ln) for ln in stack.exec("ray-head", "cat", str(rd.attempts_file)).splitlines() if ln.strip()]


def held_fault_run(stack: Stack, api: httpx.Client) -> str:
    """A fault run, held by the trainer after GATE_AFTER_STEP (gate closed) with its wait deferred."""
    stack.exec("ray-head", "rm", "-f", GATE)
    run_id = trigger(api, FAULT_PROFILE)
    wait_until("the fault run held at the gate", lambda: fault_lines(stack, api, run_id, 1) >= GATE_AFTER_STEP
               and task_states(api, run_id).get(WAIT_TASK) == "deferred", 900, 2)
    return run_id


def inspect(container: str, template: str) -> str:
    return subprocess.run(["docker", "inspect", "-f", template, container], capture_output=True, text=True,
                          check=True).stdout.strip()


def restart_counts(stack: Stack) -> dict[str, int]:
    """How often Docker has restarted each running service's container."""
    return {s["Service"]: int(inspect(s["Name"], "{{.RestartCount}}")) for s in stack.services()
            if s["State"] in ("running", "restarting")}


def kill_init(stack: Stack, service: str) -> str:
    """SIGKILL of ``service``'s init process from the host, as an OOM kill or a crash does (``docker kill``
    would count as a manual stop, which no restart policy undoes); returns its container."""
    container = stack.container(service)
    os.kill(int(inspect(container, "{{.State.Pid}}")), 9)  # a container of this script's own project
    return container


def health_check(container: str) -> subprocess.CompletedProcess[str]:
    """The container's own health check (its configured test), run once in it now."""
    test = json.loads(inspect(container, "{{json .Config.Healthcheck.Test}}"))
    cmd = ["sh", "-c", test[1]] if test[0] == "CMD-SHELL" else test[1:]
    return subprocess.run(["docker", "exec", container, *cmd], capture_output=True, text=True, timeout=120)


def back_healthy(stack: Stack, service: str, container: str, restarts_before: int, timeout_s: float = 300) -> None:
    """Wait until Docker has restarted ``container`` and its health check passes again."""
    wait_until(f"{service} restarted by Docker and healthy", lambda: int(inspect(container, "{{.RestartCount}}"))
               > restarts_before and inspect(container, "{{.State.Health.Status}}") == "healthy", timeout_s, 0.5)


def answering(api: httpx.Client, path: str) -> Any:
    """The API's JSON answer to GET ``path``, None while it cannot answer (its database down, a restart)."""
    try:
        r = api.get(path)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


def fault_worker_killed(stack: Stack, api: httpx.Client, run_id: str) -> dict[str, Any]:
    """The ray-worker container killed while ``run_id`` is held at the gate: its init process SIGKILLed from
    the host (an OOM kill or a crash); Docker's restart policy brings it back, the wait task resubmits,
    the run resumes from its checkpoint."""
    t0 = time.monotonic()
    container = kill_init(stack, "ray-worker")  # Docker restarts it (restart: unless-stopped)
    stack.exec("ray-head", "touch", GATE)
    wait_until("attempt 2 logs a step", lambda: fault_lines(stack, api, run_id, 2) >= 1, 900, 1)
    resumed = time.monotonic() - t0
    wait_run(api, run_id)
    total = time.monotonic() - t0
    tried = attempts(stack, api, run_id)
    assert [a["attempt"] for a in tried] == [1, 2] and tried[1]["resume_from_step"] == SAVE_FREQ, tried
    restarts = subprocess.run(["docker", "inspect", "-f", "{{.RestartCount}}", container], capture_output=True,
                              text=True).stdout.strip()
    return {"run_id": run_id, "kill_to_first_resumed_step_s": round(resumed, 1), "kill_to_success_s": round(total, 1),
            "resumed_from_step": tried[1]["resume_from_step"], "worker_restarts": restarts}


def fault_restart_mid_wait(stack: Stack, api: httpx.Client) -> dict[str, Any]:
    """The scheduler and the triggerer restarted while the wait is deferred: the same job is waited on."""
    run_id = held_fault_run(stack, api)
    job = (xcom(api, run_id, SUBMIT_TASK) or {}).get("submission_id")
    t0 = time.monotonic()
    stack.compose("restart", "airflow-scheduler", "airflow-triggerer")
    stack.wait_healthy()
    restart = time.monotonic() - t0
    assert task_states(api, run_id).get(WAIT_TASK) == "deferred", task_states(api, run_id)
    stack.exec("ray-head", "touch", GATE)
    wait_run(api, run_id)
    tried = attempts(stack, api, run_id)
    assert [a["submission_id"] for a in tried] == [job], tried  # no resubmission: the wait survived
    return {"run_id": run_id, "restart_to_healthy_s": round(restart, 1),
            "restart_to_success_s": round(time.monotonic() - t0, 1), "attempts": len(tried)}


def database_stopped(stack: Stack) -> dict[str, Any]:
    """PostgreSQL stopped (`docker compose stop postgres`): the API server's health check fails while it is
    gone (its health endpoint still answers 200, naming the database unhealthy), and passes once it is back."""
    api_server = stack.container("airflow-api-server")
    assert health_check(api_server).returncode == 0, "the API server is unhealthy before the database stops"
    before = restart_counts(stack)
    t0 = time.monotonic()
    stack.compose("stop", "postgres")
    failed = wait_until("the API server's health check fails", lambda: (r := health_check(api_server)).returncode
                        and r, 120, 1)
    detected = time.monotonic() - t0
    body = stack.exec("airflow-api-server", "python", "-c", "import urllib.request; print(urllib.request.urlopen("
                      "'http://127.0.0.1:8080/api/v2/monitor/health', timeout=10).read().decode())")
    metadatabase = json.loads(body)["metadatabase"]["status"]
    assert metadatabase == "unhealthy", body
    stack.compose("start", "postgres")
    wait_until("the API server's health check passes", lambda: health_check(api_server).returncode == 0, 300, 1)
    passes = time.monotonic() - t0
    stack.wait_healthy()
    after = restart_counts(stack)
    return {"stop_to_check_failing_s": round(detected, 1), "check_rc": failed.returncode,
            "health_endpoint_metadatabase": metadatabase, "stop_to_check_passing_s": round(passes, 1),
            "stop_to_every_service_healthy_s": round(time.monotonic() - t0, 1),
            "restarts_meanwhile": {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}}


def fault_killed_mid_run(stack: Stack, api: httpx.Client, service: str) -> dict[str, Any]:
    """``service`` (postgres or redis) killed while a fault run is held at the gate, the gate opened at once:
    Docker's restart policy brings it back, the run ends in success without a second attempt."""
    run_id = held_fault_run(stack, api)
    before = restart_counts(stack)
    t0 = time.monotonic()
    container = kill_init(stack, service)
    stack.exec("ray-head", "touch", GATE)
    wait_until(f"{service} restarted by Docker", lambda: int(inspect(container, "{{.RestartCount}}")) > before[service]
               and inspect(container, "{{.State.Running}}") == "true", 120, 0.2)
    restarted = time.monotonic() - t0
    back_healthy(stack, service, container, before[service])
    back = time.monotonic() - t0
    wait_until("the API answers", lambda: answering(api, f"/api/v2/dags/{DAG}/dagRuns/{run_id}"), 600, 1)
    wait_run(api, run_id)
    total = time.monotonic() - t0
    stack.wait_healthy()
    tried = attempts(stack, api, run_id)
    assert len(tried) == 1, tried  # the job itself never noticed
    after = restart_counts(stack)
    return {"run_id": run_id, f"kill_to_{service}_restarted_s": round(restarted, 1),
            f"kill_to_{service}_healthy_s": round(back, 1), "kill_to_success_s": round(total, 1),
            "attempts": len(tried),
            "restarts": {k: n - before.get(k, 0) for k, n in after.items() if n != before.get(k, 0)}}


def fault_down_up(stack: Stack, api_runs: list[str], fault_run: str) -> dict[str, Any]:
    """`down` then `up` without -v: run history, checkpoints and reports are still there."""
    t0 = time.monotonic()
    stack.compose("down")
    down = time.monotonic() - t0
    stack.compose("up", "-d", "--no-build")
    stack.wait_healthy()
    up = time.monotonic() - t0 - down
    api = api_client(stack)
    runs = {r["dag_run_id"]: r["state"] for r in api.get(f"/api/v2/dags/{DAG}/dagRuns").json()["dag_runs"]}
    assert all(runs.get(r) == "success" for r in api_runs), runs
    rd = run_dir(api, fault_run)
    assert rd, f"run {fault_run}: its provision record is gone"
    spec = RunSpec.from_dict(json.loads(stack.exec("ray-head", "cat", str(rd.spec_file))))
    step, report = spec.checkpoint_dir / f"global_step_{FAULT_STEPS}", rd.report_dir / REPORT_HTML
    kept = stack.exec("ray-head", "ls", "-d", str(step), str(report)).split()
    assert kept == [str(step), str(report)], kept
    return {"down_s": round(down, 1), "up_to_healthy_s": round(up, 1), "runs_kept": len(runs),
            "kept": f"{step}, {report}"}


def with_executor(stack: Stack, executor: str, profiles: str, env_name: str) -> Stack:
    """The same stack with .env's two Celery lines set (AIRFLOW_EXECUTOR, COMPOSE_PROFILES), as a user switches."""
    env = {**stack.env, "AIRFLOW_EXECUTOR": executor, "COMPOSE_PROFILES": profiles}
    write_env(WORK / env_name, env)
    return replace(stack, env_file=WORK / env_name, env=env)


def executor_of(stack: Stack, service: str) -> str:
    environ = json.loads(inspect(stack.container(service), "{{json .Config.Env}}"))
    return next(e.split("=", 1)[1] for e in environ if e.startswith("AIRFLOW__CORE__EXECUTOR="))


def worker_ran_every_task(stack: Stack, api: httpx.Client, run_id: str) -> dict[str, str]:
    """Every task instance of ``run_id`` that ran did so on the Celery worker's host (not the scheduler's)."""
    worker = inspect(stack.container("airflow-worker"), "{{.Config.Hostname}}")
    tis = api.get(f"/api/v2/dags/{DAG}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    hosts = {t["task_id"]: t["hostname"] for t in tis if t["state"] == "success"}
    assert hosts and set(hosts.values()) == {worker}, (worker, hosts)
    tries = {t["task_id"]: t["try_number"] for t in tis if t["try_number"] != 1 and t["state"] == "success"}
    assert not tries, f"tasks that needed another try: {tries}"
    return hosts


def switched_to_celery(stack: Stack) -> dict[str, str]:
    """.env switched to the Celery way, then `up -d`: redis and airflow-worker join, every service healthy."""
    stack.compose("up", "-d", "--no-build")
    stack.wait_healthy()
    running = {s["Service"] for s in stack.services() if s["State"] == "running"}
    assert {"redis", "airflow-worker"} <= running, running
    executors = {svc: executor_of(stack, svc) for svc in ("airflow-scheduler", "airflow-worker")}
    assert set(executors.values()) == {"CeleryExecutor"}, executors
    return executors


def switched_back(celery: Stack) -> tuple[Stack, str]:
    """.env switched back to LocalExecutor, then `up -d` and `rm -sfv redis airflow-worker` (compose stops no
    service of a profile switched off): neither is left, every service healthy, the scheduler runs tasks."""
    local = with_executor(celery, "LocalExecutor", "", "local-again.env")
    local.compose("up", "-d", "--no-build")
    local.compose("rm", "-sfv", "redis", "airflow-worker")
    local.wait_healthy()
    label = f"label=com.docker.compose.project={PROJECT}"
    service = '{{.Label "com.docker.compose.service"}}'
    left = subprocess.run(["docker", "ps", "-a", "--filter", label, "--format", service], capture_output=True,
                          text=True, check=True).stdout.split()
    assert not {"redis", "airflow-worker"} & set(left), left
    assert executor_of(local, "airflow-scheduler") == "LocalExecutor"
    return local, f"services left: {', '.join(sorted(left))}; the scheduler's executor: LocalExecutor"


def build(stack: Stack, log_name: str) -> None:
    """`docker compose build` (the classic builder), its output in .work/stack/<log_name>."""
    r = stack.compose("build", check=False)
    (WORK / log_name).write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise RuntimeError(f"docker compose build failed (rc={r.returncode}), see {WORK / log_name}:\n"
                           + (r.stdout + r.stderr)[-3000:])


def prepare(args: argparse.Namespace) -> Stack:
    if args.wheels:
        for wheel in sorted(Path(args.wheels).glob("torch-*.whl")):
            shutil.copy2(wheel, REPO / "docker" / "wheels" / wheel.name)
            log(f"docker/wheels/{wheel.name} (from {args.wheels})")
    write_configs(WORK / "configs")
    env = {**new_secrets(), "AIRFLOW_API_PORT": str(free_port()), "RAY_DASHBOARD_PORT": str(free_port()),
           "VERL_CONFIGS_DIR": str(WORK / "configs")}
    write_env(WORK / ".env", env)
    from_file = {m.group(1): m.group(2) for m in re.finditer(r"^([A-Z_][A-Z0-9_]*)=(.*)$",
                                                              (WORK / ".env").read_text(), re.M)}
    files = ("docker-compose.yaml",) if args.gpu else ("docker-compose.yaml", "docker-compose.cpu.yaml")
    screenshots = Path(args.screenshots).resolve()
    screenshots.mkdir(parents=True, exist_ok=True)
    return Stack(env_file=WORK / ".env", files=files, env=from_file, screenshots=screenshots)


def summary(stack: Stack, results: dict[str, Any]) -> None:
    load = os.getloadavg()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    print(f"\ncommit {commit.stdout.strip()}, {os.cpu_count()} CPUs, load average now {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f}; compose files {', '.join(stack.files)}")
    print("| step | seconds |\n|---|---|")
    for name, secs in stack.timings.items():
        print(f"| {name} | {secs} |")
    for name, value in results.items():
        print(f"- {name}: {value}")
    (WORK / "timings.json").write_text(json.dumps({"timings": stack.timings, "results": results}, indent=2))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--gpu", action="store_true", help="the GPU way (docker-compose.yaml alone; NVIDIA GPUs)")
    ap.add_argument("--wheels", help="copy the torch wheels of this directory into docker/wheels/ first")
    ap.add_argument("--no-faults", action="store_true", help="skip the fault cases")
    ap.add_argument("--reuse-images", action="store_true", help="keep the project's images (no cold build)")
    ap.add_argument("--no-celery", action="store_true", help="skip the Celery way (the second pass)")
    ap.add_argument("--screenshots", default=str(WORK / "screenshots"),
                    help="where the browser steps' screenshots go (docs/images: the published ones)")
    args = ap.parse_args()
    stack = prepare(args)
    last = stack  # the stack as .env last said (the Celery way's services are only down with its profile on)
    results: dict[str, Any] = {}
    try:
        clean_state(stack, remove_images=not args.reuse_images)
        results["missing .env value"] = refused_missing_value(stack)
        with stack.timed("cold build (no layer of the project cached)" if not args.reuse_images else "build"):
            build(stack, "build-cold.log")
        with stack.timed("warm build (nothing changed)"):
            build(stack, "build-warm.log")
        results["wrong .env value"] = refused_wrong_value(stack)
        with stack.timed("up -> every service healthy"):
            stack.compose("up", "-d", "--no-build")
            stack.wait_healthy()
        results["security"] = check_security(stack)
        api = api_client(stack)
        with stack.timed("DAG run (trigger -> success)"):
            run_id = preflight_run(stack, api)
        with stack.timed("browser: the run's report"):
            report_in_browser(stack, run_id)
        held = held_fault_run(stack, api)
        with stack.timed("browser: proxied Ray dashboard of a running job"):
            dashboard_in_browser(stack, held, str((xcom(api, held, SUBMIT_TASK) or {}).get("submission_id")))
        runs = [run_id, held]
        if args.no_faults:
            stack.exec("ray-head", "touch", GATE)
            wait_run(api, held)
        else:
            with stack.timed("fault: ray-worker killed mid-run -> success"):
                results["worker killed"] = fault_worker_killed(stack, api, held)
            with stack.timed("fault: scheduler + triggerer restarted mid-wait -> success"):
                results["restart mid-wait"] = fault_restart_mid_wait(stack, api)
            runs.append(results["restart mid-wait"]["run_id"])
            with stack.timed("fault: postgres stopped -> API server's health check fails, passes once it is back"):
                results["postgres stopped"] = database_stopped(stack)
            with stack.timed("fault: postgres killed mid-run -> restarted by Docker, run success"):
                results["postgres killed"] = fault_killed_mid_run(stack, api, "postgres")
            runs.append(results["postgres killed"]["run_id"])
            with stack.timed("fault: down, up without -v -> healthy, history kept"):
                results["down/up"] = fault_down_up(stack, runs, held)
        if not args.no_celery:
            last = celery = with_executor(stack, "CeleryExecutor", "celery", "celery.env")
            with stack.timed("celery: .env switched, up -d -> every service healthy (redis, airflow-worker)"):
                results["celery switch"] = switched_to_celery(celery)
            api = api_client(celery)
            with stack.timed("celery: DAG run (trigger -> success), every task on the worker"):
                celery_run = preflight_run(celery, api)
                worker_ran_every_task(celery, api, celery_run)
            if not args.no_faults:
                with stack.timed("celery: redis killed mid-run -> restarted by Docker, run success"):
                    results["redis killed"] = fault_killed_mid_run(celery, api, "redis")
                    worker_ran_every_task(celery, api, results["redis killed"]["run_id"])
        leaks = token_in_logs(last)
        assert not leaks, f"the Ray token is in: {leaks}"
        results["token in logs"] = "none (compose logs of every service, Airflow task logs, Ray logs)"
        if not args.no_celery:
            with stack.timed("celery: .env switched back, up -d + rm -sfv redis airflow-worker -> healthy"):
                last, results["switched back"] = switched_back(last)
    finally:
        with stack.timed("down -v"):
            with_executor(last, "CeleryExecutor", "celery", "down.env").compose("down", "-v", "--remove-orphans",
                                                                                check=False)
        left = stack.project_leftovers()
        results["left behind"] = left
        summary(stack, results)
    assert not any(left.values()), f"left behind: {left}"


if __name__ == "__main__":
    main()
