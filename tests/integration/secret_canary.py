"""Secret canaries: unique fake secrets planted where the pipeline reads secrets, then searched for
everywhere a run leaves text behind.

Plant with :func:`plant_connections` (REST API v2 of a running stack) or :func:`connection_env`
(``AIRFLOW_CONN_*`` variables, for ``dag.test()``); after the run, :func:`find_leaks` searches
task and component logs, the metadata tables a run writes (XCom, trigger, task instances …),
every file of the run directories and of the Ray cluster's temp dir, the Ray jobs' info and logs
through the Jobs API (while the cluster is up: :func:`jobs_api_leaks`), and ``verl-pipeline render
--json``. Each cluster's real Ray token (read from its token file, whose path is in the handle) is
searched for too. A masked value (``***``) is not a leak: only the exact value is looked for.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: Metadata tables a run writes (the ``connection`` table holds the canaries on purpose).
RUN_TABLES = ("xcom", "trigger", "task_instance", "task_instance_history", "rendered_task_instance_fields",
              "dag_run", "log", "asset_event", "job")
#: Files that hold a secret by design: the token files themselves, and a run's private folder of
#: tracker credentials (``<run dir>/secrets/``, 0700, files 0600: verl_pipeline.trackers.with_secret_env).
_TOKEN_FILE_NAME = "ray_auth_token"
_SECRETS_DIR_NAME = "secrets"
_MAX_FILE_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Leak:
    """One place a secret was found: which secret (by name, never its value) and where."""

    secret: str
    where: str

    def __str__(self) -> str:
        return f"{self.secret} in {self.where}"


def new_canaries() -> dict[str, str]:
    """A unique value per secret the pipeline reads from Airflow connections."""
    return {name: f"vpcanary-{name.replace('.', '-')}-{secrets.token_hex(12)}"
            for name in ("hf_default.password", "ray_default.password", "kubernetes_default.kube_config")}


def _connections(canaries: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    return {
        # The hub token the prefetch task reads (PrefetchModelOperator, hf_conn_id).
        "hf_default": {"conn_type": "http", "password": canaries["hf_default.password"]},
        # The Ray token of an address-backend cluster (never read for a local cluster: its handle has no conn_id).
        "ray_default": {"conn_type": "http", "host": "127.0.0.1", "port": 9,
                        "password": canaries["ray_default.password"]},
        # The KubeRay backend's cluster credentials.
        "kubernetes_default": {"conn_type": "kubernetes",
                               "extra": json.dumps({"kube_config": canaries["kubernetes_default.kube_config"]})},
    }


def plant_connections(api: Any, canaries: Mapping[str, str]) -> None:
    """Create (or replace) the connections holding the canaries through Airflow's REST API v2.

    ``api``: an httpx client with the stack's base URL and a bearer token (``AirflowStack.client()``).
    """
    for conn_id, fields in _connections(canaries).items():
        api.delete(f"/api/v2/connections/{conn_id}")
        r = api.post("/api/v2/connections", json={"connection_id": conn_id, **fields})
        if r.status_code not in (200, 201):
            raise RuntimeError(f"creating connection {conn_id} failed: {r.status_code} {r.text[:300]}")


def connection_env(canaries: Mapping[str, str]) -> dict[str, str]:
    """The same connections as ``AIRFLOW_CONN_*`` variables (JSON), for processes started with them."""
    return {f"AIRFLOW_CONN_{conn_id.upper()}": json.dumps(fields) for conn_id, fields in _connections(canaries).items()}


def ray_token(handle: Mapping[str, Any]) -> str | None:
    """The real Ray token of a cluster the pipeline started (a handle dict, e.g. the provision XCom)."""
    path = handle.get("token_file")
    if not path or not Path(path).is_file():
        return None
    return Path(path).read_text().strip() or None


def scan_text(text: str, secrets_by_name: Mapping[str, str], where: str) -> list[Leak]:
    return [Leak(name, where) for name, value in secrets_by_name.items() if value and value in text]


def scan_files(roots: Iterable[Path], secrets_by_name: Mapping[str, str]) -> list[Leak]:
    """Every regular file under ``roots`` (symlinks not followed; token files skipped)."""
    needles = {name: value.encode() for name, value in secrets_by_name.items() if value}
    leaks: list[Leak] = []
    for root in roots:
        root = Path(root)
        files = [root] if root.is_file() else (p for p in root.rglob("*") if p.is_file() and not p.is_symlink())
        for path in files:
            if path.name == _TOKEN_FILE_NAME or path.parent.name == _SECRETS_DIR_NAME:
                continue
            try:
                with open(path, "rb") as f:
                    data = f.read(_MAX_FILE_BYTES)
            except OSError:  # a socket, or a file removed while scanning
                continue
            leaks += [Leak(name, str(path)) for name, value in needles.items() if value in data]
    return leaks


def scan_database(db_url: str, secrets_by_name: Mapping[str, str], tables: Iterable[str] = RUN_TABLES) -> list[Leak]:
    """Every row of ``tables`` (those that exist), each row rendered as text by PostgreSQL (``t::text``)."""
    from sqlalchemy import create_engine, inspect, text

    engine = create_engine(db_url)
    leaks: list[Leak] = []
    try:
        with engine.connect() as conn:
            present = set(inspect(conn).get_table_names())
            for table in tables:
                if table not in present:
                    continue
                for (row,) in conn.execute(text(f'SELECT t::text FROM "{table}" AS t')):
                    leaks += scan_text(str(row), secrets_by_name, f"table {table}")
    finally:
        engine.dispose()
    return sorted(set(leaks), key=str)


def jobs_api_leaks(handle: Mapping[str, Any], secrets_by_name: Mapping[str, str]) -> list[Leak]:
    """Every job's info (entrypoint, runtime_env, metadata …) and whole log, read through the Jobs
    API with the cluster's token: call it while the cluster is up."""
    import requests

    from verl_pipeline.cluster.base import ClusterHandle

    h = ClusterHandle.from_dict(dict(handle))
    client = h.client()
    r = requests.get(f"{client.dashboard_url}/api/jobs/", headers=client.headers, timeout=30, verify=client.verify)
    r.raise_for_status()
    leaks = scan_text(r.text, secrets_by_name, f"{client.dashboard_url}/api/jobs/")
    for job in r.json():
        sub_id = job.get("submission_id")
        if not sub_id:  # a driver connected with ray.init (type DRIVER): the Jobs API serves no log of it
            continue
        leaks += scan_text(client.logs(sub_id), secrets_by_name, f"Jobs API logs of {sub_id}")
    return leaks


