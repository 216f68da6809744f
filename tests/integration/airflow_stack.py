"""A real Airflow deployment for tests: PostgreSQL + scheduler, dag-processor, triggerer, api-server.

Each component is a separate process with a throwaway ``AIRFLOW_HOME``; PostgreSQL (Debian's
package) runs from a fresh data directory on a free loopback port. Everything started here is
recorded by PID and stopped by PID (SIGTERM, then SIGKILL after a grace period), children included.

Also runnable by hand to look at the UI: ``python -m tests.integration.airflow_stack`` (Ctrl-C stops).

``VERL_PIPELINE_TEST_CLOCK=2026-12-06T23:59:00Z`` runs the Airflow components, their forked workers and
PostgreSQL with their clocks moved to that instant (Debian's libfaketime, a constant offset taken when
the stack starts), to show the scheduler tests do not depend on the day or hour. Programs they start
(``ray start``, the Ray job) keep the real clock: Ray's jobs stall under libfaketime.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from verl_pipeline.cluster.local import free_ports

REPO = Path(__file__).resolve().parents[2]
AIRFLOW_BIN = Path(sys.executable).parent / "airflow"
ADMIN_USER = "admin"
#: A second user, without a role: the simple auth manager lets them log in and read no DAG, run or log
#: (its roles give every DAG to viewers and up; a user without a role is the one who may not read a run).
OUTSIDER_USER = "outsider"
# The api-server first: every other component talks to it, on a port it has proved it could bind.
COMPONENTS = ("api-server", "scheduler", "dag-processor", "triggerer")
API_SERVER_STARTS = 3
CLOCK_ENV = "VERL_PIPELINE_TEST_CLOCK"
#: A run profile only this stack has: the stand-in trainer (tests/fakes) in train mode on the local head,
#: holding after ``STACK_GATE_AFTER_STEP`` until :meth:`AirflowStack.open_gate`.
STACK_TRAIN_PROFILE = "stack-train"
STACK_TOTAL_STEPS = 6
STACK_GATE_AFTER_STEP = 3
#: A run profile on a shared ``address`` cluster admitted through an Airflow pool (the cluster profile
#: STACK_SHARED_CLUSTER, reached through the connection STACK_SHARED_CONN, which the test creates).
STACK_SHARED_PROFILE = "stack-shared"
STACK_SHARED_CLUSTER = "stack-shared-cluster"
STACK_SHARED_CONN = "ray_stack_shared"
STACK_SHARED_POOL = "stack_shared_gpus"
FAKETIME_LIB = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def task_instance(api: httpx.Client, run_id: str, task_id: str, dag_id: str = "verl_ppo") -> dict[str, Any]:
    """A task instance of a run, as the REST API v2 shows it."""
    return dict(api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}").json())


def run_xcom(api: httpx.Client, run_id: str, task_id: str, dag_id: str = "verl_ppo") -> Any:
    """A task's return value in a run (None while it has none)."""
    r = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances/{task_id}/xcomEntries/return_value")
    return r.json()["value"] if r.status_code == 200 else None


def run_task_states(api: httpx.Client, run_id: str, dag_id: str = "verl_ppo") -> dict[str, str]:
    """Every task's state in a run."""
    tis = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}/taskInstances").json()["task_instances"]
    return {ti["task_id"]: ti["state"] for ti in tis}


class StackUnavailable(RuntimeError):
    """A system prerequisite (PostgreSQL binaries) is missing: the caller skips (or fails in CI)."""


def pg_bin_dir() -> Path:
    """Directory of Debian's PostgreSQL server binaries (``initdb``, ``postgres``), newest version."""
    candidates = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name)
                        if p.parent.name.isdigit() else 0)
    for d in reversed(candidates):
        if (d / "initdb").is_file() and (d / "postgres").is_file():
            return d
    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    raise StackUnavailable("PostgreSQL server binaries not found (apt-get install -y postgresql)")


def _pythonpath() -> str:
    """The checkout's package first, so every component (the triggerer too) imports this code."""
    return os.pathsep.join([str(REPO / "include"), *filter(None, [os.environ.get("PYTHONPATH")])])


