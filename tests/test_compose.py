"""Static checks of the docker-compose stack (docker-compose.yaml, docker-compose.cpu.yaml, .env.example,
the Dockerfiles, docker/check_env.py, .gitignore).

``docker compose config`` validates the schema and the interpolation; these tests check what it
cannot: the services the DAGs need, identical shared mount paths on every Airflow and Ray
container, loopback-only ports, GPU reservations (and none in the CPU way), token auth agreeing with
the stack's cluster profile, non-root users, secrets never build arguments, env-check before
everything, .env.example's defaults fitting the profile the stack's runs use, the Celery profile and
that every variable is documented. Some tests run ``docker compose config`` itself when a Compose v2
binary is available (skipped otherwise). The stack itself is built and run by tests/e2e/compose_stack.py
(``make stack-e2e``), not here: CI has no time for it.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE_FILE = ROOT / "docker-compose.yaml"
CPU_FILE = ROOT / "docker-compose.cpu.yaml"
ENV_EXAMPLE = ROOT / ".env.example"
GITIGNORE = ROOT / ".gitignore"
DOCKERFILES = tuple(sorted((ROOT / "docker").glob("*.Dockerfile")))
#: The run profile a newcomer triggers on the stack, and its cluster profile.
STACK_PROFILE = "compose"

REQUIRED_SERVICES = (
    "postgres",
    "airflow-init",
    "airflow-api-server",
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "ray-head",
    "ray-worker",
)
CELERY_SERVICES = frozenset({"redis", "airflow-worker"})
# Long-running Airflow components that execute or schedule DAG code.
AIRFLOW_RUNTIME_SERVICES = (
    "airflow-scheduler",
    "airflow-dag-processor",
    "airflow-triggerer",
    "airflow-worker",
)
SHARED_PATHS = ("/shared/data", "/shared/models", "/shared/checkpoints", "/shared/runs")
LOOPBACK = "127.0.0.1"
SECRET_NAME = re.compile(r"PASSWORD|SECRET|FERNET|TOKEN")

# `$$` is Compose's escape for a literal `$`; it is matched first so that `$${HOSTNAME}` is skipped.
_VAR_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)|\$([A-Za-z_][A-Za-z0-9_]*)")
_INTERPOLATION = re.compile(r"\$\{[^}]*\}")


# -- helpers -------------------------------------------------------------------------------------
class _ComposeLoader(yaml.SafeLoader):
    """PyYAML's safe loader plus Compose's merge tags (``!reset``, ``!override``: the value as written)."""


def _untagged(loader: yaml.SafeLoader, node: yaml.Node) -> Any:
    if isinstance(node, yaml.MappingNode):
        return loader.construct_mapping(node, deep=True)
    if isinstance(node, yaml.SequenceNode):
        return loader.construct_sequence(node, deep=True)
    return loader.construct_scalar(node)  # type: ignore[arg-type]


for _tag in ("!reset", "!override"):
    _ComposeLoader.add_constructor(_tag, _untagged)


def _load_compose(path: Path) -> dict[str, Any]:
    data = yaml.load(path.read_text(), Loader=_ComposeLoader)
    assert isinstance(data, dict), f"{path.name} is not a mapping"
    return data


def _require(path: Path) -> None:
    if not path.is_file():
        pytest.skip(f"{path.relative_to(ROOT)} does not exist yet")


def _referenced_vars(text: str) -> set[str]:
    names = set()
    for m in _VAR_REF.finditer(text):
        name = m.group(1) or m.group(2)
        if name:
            names.add(name)
    return names


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        out = {}
        for item in env:
            key, _, value = str(item).partition("=")
            out[key] = value
        return out
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def _split_short_volume(spec: str) -> tuple[str | None, str]:
    """(source, target) of a short-syntax volume; ``${...}`` may contain colons, so mask it first."""
    masked: list[str] = []

    def mask(m: re.Match[str]) -> str:
        masked.append(m.group(0))
        return f"\0{len(masked) - 1}\0"

    parts = _INTERPOLATION.sub(mask, spec).split(":")

    def unmask(s: str) -> str:
        return re.sub(r"\0(\d+)\0", lambda m: masked[int(m.group(1))], s)

    if len(parts) == 1:
        return None, unmask(parts[0])
    return unmask(parts[0]), unmask(parts[1])


def _mounts(service: dict[str, Any]) -> dict[str, str | None]:
    """Container path -> source for every volume of a service."""
    out: dict[str, str | None] = {}
    for vol in service.get("volumes") or []:
        if isinstance(vol, dict):
            out[str(vol["target"])] = vol.get("source")
        else:
            source, target = _split_short_volume(str(vol))
            out[target] = source
    return out


def _default_of(value: str, var: str) -> str | None:
    """The ``:-`` / ``-`` default of ``${var...}`` in value, None when there is none."""
    m = re.fullmatch(rf"\$\{{{var}(?::?-(?P<default>[^}}]*))?\}}", value)
    assert m, f"expected ${{{var}...}}, got {value!r}"
    return m.group("default")


def _env_example_assignments() -> dict[str, str]:
    out = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        m = re.match(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_]*)\s*=(.*)$", line)
        if m:
            out[m.group(1)] = m.group(2).strip().strip("'\"")
    return out


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    _require(COMPOSE_FILE)
    data = yaml.safe_load(COMPOSE_FILE.read_text())
    assert isinstance(data, dict), "docker-compose.yaml is not a mapping"
    assert isinstance(data.get("services"), dict) and data["services"], "no services defined"
    return data


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


@pytest.fixture(scope="module")
def airflow_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if n.startswith("airflow-")}


@pytest.fixture(scope="module")
def ray_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if n.startswith("ray-")}


# -- services ------------------------------------------------------------------------------------
def test_required_services_exist(services: dict[str, dict[str, Any]]) -> None:
    missing = [name for name in REQUIRED_SERVICES if name not in services]
    assert not missing, f"docker-compose.yaml lacks services: {missing}"


def test_required_services_start_without_a_profile(services: dict[str, dict[str, Any]]) -> None:
    gated = {n: services[n]["profiles"] for n in REQUIRED_SERVICES if services.get(n, {}).get("profiles")}
    assert not gated, f"these services would not start with a plain `docker compose up`: {gated}"


def test_celery_services_only_in_celery_profile(services: dict[str, dict[str, Any]]) -> None:
    for name in CELERY_SERVICES:
        assert name in services, f"{name} missing (the celery profile needs redis + airflow-worker)"
        assert services[name].get("profiles") == ["celery"], f"{name} must be in profile `celery` only"
    in_profile = {n for n, s in services.items() if "celery" in (s.get("profiles") or [])}
    assert in_profile == CELERY_SERVICES, f"unexpected services in the celery profile: {in_profile}"
    # Nothing Celery-ish may start outside the profile.
    for name, svc in services.items():
        if name in CELERY_SERVICES:
            continue
        command = svc.get("command") or ""
        command = " ".join(command) if isinstance(command, list) else str(command)
        assert not command.strip().startswith("celery"), f"{name} runs celery outside the profile"
        assert not str(svc.get("image", "")).startswith("redis"), f"{name} runs redis outside the profile"


def test_default_executor_is_local(airflow_services: dict[str, dict[str, Any]]) -> None:
    for name, svc in airflow_services.items():
        value = _env(svc).get("AIRFLOW__CORE__EXECUTOR")
        assert value, f"{name}: AIRFLOW__CORE__EXECUTOR not set"
        if value.startswith("${"):
            assert _default_of(value, "AIRFLOW_EXECUTOR") == "LocalExecutor", f"{name}: {value}"
        else:
            assert value == "LocalExecutor", f"{name}: {value}"


def test_airflow_runtime_settings(services: dict[str, dict[str, Any]]) -> None:
    for name in AIRFLOW_RUNTIME_SERVICES:
        if name not in services:
            continue
        env = _env(services[name])
        assert "@postgres" in env.get("AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", ""), f"{name}: not on postgres"
        assert env.get("AIRFLOW__CORE__PARALLELISM") == "4", f"{name}: parallelism"
        assert env.get("AIRFLOW__CORE__LOAD_EXAMPLES", "").lower() == "false", f"{name}: load_examples"
        assert env.get("VERL_PIPELINE_CONFIGS") == "/opt/verl-pipeline/configs", f"{name}: configs"
        sources = {target: src for target, src in _mounts(services[name]).items()}
        assert sources.get("/opt/airflow/dags") == "./dags", f"{name}: ./dags not mounted as the DAGs folder"


def test_api_server_command_and_port(services: dict[str, dict[str, Any]]) -> None:
    api = services["airflow-api-server"]
    assert api.get("command") in ("api-server", ["api-server"])
    ports = [str(p) for p in api.get("ports") or []]
    assert len(ports) == 1 and ports[0].endswith(":8080"), ports


def test_ray_head_and_worker_commands(services: dict[str, dict[str, Any]]) -> None:
    head = services["ray-head"]["command"]
    head = " ".join(head) if isinstance(head, list) else str(head)
    for flag in ("ray start", "--head", "--block", "--dashboard-host=0.0.0.0", "--port=6379", "--num-gpus="):
        assert flag in head, f"ray-head command lacks {flag}: {head}"
    worker_svc = services["ray-worker"]
    worker = worker_svc["command"]
    worker = " ".join(worker) if isinstance(worker, list) else str(worker)
    assert "ray start" in worker and "--block" in worker and "--address=ray-head:6379" in worker, worker
    assert "--head" not in worker
    assert "replicas" in (worker_svc.get("deploy") or {}), "ray-worker needs a configurable deploy.replicas"
    head_ports = [str(p) for p in services["ray-head"].get("ports") or []]
    assert any(p.endswith(":8265") for p in head_ports), f"dashboard not published: {head_ports}"


# -- restart policies and health checks ------------------------------------------------------------
ONE_SHOT_SERVICES = ("env-check", "airflow-init")


def test_every_long_running_service_comes_back_after_a_crash(services: dict[str, dict[str, Any]]) -> None:
    """Docker restarts a long-running container whose process dies (a crash, an OOM kill: PostgreSQL and Redis
    too); the one-shot services run once. (`docker kill` and `docker compose stop` are manual stops, which no
    policy undoes: `docker compose up -d` starts them again.)"""
    policies = {name: str(svc.get("restart")) for name, svc in services.items()}
    assert {n: policies[n] for n in ONE_SHOT_SERVICES} == dict.fromkeys(ONE_SHOT_SERVICES, "no"), policies
    long_running = {n: p for n, p in policies.items() if n not in ONE_SHOT_SERVICES}
    assert {"postgres", "redis", "airflow-worker", "ray-head", "ray-worker"} <= set(long_running)
    assert set(long_running.values()) == {"unless-stopped"}, long_running


def test_every_long_running_service_has_a_health_check(services: dict[str, dict[str, Any]]) -> None:
    """Health is what `depends_on: service_healthy` and the stack's own checks wait for: every long-running
    service says how it is healthy, with a bounded timeout and retries."""
    for name, svc in services.items():
        if name in ONE_SHOT_SERVICES:
            continue
        check = svc.get("healthcheck") or {}
        assert check.get("test") and check.get("timeout") and check.get("retries"), f"{name}: {check}"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: {check['test']}"


def _api_server_check(services: dict[str, dict[str, Any]], base: str) -> subprocess.CompletedProcess[str]:
    """The API server's health check as the compose file writes it, pointed at ``base`` instead of the server."""
    test = services["airflow-api-server"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"], test
    code = test[3]
    assert "http://127.0.0.1:8080/" in code, code
    return subprocess.run([sys.executable, "-c", code.replace("http://127.0.0.1:8080/", f"{base}/")],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("database", "healthy"), [("healthy", True), ("unhealthy", False)])
def test_the_api_servers_health_check_fails_without_the_database(
    services: dict[str, dict[str, Any]], database: str, healthy: bool
) -> None:
    """Airflow's /api/v2/monitor/health answers 200 when the metadata DB is gone too, naming it unhealthy:
    the check reads that answer (here from a local server answering as the API server does)."""
    import http.server
    import threading

    body = json.dumps({"metadatabase": {"status": database}, "scheduler": {"status": "unhealthy"}}).encode()

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status = 200 if self.path == "/api/v2/monitor/health" else 404
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        r = _api_server_check(services, f"http://127.0.0.1:{server.server_address[1]}")
    finally:
        server.shutdown()
        server.server_close()
    assert (r.returncode == 0) is healthy, (r.returncode, r.stderr)


def test_the_api_servers_health_check_fails_when_nothing_answers(services: dict[str, dict[str, Any]]) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: the connection is refused
        r = _api_server_check(services, f"http://127.0.0.1:{port}")
    assert r.returncode != 0 and "Connection refused" in r.stderr, r.stderr


def test_the_celery_result_backend_uses_the_metadata_dbs_driver(services: dict[str, dict[str, Any]]) -> None:
    """The result backend is the metadata DB with its driver named: SQLAlchemy 2.1 reads a bare postgresql:// as
    psycopg (v3), which neither requirements.txt nor the lock holds; psycopg2 is in both. create_engine
    imports the driver (it connects to nothing), as the Celery worker and the scheduler do at start."""
    from sqlalchemy import create_engine

    for name in AIRFLOW_RUNTIME_SERVICES:
        env = _env(services[name])
        backend, conn = env["AIRFLOW__CELERY__RESULT_BACKEND"], env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"]
        assert backend == f"db+{conn}", (name, backend)
    url = _INTERPOLATION.sub("pw", conn)
    assert url.startswith("postgresql+psycopg2://"), url
    create_engine(url).dispose()
    pins = {re.split(r"[=<>\[ ]", ln, maxsplit=1)[0] for ln in (ROOT / "requirements" / "constraints.txt").read_text()
            .splitlines() if ln and not ln.startswith(" ")}
    wanted = {ln.strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()}
    assert "psycopg2-binary" in pins and "psycopg2-binary" in wanted, "the driver the URLs name is not installed"
    assert "psycopg" not in pins, "psycopg (v3) is locked: the URLs could name it"


# -- mounts, ports, GPUs, auth -------------------------------------------------------------------
def test_shared_mounts_identical_everywhere(
    airflow_services: dict[str, dict[str, Any]], ray_services: dict[str, dict[str, Any]]
) -> None:
    assert airflow_services and ray_services
    sources: dict[str, set[str | None]] = {p: set() for p in SHARED_PATHS}
    for name, svc in {**airflow_services, **ray_services}.items():
        mounts = _mounts(svc)
        for path in SHARED_PATHS:
            assert path in mounts, f"{name} does not mount {path}"
            assert mounts[path], f"{name}: {path} is an anonymous volume (not shared)"
            sources[path].add(mounts[path])
        assert _env(svc).get("VERL_PIPELINE_HOME") == "/shared", f"{name}: VERL_PIPELINE_HOME != /shared"
    for path, srcs in sources.items():
        assert len(srcs) == 1, f"{path} comes from different sources in different services: {srcs}"


def test_ports_bound_to_loopback_only(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for port in svc.get("ports") or []:
            if isinstance(port, dict):
                assert port.get("host_ip") == LOOPBACK, f"{name}: port {port} not bound to {LOOPBACK}"
                assert port.get("published"), f"{name}: port {port} has no fixed host port"
            else:
                assert isinstance(port, str), f"{name}: port {port!r} must be '127.0.0.1:HOST:CONTAINER'"
                assert port.startswith(f"{LOOPBACK}:"), f"{name}: port {port!r} is not bound to {LOOPBACK}"
                assert port.count(":") >= 2, f"{name}: port {port!r} lacks the container port"


def test_ray_services_reserve_nvidia_gpus_and_shm(ray_services: dict[str, dict[str, Any]]) -> None:
    assert {"ray-head", "ray-worker"} <= set(ray_services)
    for name, svc in ray_services.items():
        reservations = ((svc.get("deploy") or {}).get("resources") or {}).get("reservations") or {}
        devices = reservations.get("devices") or []
        gpu = [d for d in devices if d.get("driver") == "nvidia" and "gpu" in (d.get("capabilities") or [])]
        assert gpu, f"{name}: no deploy.resources.reservations.devices entry for nvidia GPUs"
        assert svc.get("shm_size"), f"{name}: shm_size not set (Ray/NCCL/vLLM need a large /dev/shm)"


def test_ray_token_auth_everywhere_and_the_stacks_cluster_profile_agrees(
    airflow_services: dict[str, dict[str, Any]], ray_services: dict[str, dict[str, Any]]
) -> None:
    """Token auth is always on in the stack: RAY_AUTH_MODE=token on every Airflow and Ray container (not a
    variable), the one token from .env on every Ray node and in the Airflow connection, and the cluster
    profiles the stack's runs use (`compose`, and `gpu-address` on the same connection) say token too."""
    from verl_pipeline.profiles import load_yaml_profile

    for name, svc in {**airflow_services, **ray_services}.items():
        assert _env(svc).get("RAY_AUTH_MODE") == "token", f"{name}: RAY_AUTH_MODE={_env(svc).get('RAY_AUTH_MODE')!r}"
    for name, svc in ray_services.items():
        assert _env(svc)["RAY_AUTH_TOKEN"].startswith("${RAY_AUTH_TOKEN:?"), f"{name}: the token not required"
    for name in AIRFLOW_RUNTIME_SERVICES:
        if name in airflow_services:
            assert "${RAY_AUTH_TOKEN:?" in _env(airflow_services[name])["AIRFLOW_CONN_RAY_DEFAULT"], name
    assert "RAY_AUTH_MODE" not in _env_example_assignments(), ".env.example must not offer to switch auth off"
    for cluster in (STACK_PROFILE, "gpu-address"):
        section = load_yaml_profile("clusters", cluster)["cluster"]
        assert (section["conn_id"], section["auth_mode"]) == ("ray_default", "token"), (cluster, section)


def test_secrets_are_never_build_arguments(services: dict[str, dict[str, Any]]) -> None:
    """A build argument is recorded in the image's history: no secret may reach one."""
    for name, svc in services.items():
        build = svc.get("build") or {}
        for key, value in (build.get("args") or {}).items():
            assert not SECRET_NAME.search(str(key)), f"{name}: build argument {key}"
            assert not {v for v in _referenced_vars(str(value)) if SECRET_NAME.search(v)}, f"{name}: {key}={value}"


def test_no_container_runs_as_root(services: dict[str, dict[str, Any]]) -> None:
    """Airflow and Ray run as APP_UID (GID 0), env-check as nobody; postgres and redis start as root only to
    drop to their own user (their images' entrypoints), which tests/e2e/compose_stack.py checks on the live stack."""
    for name, svc in services.items():
        if name in ("postgres", "redis"):
            continue
        user = str(svc.get("user", ""))
        assert user and not user.startswith(("0", "root")), f"{name}: user {user!r}"
        if name.startswith(("airflow-", "ray-")):
            assert user == "${APP_UID:-50000}:0", f"{name}: user {user!r}"


def test_env_check_runs_before_every_service(services: dict[str, dict[str, Any]]) -> None:
    """Every service waits, directly or through what it waits for, for env-check to accept .env."""

    def waits_for_check(name: str, seen: frozenset[str] = frozenset()) -> bool:
        deps = services[name].get("depends_on") or {}
        if "env-check" in deps:
            return deps["env-check"]["condition"] == "service_completed_successfully"
        return any(waits_for_check(d, seen | {name}) for d in deps if d not in seen)

    late = [n for n in services if n != "env-check" and not waits_for_check(n)]
    assert not late, f"these services can start before env-check: {late}"


def test_no_literal_secrets_in_compose(services: dict[str, dict[str, Any]]) -> None:
    for name, svc in services.items():
        for key, value in _env(svc).items():
            if SECRET_NAME.search(key) and not key.endswith("_FILE"):
                assert value.startswith("${"), f"{name}: {key} must come from a variable, not a literal"
            m = re.search(r"://[^:/@\s]+:([^@]*)@", value)
            if m:
                assert m.group(1).startswith("${"), f"{name}: {key} embeds a literal password"


# -- .env.example and .gitignore -----------------------------------------------------------------
def test_env_is_gitignored() -> None:
    _require(GITIGNORE)
    lines = [ln.strip() for ln in GITIGNORE.read_text().splitlines()]
    patterns = [ln for ln in lines if ln and not ln.startswith("#")]
    assert ".env" in patterns or "/.env" in patterns, ".env must be listed in .gitignore"
    if "!.env.example" not in patterns:
        ignoring = [p for p in patterns if not p.startswith("!")]
        hiding = [p for p in ignoring if fnmatch.fnmatch(".env.example", p.lstrip("/"))]
        assert not hiding, f".gitignore would also hide .env.example: {hiding}"


def test_env_example_documents_every_variable() -> None:
    _require(COMPOSE_FILE)
    _require(ENV_EXAMPLE)
    used = _referenced_vars(COMPOSE_FILE.read_text()) | _referenced_vars(CPU_FILE.read_text())
    assert used, "docker-compose.yaml references no variables (secrets must come from .env)"
    documented = set(_env_example_assignments())
    missing = sorted(used - documented)
    assert not missing, f".env.example does not set: {missing}"


def test_env_example_holds_no_real_secrets() -> None:
    _require(ENV_EXAMPLE)
    for key, value in _env_example_assignments().items():
        if SECRET_NAME.search(key):
            assert value == "" or "CHANGE_ME" in value, f".env.example: {key} must be a placeholder"


def test_referenced_vars_helper() -> None:
    text = 'a: ${FOO:-x}\nb: "$${HOSTNAME}"\nc: $BAR\nd: $$$${BAZ} ${QUX:?err}'
    assert _referenced_vars(text) == {"FOO", "BAR", "QUX"}
    assert _split_short_volume("${A:-name}:/shared/data:ro") == ("${A:-name}", "/shared/data")
    assert _split_short_volume("/anon") == (None, "/anon")


# -- docker compose config -----------------------------------------------------------------------
def _compose_cli() -> list[str]:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker CLI on PATH")
    try:
        r = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"`docker compose version` failed: {e}")
    if r.returncode != 0:
        pytest.skip(f"no Compose v2 plugin: {(r.stderr or r.stdout).strip()[:200]}")
    return [docker, "compose"]


def _clean_env() -> dict[str, str]:
    """This process's environment without what would change the result of `compose config`."""
    documented = set(_env_example_assignments()) if ENV_EXAMPLE.is_file() else set()
    return {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_") and k not in documented}


def _run_config(env_file: Path, *args: str, files: tuple[Path, ...] | None = (COMPOSE_FILE,)) -> \
        subprocess.CompletedProcess[str]:
    """``docker compose [-f FILE...] --env-file ENV ARGS`` in the repository (files None: as the env file's
    COMPOSE_FILE says)."""
    cmd = [*_compose_cli(), *[a for f in files or () for a in ("-f", str(f))], "--project-directory", str(ROOT),
           "--env-file", str(env_file), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_clean_env(), cwd=ROOT)


@pytest.mark.parametrize("profile_args", [(), ("--profile", "celery")], ids=["default", "celery"])
def test_docker_compose_config_validates(tmp_path: Path, profile_args: tuple[str, ...]) -> None:
    _require(COMPOSE_FILE)
    _require(ENV_EXAMPLE)
    env_file = tmp_path / ".env"
    shutil.copyfile(ENV_EXAMPLE, env_file)
    r = _run_config(env_file, *profile_args, "config", "-q")
    assert r.returncode == 0, f"docker compose config -q failed:\n{r.stderr}"
    # The interpolated model too: loopback-only ports and the GPU reservations survive .env values.
    r = _run_config(env_file, *profile_args, "config", "--format", "json")
    assert r.returncode == 0, r.stderr
    resolved = json.loads(r.stdout)["services"]
    for name, svc in resolved.items():
        for port in svc.get("ports") or []:
            assert port.get("host_ip") == LOOPBACK, f"{name}: resolved port {port}"
    for name in ("ray-head", "ray-worker"):
        devices = resolved[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d.get("driver") == "nvidia" for d in devices), name
    if profile_args:
        assert CELERY_SERVICES <= set(resolved)
    else:
        assert not CELERY_SERVICES & set(resolved)


def test_docker_compose_requires_secrets(tmp_path: Path) -> None:
    _require(COMPOSE_FILE)
    _require(ENV_EXAMPLE)
    env_file = tmp_path / ".env"
    env_file.write_text("")
    r = _run_config(env_file, "config", "-q")
    assert r.returncode != 0, "compose accepted a config without any secret set"
    assert "required variable" in r.stderr and "missing a value" in r.stderr, r.stderr


def test_the_cpu_way_swaps_the_ray_image_and_drops_the_gpu_reservations(tmp_path: Path) -> None:
    """.env's COMPOSE_FILE line (as .env.example shows it) adds docker-compose.cpu.yaml: the Ray services run
    the CPU image with the head offering no CPU, reserve no GPU; everything else is the GPU way's."""
    _require(CPU_FILE)
    env_file = tmp_path / ".env"
    text = ENV_EXAMPLE.read_text()
    assert "\n# COMPOSE_FILE=docker-compose.yaml:docker-compose.cpu.yaml\n" in text
    env_file.write_text(text.replace("\n# COMPOSE_FILE=", "\nCOMPOSE_FILE="))
    r = _run_config(env_file, "config", "--format", "json", files=None)
    assert r.returncode == 0, r.stderr
    cpu = json.loads(r.stdout)["services"]
    r = _run_config(env_file, "config", "--format", "json")
    gpu = json.loads(r.stdout)["services"]
    for name in ("ray-head", "ray-worker"):
        assert cpu[name]["build"]["dockerfile"] == "docker/ray-cpu.Dockerfile", cpu[name]["build"]
        assert cpu[name]["image"] == "verl-pipeline/ray-cpu:local"
        assert not (cpu[name].get("deploy") or {}).get("resources"), cpu[name]["deploy"]
        assert "--num-gpus=0" in cpu[name]["command"]
        assert cpu[name]["environment"] == gpu[name]["environment"] and cpu[name]["volumes"] == gpu[name]["volumes"]
    assert "--num-cpus=0" in cpu["ray-head"]["command"] and cpu["ray-worker"]["deploy"]["replicas"] == 1
    assert {n: s for n, s in cpu.items() if not n.startswith("ray-")} == \
        {n: s for n, s in gpu.items() if not n.startswith("ray-")}


# -- the stack serves the pipeline's profiles --------------------------------------------------------
GPU_PROFILE = "gsm8k-qwen2.5-0.5b-ppo"


@pytest.mark.parametrize("profile", [STACK_PROFILE, GPU_PROFILE])
def test_every_path_a_run_writes_is_on_a_shared_mount(
    airflow_services: dict[str, dict[str, Any]], ray_services: dict[str, dict[str, Any]], profile: str
) -> None:
    """Data, model cache, checkpoints, run directory and the latest pointer of a run of the compose
    stack's profiles all land on volumes mounted at identical paths in Airflow and Ray containers."""
    from verl_pipeline import runs
    from verl_pipeline.profiles import build_run_spec

    spec = build_run_spec({"profile": profile}, run_name="verl_retrain__x/scheduled__1")
    assert str(spec.storage_root) == "/shared", spec.storage_root
    written = [spec.data_root, spec.model_cache, spec.checkpoint_dir, spec.run_dir, spec.metrics_path(1),
               spec.report_dir, runs.latest_link(spec.storage_root, spec.profile)]
    for name, svc in {**airflow_services, **ray_services}.items():
        mounted = [Path(t) for t, src in _mounts(svc).items() if src and t.startswith("/shared")]
        for path in written:
            assert any(path == m or m in path.parents for m in mounted), f"{name}: {path} is not on a shared mount"


@pytest.mark.parametrize("profile", [STACK_PROFILE, GPU_PROFILE])
def test_the_profiles_ray_connection_points_at_the_ray_head(
    services: dict[str, dict[str, Any]], airflow_services: dict[str, dict[str, Any]], profile: str
) -> None:
    from verl_pipeline.profiles import load_yaml_profile

    prof = load_yaml_profile("profiles", profile)
    cluster = load_yaml_profile("clusters", prof["cluster_profile"])["cluster"]
    assert cluster["backend"] == "address"
    var = f"AIRFLOW_CONN_{cluster['conn_id'].upper()}"
    head_cmd = " ".join(services["ray-head"]["command"])
    dash_port = int(re.search(r"--dashboard-port=(\d+)", head_cmd).group(1))  # type: ignore[union-attr]
    for name in AIRFLOW_RUNTIME_SERVICES:
        if name not in airflow_services:
            continue
        raw = _env(airflow_services[name]).get(var)
        assert raw, f"{name}: {var} not set (the DAG's address backend needs it)"
        conn = json.loads(_INTERPOLATION.sub("", raw))
        assert conn["host"] in services, f"{name}: {var} points at {conn['host']}, not a compose service"
        assert int(conn["port"]) == dash_port, f"{name}: {var} port {conn['port']} != dashboard {dash_port}"


def test_env_example_defaults_fit_the_stacks_profile() -> None:
    """A newcomer's run works with .env.example's values: the cluster profile `compose` waits for the nodes
    the stack starts (head + RAY_WORKER_REPLICAS workers), and the run profile's shape is the GPUs they get
    (RAY_HEAD_NUM_GPUS + RAY_WORKER_NUM_GPUS per worker); its nodes share the stack's volumes."""
    from verl_pipeline.profiles import build_run_spec, load_yaml_profile

    env = _env_example_assignments()
    workers = int(env["RAY_WORKER_REPLICAS"])
    cluster = load_yaml_profile("clusters", STACK_PROFILE)
    assert cluster["cluster"]["expected_nodes"] == 1 + workers, cluster["cluster"]
    assert cluster["cluster"]["expected_gpus"] == 0, "the CPU way has no GPU: expect nodes, not GPUs"
    spec = build_run_spec({"profile": STACK_PROFILE}, run_name="verl_ppo/manual__1")
    gpus = [int(env["RAY_HEAD_NUM_GPUS"])] + [int(env["RAY_WORKER_NUM_GPUS"])] * workers
    assert (spec.nnodes, spec.n_gpus_per_node) == (len(gpus), gpus[0]) and len(set(gpus)) == 1, (spec, gpus)
    assert str(spec.storage_root) == "/shared" and spec.shared_roots == ("/shared",)


# -- the images --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[d.name for d in DOCKERFILES])
def test_dockerfiles_build_offline_with_the_classic_builder(dockerfile: Path) -> None:
    """No BuildKit-only feature (the `# syntax=` frontend is fetched from a registry; RUN --mount and
    heredocs need BuildKit), the base image a build argument (a private registry or a local image), every
    pip install through docker/pip-install.sh (the package sources the build names), a non-root USER."""
    text = dockerfile.read_text()
    assert not re.search(r"^#\s*syntax\s*=", text, re.M | re.I), f"{dockerfile.name}: a BuildKit frontend line"
    assert "--mount" not in text and "<<" not in text, f"{dockerfile.name}: BuildKit-only syntax"
    base = re.search(r"^FROM\s+(\S+)", text, re.M)
    assert base and base.group(1).startswith("${"), f"{dockerfile.name}: FROM {base and base.group(1)}"
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert not re.search(r"\bpip install\b", code), f"{dockerfile.name}: pip install outside pip-install.sh"
    users = re.findall(r"^USER\s+(\S+)", text, re.M)
    assert users and users[-1] not in ("root", "0"), f"{dockerfile.name}: USER {users}"


def test_ray_images_share_the_pins() -> None:
    """One place for the pins of every Ray node image: the GPU file includes it, the CPU image installs it."""
    shared = ROOT / "requirements" / "ray-node.txt"
    pins = [ln for ln in shared.read_text().splitlines() if ln and not ln.startswith("#")]
    assert "verl==0.9.1" in pins and "ray[default]==2.60.0" in pins, pins
    gpu = [ln for ln in (ROOT / "requirements" / "gpu.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    assert "-r ray-node.txt" in gpu, gpu

    def versions(lines: list[str]) -> dict[str, str]:
        return {re.split(r"[\[=<>!~ ]", ln, maxsplit=1)[0]: ln.split("==", 1)[-1] for ln in lines if "==" in ln}

    shared_versions, gpu_versions = versions(pins), versions(gpu)
    assert all(gpu_versions[n] == v for n, v in shared_versions.items() if n in gpu_versions), (pins, gpu)
    assert "requirements/ray-node.txt" in (ROOT / "docker" / "ray-cpu.Dockerfile").read_text()


# -- docker/check_env.py -------------------------------------------------------------------------------
def _check_env() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("check_env", ROOT / "docker" / "check_env.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: Values as .env.example's commands make them (openssl rand, os.urandom), written down once.
GOOD_ENV = {
    "POSTGRES_PASSWORD": "2e448496365391befa3abc7b6daa72e8d0f9b2d4a918dd3e",
    "AIRFLOW_ADMIN_PASSWORD": "oTGhqm6epRNSiNGuM6amBLKN",
    "AIRFLOW_JWT_SECRET": "59376270b956da0ea19d0e5d954d69c04c92f47606eb2ff6474157dbf20727a8",
    "AIRFLOW_FERNET_KEY": "GAcY2Cti9EB88XwJy4ITVG083I0h7wId5M9qZl0eXKM=",
    "AIRFLOW_API_SECRET_KEY": "1915c8ca4dc0b4d44d18b508e23606f5a15a31106b9c05937ed3a68aeb62851d",
    "RAY_AUTH_TOKEN": "7f46eb5ef23843a73452d63230754a5ce459ae1b65891e9d27fbca81080a5511",
    "AIRFLOW_EXECUTOR": "LocalExecutor", "AIRFLOW_API_PORT": "8080",
    "RAY_DASHBOARD_PORT": "8265", "APP_UID": "50000", "RAY_WORKER_REPLICAS": "1", "COMPOSE_PROFILES": "",
}


def test_check_env_accepts_good_values_and_env_examples_defaults() -> None:
    check = _check_env()
    assert check.problems(GOOD_ENV) == []
    example = _env_example_assignments()
    defaults = {k: v for k, v in example.items() if k not in check.SECRETS}
    assert check.problems({**GOOD_ENV, **defaults}) == [], "a default of .env.example is refused"


@pytest.mark.parametrize(("name", "value", "words"), [
    ("RAY_AUTH_TOKEN", "CHANGE_ME_ray_auth_token", "placeholder"),
    ("RAY_AUTH_TOKEN", "short", "at least 32 characters"),
    ("RAY_AUTH_TOKEN", "x" * 40 + '"', "cannot carry"),
    ("POSTGRES_PASSWORD", "pa ss@word", "cannot carry"),
    ("AIRFLOW_FERNET_KEY", "not-a-key", "Fernet"),
    ("AIRFLOW_JWT_SECRET", "", "missing or empty"),
    ("AIRFLOW_JWT_SECRET", "s" * 63, "is 63 bytes; Airflow signs with HS512, whose key needs at least 64"),
    ("AIRFLOW_API_PORT", "80a", "whole number"),
    ("APP_UID", "0", "root"),
    ("AIRFLOW_EXECUTOR", "CeleryExecutor", "COMPOSE_PROFILES disagree"),
])
def test_check_env_refuses_a_wrong_value_in_one_line(name: str, value: str, words: str) -> None:
    """One line per problem, naming the variable (a secret's value masked), the rule and the fix."""
    found = _check_env().problems({**GOOD_ENV, name: value})
    assert len(found) == 1 and found[0].startswith(f"{name}=") and words in found[0] and "(fix: " in found[0], found
    if name in _check_env().SECRETS and value:
        assert value not in found[0], found


@pytest.mark.parametrize(("name", "value", "words"), [
    # Defaults a newcomer copies from other stacks, and values of the right size made by hand.
    ("POSTGRES_PASSWORD", "airflow", "is 7 long; it needs at least 16 characters"),
    ("AIRFLOW_ADMIN_PASSWORD", "admin", "is 5 long; it needs at least 12 characters"),
    ("AIRFLOW_FERNET_KEY", "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=", "repeats one byte"),
    ("AIRFLOW_JWT_SECRET", "a" * 64, "repeats one character"),
    ("AIRFLOW_API_SECRET_KEY", "x", "is 1 long; it needs at least 32 characters"),
    ("RAY_AUTH_TOKEN", "a" * 32, "repeats one character"),
    ("RAY_AUTH_TOKEN", "ab12" * 10, "repeats a pattern of 4 characters"),
    ("AIRFLOW_ADMIN_PASSWORD", "abcdefghijklmnop", "a run of characters in sequence"),
    ("POSTGRES_PASSWORD", "1122334455667711223344", "has only 7 different characters"),
    ("AIRFLOW_ADMIN_PASSWORD", "MyAirflow-2026!", "contains the word 'airflow'"),
    ("AIRFLOW_FERNET_KEY", "AAECAwQFBgcICQoLDA0ODxAREhMUFRYXGBkaGxwdHh8=", "a run of bytes in sequence"),
])
def test_check_env_refuses_a_weak_secret_in_one_line(name: str, value: str, words: str) -> None:
    """A secret of a guessable kind is refused like a wrong one: one line, the value masked, the fix."""
    found = _check_env().problems({**GOOD_ENV, name: value})
    assert len(found) == 1 and found[0].startswith(f"{name}='***'") and words in found[0], found
    assert "(fix: set it in .env: " in found[0] and (len(value) < 5 or value not in found[0]), found


def test_check_env_weakness_passes_what_the_fixes_make() -> None:
    """The commands of the fixes (what .env.example says to run) never make a value refused as weak."""
    import base64
    import secrets as random

    weakness = _check_env().weakness
    for _ in range(500):
        made = (random.token_hex(24), random.token_urlsafe(18), random.token_hex(32), os.urandom(32))
        assert [weakness(v) for v in made] == [None] * 4, made
    fernet = base64.urlsafe_b64encode(os.urandom(32)).decode()
    assert _check_env().problems({**GOOD_ENV, "AIRFLOW_FERNET_KEY": fernet}) == []


def test_check_env_refuses_one_value_for_two_secrets() -> None:
    found = _check_env().problems({**GOOD_ENV, "AIRFLOW_API_SECRET_KEY": GOOD_ENV["AIRFLOW_JWT_SECRET"]})
    assert found == ["AIRFLOW_API_SECRET_KEY='***': is the value of AIRFLOW_JWT_SECRET too: each secret needs its "
                     "own (fix: set it in .env: openssl rand -hex 32)"], found


def test_check_env_refuses_every_placeholder_of_env_example(tmp_path: Path) -> None:
    env_file = tmp_path / ".env"
    shutil.copyfile(ENV_EXAMPLE, env_file)
    r = subprocess.run([sys.executable, str(ROOT / "docker" / "check_env.py"), "--env-file", str(env_file)],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1 and len(lines) == len(_check_env().SECRETS), r.stderr
    assert all("CHANGE_ME placeholder" in ln for ln in lines), lines