def render_leaks(env: Mapping[str, str], secrets_by_name: Mapping[str, str], args: Iterable[str] = ()) -> list[Leak]:
    """``verl-pipeline render --json`` (the exact job that would be submitted) in ``env``."""
    cmd = [sys.executable, "-m", "verl_pipeline", "render", "--json", "--no-verl-check", *args]
    out = subprocess.run(cmd, env=dict(env), capture_output=True, text=True, timeout=300)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({out.returncode}): {out.stderr[-1500:]}")
    return scan_text(out.stdout + out.stderr, secrets_by_name, "verl-pipeline render --json")


def find_leaks(
    secrets_by_name: Mapping[str, str],
    *,
    log_dirs: Iterable[Path] = (),
    run_dirs: Iterable[Path] = (),
    clusters: Iterable[Mapping[str, Any]] = (),
    db_url: str | None = None,
    render_env: Mapping[str, str] | None = None,
    render_args: Iterable[str] = (),
    live_clusters: Iterable[Mapping[str, Any]] = (),
) -> list[Leak]:
    """Where any of ``secrets_by_name`` (canaries, plus each cluster's Ray token) appears.

    ``clusters``: handle dicts of the run's clusters; their Ray tokens join the secrets and their
    temp dirs (Ray's session logs, the driver logs included) are scanned. ``live_clusters``: handles
    whose Jobs API is still up (job info and logs are read through it).
    """
    clusters = list(clusters)
    live_clusters = list(live_clusters)
    wanted = dict(secrets_by_name)
    for handle in clusters + live_clusters:
        token = ray_token(handle)
        if token:
            wanted[f"ray token of {handle.get('name')}"] = token
    roots = [*log_dirs, *run_dirs]
    roots += [Path(h["extra"]["temp_dir"]) for h in clusters if (h.get("extra") or {}).get("temp_dir")]
    leaks = scan_files([r for r in roots if Path(r).exists()], wanted)
    if db_url:
        leaks += scan_database(db_url, wanted)
    for handle in live_clusters:
        leaks += jobs_api_leaks(handle, wanted)
    if render_env is not None:
        leaks += render_leaks(render_env, wanted, render_args)
    return sorted(set(leaks), key=str)


def stack_log_dirs(stack: Any) -> list[Path]:
    """An :class:`AirflowStack`'s task logs (``AIRFLOW_HOME/logs``) and component logs (the triggerer's too)."""
    return [Path(stack.home) / "logs", Path(stack.log_path("triggerer")).parent]


__all__ = ["Leak", "connection_env", "find_leaks", "jobs_api_leaks", "new_canaries", "plant_connections",
           "ray_token", "render_leaks", "scan_database", "scan_files", "scan_text", "stack_log_dirs"]