def _stop_pids(procs: list[psutil.Process], grace_s: float) -> list[int]:
    """SIGTERM each live process, SIGKILL what is left after ``grace_s``. Returns PIDs that survived."""
    live = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                live.append(p)
        except psutil.Error:  # exited between the two calls
            continue
    for p in live:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(live, timeout=grace_s)
    if alive:
        names = []
        for p in alive:
            try:
                names.append(f"{p.pid}:{' '.join(p.cmdline()[:3])}")
            except psutil.Error:
                names.append(str(p.pid))
        print(f"airflow_stack: SIGKILL after {grace_s}s: {names}", file=sys.stderr, flush=True)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    _, still = psutil.wait_procs(alive, timeout=5)
    return [p.pid for p in still]


@dataclass
class Postgres:
    """A throwaway PostgreSQL server listening only on a UNIX socket in its own directory (no TCP port
    to collide with anything), run as the ``postgres`` user when root."""

    root: Path
    proc: subprocess.Popen[bytes] | None = None
    #: Extra environment of the server (the faked clock: Airflow compares its times with ``now()`` in SQL).
    extra_env: dict[str, str] = field(default_factory=dict)

    @property
    def sock(self) -> Path:
        return self.root / "sock"

    @property
    def url(self) -> str:
        return f"postgresql+psycopg2://airflow@/airflow?host={self.sock}"

    def _user_kwargs(self) -> dict[str, Any]:
        return {"user": "postgres", "group": "postgres"} if os.geteuid() == 0 else {}

    def start(self, timeout_s: float = 180.0) -> None:
        bindir = pg_bin_dir()
        data, sock = self.root / "data", self.sock
        data.mkdir(parents=True)
        sock.mkdir()
        if os.geteuid() == 0:
            # The server runs as `postgres`: let it traverse the parents, own its own directories.
            for parent in (self.root.parent, self.root.parent.parent):
                parent.chmod(parent.stat().st_mode | 0o111)
            shutil.chown(self.root, "postgres", "postgres")
            for p in (data, sock):
                shutil.chown(p, "postgres", "postgres")
        subprocess.run([str(bindir / "initdb"), "-D", str(data), "-U", "airflow", "--auth=trust",
                        "--encoding=UTF8", "--no-sync"], check=True, capture_output=True, **self._user_kwargs())
        with open(self.root / "postgres.log", "wb") as log:  # the child keeps its own copy of the fd
            self.proc = subprocess.Popen(
                [str(bindir / "postgres"), "-D", str(data), "-h", "", "-k", str(sock),
                 "-c", "fsync=off", "-c", "max_connections=200"],
                stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **self.extra_env}, **self._user_kwargs(),
            )
        import psycopg2

        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"postgres exited: {(self.root / 'postgres.log').read_text()[-2000:]}")
            try:
                conn = psycopg2.connect(host=str(sock), user="airflow", dbname="postgres")
                break
            except psycopg2.OperationalError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.3)
        conn.autocommit = True
        with conn.cursor() as cur:
            cur.execute("CREATE DATABASE airflow")
        conn.close()

    def stop(self) -> list[int]:
        if self.proc is None:
            return []
        # SIGTERM = "smart" shutdown; the server's own children exit with it.
        tree = [psutil.Process(self.proc.pid)]
        try:
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        return _stop_pids(tree, grace_s=15)


@dataclass
class AirflowStack:
    """PostgreSQL + the four Airflow components, each its own process, against a throwaway home."""

    root: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="vp-stack-")))
    api_port: int = field(default_factory=lambda: free_ports(1)[0])
    password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    outsider_password: str = field(default_factory=lambda: secrets.token_urlsafe(12))
    # One secret for every component: the api-server verifies the JWTs the scheduler signs.
    jwt_secret: str = field(default_factory=lambda: secrets.token_hex(32))  # HS512: 64 bytes
    api_secret_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    postgres: Postgres | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _tracked: dict[int, psutil.Process] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    clock_offset_s: int | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    @property
    def home(self) -> Path:
        return self.root / "airflow"

    def log_path(self, component: str) -> Path:
        return self.root / "logs" / f"{component}.log"

    def task_log_tail(self, run_id: str, task_id: str, chars: int = 4000, dag_id: str = "verl_ppo") -> str:
        """The end of a task's latest try's log (Airflow's task log files under the stack's home)."""
        tries = sorted((self.home / "logs" / f"dag_id={dag_id}" / f"run_id={run_id}" / f"task_id={task_id}")
                       .glob("attempt=*.log"))
        return tries[-1].read_text(errors="replace")[-chars:] if tries else f"(no log of {task_id} in {run_id})"

    @property
    def configs(self) -> Path:
        """The project's configs plus :data:`STACK_TRAIN_PROFILE` (written at start)."""
        return self.root / "configs"

    @property
    def gate(self) -> Path:
        return self.root / "gate-open"

    @property
    def shared_gate(self) -> Path:
        """The gate of :data:`STACK_SHARED_PROFILE`'s runs."""
        return self.root / "shared-gate-open"

    def open_gate(self) -> None:
        self.gate.touch()

    def close_gate(self) -> None:
        self.gate.unlink(missing_ok=True)

    def _write_configs(self) -> None:
        import yaml

        shutil.copytree(REPO / "configs", self.configs)
        profile = {
            "description": "tests: the stand-in trainer under the real scheduler and triggerer",
            "model_profile": "tiny-ppo",
            "cluster_profile": "local-cpu",
            "data": {"source": "builtin:arithmetic", "train_size": 32, "val_size": 8},
            "trainer": {"nnodes": 1, "n_gpus_per_node": 1, "total_training_steps": STACK_TOTAL_STEPS},
            "mode": "train",
            "trainer_command": [sys.executable, str(REPO / "tests" / "fakes" / "fake_verl_trainer.py")],
            # The stand-in's cheap checkpoint files are no FSDP state verl's merger could read.
            "export": False,
            "verl": {"trainer": {"save_freq": 2},
                     "+fake": {"step_seconds": 0.5, "gate_file": str(self.gate),
                               "gate_after_step": STACK_GATE_AFTER_STEP}},
        }
        (self.configs / "profiles" / f"{STACK_TRAIN_PROFILE}.yaml").write_text(yaml.safe_dump(profile))
        shared_cluster = {
            "description": "tests: a shared Ray cluster with one GPU, admitted through an Airflow pool",
            "cluster": {"backend": "address", "conn_id": STACK_SHARED_CONN, "auth_mode": "token",
                        "pool": STACK_SHARED_POOL, "expected_nodes": 1, "expected_gpus": 1, "ready_timeout_s": 120},
            "hardware": {"gpu_memory_gb": 24},
            "runtime": {"ship_package": False, "env": {}},
        }
        (self.configs / "clusters" / f"{STACK_SHARED_CLUSTER}.yaml").write_text(yaml.safe_dump(shared_cluster))
        shared = {**profile, "description": "tests: the stand-in trainer on a shared cluster",
                  "cluster_profile": STACK_SHARED_CLUSTER,
                  "verl": {"trainer": {"save_freq": 2},
                           "+fake": {"step_seconds": 0.5, "gate_file": str(self.shared_gate),
                                     "gate_after_step": STACK_GATE_AFTER_STEP}}}
        (self.configs / "profiles" / f"{STACK_SHARED_PROFILE}.yaml").write_text(yaml.safe_dump(shared))

    def env(self) -> dict[str, str]:
        assert self.postgres is not None
        env = {k: v for k, v in os.environ.items() if not k.startswith("AIRFLOW__")}
        env.update({
            "AIRFLOW_HOME": str(self.home),
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": self.postgres.url,
            "AIRFLOW__CORE__EXECUTOR": "LocalExecutor",
            "AIRFLOW__CORE__PARALLELISM": "4",
            "AIRFLOW__CORE__DAGS_FOLDER": str(REPO / "dags"),
            "AIRFLOW__CORE__PLUGINS_FOLDER": str(REPO / "plugins"),
            "AIRFLOW__CORE__LOAD_EXAMPLES": "False",
            "AIRFLOW__CORE__DAGS_ARE_PAUSED_AT_CREATION": "True",
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"{self.base_url}/execution/",
            "AIRFLOW__CORE__FERNET_KEY": "",
            "AIRFLOW__API_AUTH__JWT_SECRET": self.jwt_secret,
            "AIRFLOW__API__SECRET_KEY": self.api_secret_key,
            "AIRFLOW__API__BASE_URL": self.base_url,
            "AIRFLOW__API__WORKERS": "1",
            "AIRFLOW__CORE__AUTH_MANAGER":
                "airflow.api_fastapi.auth.managers.simple.simple_auth_manager.SimpleAuthManager",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_USERS": f"{ADMIN_USER}:admin,{OUTSIDER_USER}:",
            "AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE": str(self.home / "passwords.json"),
            "AIRFLOW__SCHEDULER__STANDALONE_DAG_PROCESSOR": "True",
            "AIRFLOW__DAG_PROCESSOR__REFRESH_INTERVAL": "10",
            "AIRFLOW__LOGGING__LOGGING_LEVEL": "INFO",
            "VERL_PIPELINE_HOME": str(self.root / "pipeline-home"),
            "VERL_PIPELINE_CONFIGS": str(self.configs),
            "RAY_AUTH_MODE": "disabled",
            "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1",
            # The checkout's package first, so every component (the triggerer too) imports this code.
            "PYTHONPATH": _pythonpath(),
        })
        env.pop("RAY_ADDRESS", None)
        return env

    def start(self, timeout_s: float = 300.0) -> AirflowStack:
        """Start PostgreSQL, migrate, then the components; ``timeout_s`` is the components' budget to
        become healthy, counted from their launch (a slow migrate does not eat into it)."""
        t0 = time.monotonic()
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        self.home.mkdir(parents=True, exist_ok=True)
        pw_file = self.home / "passwords.json"
        pw_file.write_text(json.dumps({ADMIN_USER: self.password, OUTSIDER_USER: self.outsider_password}))
        pw_file.chmod(0o600)
        self._write_configs()
        # The project's Airflow local settings (the shared-cluster pool policy), as its image installs them.
        (self.home / "config").mkdir(exist_ok=True)
        shutil.copy(REPO / "docker" / "airflow_local_settings.py", self.home / "config")
        self._fix_clock()
        self.postgres = Postgres(self.root / "pg", extra_env=self._clock_env())
        self.postgres.start()
        self.timings["postgres_s"] = time.monotonic() - t0
        t1 = time.monotonic()
        migrate = subprocess.run([str(AIRFLOW_BIN), "db", "migrate"], env=self.env(), capture_output=True,
                                 text=True, timeout=900)
        if migrate.returncode != 0:
            raise RuntimeError(f"airflow db migrate failed:\n{migrate.stdout[-3000:]}\n{migrate.stderr[-3000:]}")
        self.timings["db_migrate_s"] = time.monotonic() - t1
        t2 = time.monotonic()
        deadline = t2 + timeout_s
        self._start_api_server(deadline)
        for comp in COMPONENTS[1:]:
            self._launch(comp)
        self._wait_healthy(deadline=deadline)
        self.timings["components_healthy_s"] = time.monotonic() - t2
        return self

    def _fix_clock(self) -> None:
        """With ``$VERL_PIPELINE_TEST_CLOCK`` set, the components' clocks start at that instant."""
        target = os.environ.get(CLOCK_ENV)
        if not target:
            return
        if not FAKETIME_LIB.is_file():
            raise StackUnavailable(f"{CLOCK_ENV} needs libfaketime (apt-get install -y faketime)")
        from datetime import datetime, timezone

        when = datetime.fromisoformat(target.replace("Z", "+00:00"))
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        self.clock_offset_s = int((when - datetime.now(timezone.utc)).total_seconds())
        print(f"airflow_stack: Airflow's clock at {when.isoformat()} (offset {self.clock_offset_s:+d} s)",
              file=sys.stderr, flush=True)

    def _clock_env(self) -> dict[str, str]:
        """libfaketime's settings for the stack's processes, PostgreSQL included (the scheduler starts
        a queued run only when ``run_after <= now()`` in SQL). Monotonic clocks move by the same offset:
        Python sleeps until an absolute monotonic deadline, which libfaketime translates back.

        A ``sitecustomize`` drops ``LD_PRELOAD`` from each faked Python's environment as it starts:
        the process and its forks stay faked, what they exec (Ray) does not. ``FAKETIME`` stays:
        libfaketime reads it again every few seconds and would fall back to the real clock."""
        if self.clock_offset_s is None:
            return {}
        site = self.root / "faketime-site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(
            "import os\nos.environ.pop('LD_PRELOAD', None)\n")
        return {"LD_PRELOAD": str(FAKETIME_LIB), "FAKETIME": f"{self.clock_offset_s:+d}",
                "PYTHONPATH": os.pathsep.join([str(site), _pythonpath()])}

    def _launch(self, comp: str) -> None:
        args = [str(AIRFLOW_BIN), comp]
        if comp == "api-server":
            args += ["--port", str(self.api_port), "--host", "127.0.0.1"]
        env = {**self.env(), **self._clock_env()}
        with open(self.log_path(comp), "ab") as log:  # the child keeps its own copy of the fd
            proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=self.root)
        self.procs[comp] = proc
        self._tracked[proc.pid] = psutil.Process(proc.pid)

    def _start_api_server(self, deadline: float) -> None:
        """Start the api-server and wait until it answers. A port taken between the pick and the bind
        (another process of the busy machine) gets a fresh port, up to ``API_SERVER_STARTS`` times."""
        for start in range(1, API_SERVER_STARTS + 1):
            self._launch("api-server")
            proc = self.procs["api-server"]
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    if httpx.get(f"{self.base_url}/api/v2/version", timeout=5).status_code < 500:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(1)
            if proc.poll() is None:
                raise TimeoutError(f"the api-server did not answer on {self.base_url} in time")
            log = self.log_path("api-server").read_text(errors="replace")
            if "address already in use" not in log.lower() or start == API_SERVER_STARTS:
                raise RuntimeError(f"airflow api-server exited with {proc.returncode}:\n{log[-3000:]}")
            print(f"airflow_stack: api port {self.api_port} was taken, retrying on another", file=sys.stderr)
            self.api_port = free_ports(1)[0]

    def _check_alive(self) -> None:
        for comp, proc in self.procs.items():
            if proc.poll() is not None:
                tail = self.log_path(comp).read_text(errors="replace")[-3000:]
                raise RuntimeError(f"airflow {comp} exited with {proc.returncode}:\n{tail}")

    def _wait_healthy(self, deadline: float) -> None:
        last: Any = None
        while time.monotonic() < deadline:
            self._check_alive()
            self._track_children()
            try:
                r = httpx.get(f"{self.base_url}/api/v2/monitor/health", timeout=5)
                last = r.json() if r.status_code == 200 else r.text
                if r.status_code == 200:
                    health = r.json()
                    states = {k: (v or {}).get("status") for k, v in health.items()}
                    if all(states.get(k) == "healthy" for k in ("metadatabase", "scheduler", "triggerer",
                                                                  "dag_processor")):
                        return
            except httpx.HTTPError as e:
                last = e
            time.sleep(1)
        raise TimeoutError(f"Airflow stack not healthy in time; last health answer: {last}")

    def _track_children(self) -> None:
        """Remember every descendant of the components (executor workers, task runners)."""
        for proc in list(self._tracked.values()):
            try:
                for child in proc.children(recursive=True):
                    self._tracked.setdefault(child.pid, child)
            except psutil.NoSuchProcess:
                continue

    def kill(self, comp: str) -> list[int]:
        """SIGKILL one component and every process under it (what a crashed host does to it)."""
        proc = psutil.Process(self.procs[comp].pid)
        victims = [proc, *proc.children(recursive=True)]
        for p in victims:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(victims, timeout=30)
        self.procs[comp].wait(timeout=30)
        return [p.pid for p in victims]

    def relaunch(self, comp: str) -> None:
        """Start a component again (after :meth:`kill`), logging to the same file."""
        self._launch(comp)

    # -- REST API v2 --------------------------------------------------------------------------------
    def token(self, user: str = ADMIN_USER) -> str:
        """A JWT of ``user`` (:data:`ADMIN_USER` or :data:`OUTSIDER_USER`) from the API's login."""
        password = self.outsider_password if user == OUTSIDER_USER else self.password
        r = httpx.post(f"{self.base_url}/auth/token", json={"username": user, "password": password}, timeout=30)
        r.raise_for_status()
        return str(r.json()["access_token"])

    def client(self) -> httpx.Client:
        # A generous read timeout: on a busy 2-core machine the api-server can take tens of seconds.
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {self.token()}"},
                            timeout=httpx.Timeout(90.0, connect=30.0))

    def wait_for_dag(self, api: httpx.Client, dag_id: str, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            r = api.get(f"/api/v2/dags/{dag_id}")
            if r.status_code == 200:
                return dict(r.json())
            if time.monotonic() > deadline:
                raise TimeoutError(f"DAG {dag_id} not parsed in {timeout_s}s: {r.status_code} {r.text[:300]}")
            time.sleep(1)

    def wait_held_at_gate(self, api: httpx.Client, run_id: str, timeout_s: float = 600.0) -> Path:
        """Until a :data:`STACK_TRAIN_PROFILE` run's job trains, is held at the gate (closed), and its wait
        task is deferred to a triggerer; returns the run directory."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            sub = run_xcom(api, run_id, "submit_verl_job")
            ti = task_instance(api, run_id, "wait_for_verl_job")
            if sub and ti.get("state") == "deferred" and ti.get("triggerer_job"):
                metrics = Path(sub["run_dir"]) / "metrics-a1.jsonl"
                if metrics.is_file() and len(metrics.read_text().splitlines()) >= STACK_GATE_AFTER_STEP:
                    return Path(sub["run_dir"])
            assert time.monotonic() < deadline, f"run {run_id} never reached the gate deferred: {ti.get('state')}"
            time.sleep(1)

    def wait_for_run(self, api: httpx.Client, dag_id: str, run_id: str, timeout_s: float = 600.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            self._check_alive()
            self._track_children()
            try:
                run = api.get(f"/api/v2/dags/{dag_id}/dagRuns/{run_id}").json()
            except httpx.TransportError as e:  # a slow answer on a busy machine: ask again until the deadline
                run = {"state": f"unknown ({type(e).__name__})"}
            if run.get("state") in ("success", "failed"):
                return dict(run)
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {run_id} still {run.get('state')} after {timeout_s}s")
            time.sleep(2)

    # -- shutdown -----------------------------------------------------------------------------------
    def stop(self, grace_s: float = 20.0) -> list[int]:
        """Stop every process this stack started (components, their children, PostgreSQL)."""
        self._track_children()
        survivors = _stop_pids(list(self._tracked.values()), grace_s=grace_s)
        if self.postgres is not None:
            survivors += self.postgres.stop()
        self._stop_leftover_clusters()
        return survivors

    def _stop_leftover_clusters(self) -> None:
        """Runs cut short by stopping the stack (a failed test) never reach their teardown task:
        stop the local Ray clusters they recorded, as the pipeline's teardown would."""
        from verl_pipeline.cluster.base import ClusterHandle
        from verl_pipeline.cluster.local import stop_local

        home = Path(self.env()["VERL_PIPELINE_HOME"])
        for record in sorted(home.glob("runs/*/cluster.json")):
            handle = ClusterHandle.from_dict(json.loads(record.read_text()))
            if handle.backend == "local":
                stop_local(handle)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> None:
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` or a kill by PID stops the stack too
    stack = AirflowStack()
    try:
        stack.start()
        print(f"Airflow at {stack.base_url}  user {ADMIN_USER}  password {stack.password}  root {stack.root}",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        print("stopping; survivors:", stack.stop(), flush=True)


if __name__ == "__main__":
    main()
