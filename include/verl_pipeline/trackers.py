"""The user's experiment trackers: which verl logs to, and the credentials each needs.

verl logs every step through ``verl.utils.tracking.Tracking`` to the backends listed in
``trainer.logger``. The pipeline keeps the user's list and adds what it reads itself: ``file``
(one JSON line per step at ``$VERL_FILE_LOGGER_PATH``, the run's metrics) and ``console`` (the job
log's metric lines: progress and the hang watchdog when the triggerer cannot read the file).

Trackers that need credentials get them from Airflow connections, never from a profile:

==========  ==================  =================================================================
tracker     connection          variables of the job
==========  ==================  =================================================================
``wandb``   ``wandb_default``   password → ``WANDB_API_KEY``; host → ``WANDB_BASE_URL`` when set
``mlflow``  ``mlflow_default``  schema://host:port → ``MLFLOW_TRACKING_URI``; login / password →
                                ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD``
==========  ==================  =================================================================

The connection ids can be changed in the run profile (``trackers: {mlflow: {conn_id: my_mlflow}}``).
The values join the job only in the submit call, through a 0600 file that Ray's
``worker_process_setup_hook`` loads in every worker (:func:`with_secret_env`): they are in no
rendered job, ``runtime_env``, run file (but that one), XCom or log line.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any
from urllib.parse import quote, urlsplit

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.registry import KEY as REGISTRY_KEY
from verl_pipeline.registry import RegistrySettings

log = logging.getLogger(__name__)

LOGGER_KEY = "trainer.logger"
#: The run profile's section naming the connection of each tracker.
SECTION = "trackers"
#: What the pipeline itself reads, added to every job's ``trainer.logger`` (see the module doc).
PIPELINE_BACKENDS = ("console", "file")
#: verl's own module whose ``Tracking.supported_backend`` lists the backends of the installed verl.
_VERL_TRACKING = ("verl", "utils", "tracking.py")


class Tracker(str, Enum):
    """The trackers whose credentials come from an Airflow connection."""

    WANDB = "wandb"
    MLFLOW = "mlflow"

    @property
    def default_conn_id(self) -> str:
        return f"{self.value}_default"


@functools.cache
def verl_tracking() -> Any:
    """verl's own ``verl.utils.tracking`` module (``Tracking``, ``FileLogger`` …) of the installed verl.

    Loaded from its file, not through ``import verl`` (whose ``__init__`` imports torch and
    tensordict: ~10 s on a busy machine to read a list of names). Its backends import what they need
    when a ``Tracking`` is created; ``console`` imports verl's logger package, and with it torch.
    """
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec(_VERL_TRACKING[0])
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(LOGGER_KEY, None, "verl is not installed on this Airflow worker",
                          "pip install verl==0.9.1 (the lock's version)")
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*_VERL_TRACKING[1:])
    module_spec = importlib.util.spec_from_file_location("_verl_pipeline_verl_tracking", path)
    assert module_spec is not None and module_spec.loader is not None  # a file path always gives a spec
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def supported_backends() -> tuple[str, ...]:
    """``Tracking.supported_backend`` of the installed verl."""
    return tuple(str(b) for b in verl_tracking().Tracking.supported_backend)


def logger_backends(value: Any, *, key: str = LOGGER_KEY) -> list[str]:
    """The job's ``trainer.logger``: the user's backends in their order, then those the pipeline reads.

    ``value`` is the run's setting (profile, ``--set``, ``verl_overrides``): a list, a single name,
    or None (not set: only the pipeline's own). A backend verl's ``Tracking`` does not support is a
    ConfigError naming it.
    """
    if value is None or value == "":
        chosen: list[str] = []
    elif isinstance(value, str):
        chosen = [value]
    elif isinstance(value, list | tuple) and all(isinstance(v, str) and v for v in value):
        chosen = list(value)
    else:
        raise ConfigError(key, value, "must be a list of tracker names", f"{key}=[console,wandb]")
    supported = supported_backends()
    for name in chosen:
        if name not in supported:
            raise ConfigError(key, value, f"verl's Tracking does not support {name!r}",
                              f"use only {', '.join(supported)}, e.g. {key}=[console,mlflow]")
    return list(dict.fromkeys([*chosen, *PIPELINE_BACKENDS]))


def chosen_trackers(backends: list[str]) -> list[Tracker]:
    """The trackers among ``backends`` that need credentials from a connection."""
    return [Tracker(b) for b in backends if b in Tracker._value2member_map_]


#: What each tracker's entry in the run profile's ``trackers:`` section takes.
_ENTRY_KEYS = {Tracker.WANDB: ("conn_id",), Tracker.MLFLOW: ("conn_id", REGISTRY_KEY)}


@dataclass(frozen=True)
class TrackerSettings:
    """The run profile's ``trackers:`` section: which Airflow connection holds each tracker's credentials, and
    the model registry on the MLflow server (its ``mlflow`` entry's ``registry``; None: no model is registered)."""

    conn_ids: dict[str, str] = field(default_factory=dict)
    registry: RegistrySettings | None = None

    def conn_id(self, tracker: Tracker) -> str:
        return self.conn_ids.get(tracker.value, tracker.default_conn_id)

    @classmethod
    def from_profile(cls, section: Any, profile: str) -> TrackerSettings:
        if section is None:
            return cls()
        where = f"profiles/{profile}.{SECTION}"
        if not isinstance(section, Mapping):
            raise ConfigError(where, section, "must be a mapping of tracker to settings",
                              "trackers: {mlflow: {conn_id: mlflow_default}}")
        conn_ids, registry = {}, None
        for name, entry in section.items():
            conn_id = _entry_conn_id(name, entry, where)
            if conn_id is not None:
                conn_ids[name] = conn_id
            if name == Tracker.MLFLOW.value:
                registry = RegistrySettings.from_profile(
                    entry.get(REGISTRY_KEY), where=f"{where}.{name}.{REGISTRY_KEY}", profile=profile)
        return cls(conn_ids, registry)

    def to_dict(self) -> dict[str, Any]:
        """As the run profile's section spells it: ``{tracker: {conn_id: ..., registry: {...}}}``."""
        out: dict[str, dict[str, Any]] = {name: {"conn_id": conn_id} for name, conn_id in self.conn_ids.items()}
        if self.registry is not None:
            out.setdefault(Tracker.MLFLOW.value, {})[REGISTRY_KEY] = self.registry.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrackerSettings:
        """What :meth:`to_dict` wrote."""
        registry = (data.get(Tracker.MLFLOW.value) or {}).get(REGISTRY_KEY)
        return cls({name: entry["conn_id"] for name, entry in data.items() if "conn_id" in entry},
                   None if registry is None else RegistrySettings.from_dict(registry))


def _entry_conn_id(name: Any, entry: Any, where: str) -> str | None:
    """The connection id a tracker's entry of the ``trackers:`` section names (None: the default's)."""
    if name not in Tracker._value2member_map_:
        raise ConfigError(f"{where}.{name}", entry, "no connection settings for this tracker",
                          f"one of {[t.value for t in Tracker]}")
    tracker = Tracker(name)
    keys = _ENTRY_KEYS[tracker]
    if not isinstance(entry, Mapping) or set(entry) - set(keys):
        raise ConfigError(f"{where}.{name}", entry, f"takes only {' and '.join(keys)}",
                          f"{name}: {{conn_id: {tracker.default_conn_id}}}")
    if not entry:
        raise ConfigError(f"{where}.{name}", entry, f"sets nothing: it takes {' and '.join(keys)}",
                          f"{name}: {{conn_id: {tracker.default_conn_id}}}, or leave {name} out")
    if "conn_id" not in entry:
        return None
    conn_id = entry["conn_id"]
    if not isinstance(conn_id, str) or not conn_id:
        raise ConfigError(f"{where}.{name}.conn_id", conn_id, "must be an Airflow connection id",
                          f"conn_id: {tracker.default_conn_id}")
    return conn_id


@dataclass(frozen=True)
class TrackerEnv:
    """The variables a job's trackers need. ``secret`` names those never to show (:meth:`shown`)."""

    values: dict[str, str] = field(default_factory=dict)
    secret: frozenset[str] = frozenset()

    def __repr__(self) -> str:  # a stray log of the object shows no secret
        return f"TrackerEnv({self.shown()})"

    def shown(self) -> dict[str, str]:
        """The variables as a log may show them: secrets as ``***``."""
        return {k: "***" if k in self.secret else v for k, v in self.values.items()}

    def merged(self, other: TrackerEnv) -> TrackerEnv:
        return TrackerEnv({**self.values, **other.values}, self.secret | other.secret)


def _url(conn: Any, *, conn_id: str, default_scheme: str) -> str:
    """``schema://host:port`` of a connection (``host`` may already be a URL)."""
    host = str(conn.host).strip().rstrip("/")
    base = host if "://" in host else f"{conn.schema or default_scheme}://{host}"
    parts = urlsplit(base)
    if parts.username or parts.password:
        raise ConfigError(f"connections.{conn_id}.host", "***", "credentials in the address would be shown in "
                          "task logs", "put them in the connection's login and password fields")
    if conn.port and parts.port is None:
        base = f"{parts.scheme}://{parts.netloc}:{conn.port}{parts.path}"
    return base


def connection_env(tracker: Tracker, conn: Any, conn_id: str) -> TrackerEnv:
    """The variables of ``tracker`` from its Airflow connection ``conn``."""
    if tracker is Tracker.WANDB:
        if not conn.password:
            raise ConfigError(f"connections.{conn_id}.password", None, "W&B needs its API key as the connection's "
                              "password", f"airflow connections add {conn_id} --conn-type http "
                              "--conn-password <W&B API key> [--conn-host https://wandb.example.com]")
        values = {"WANDB_API_KEY": str(conn.password)}
        if conn.host:
            values["WANDB_BASE_URL"] = _url(conn, conn_id=conn_id, default_scheme="https")
        return TrackerEnv(values, frozenset({"WANDB_API_KEY"}))
    if not conn.host:
        raise ConfigError(f"connections.{conn_id}.host", None, "MLflow needs its tracking server's address as the "
                          "connection's host", f"airflow connections add {conn_id} --conn-type http "
                          "--conn-host mlflow.example.com --conn-port 5000 --conn-schema https")
    values = {"MLFLOW_TRACKING_URI": _url(conn, conn_id=conn_id, default_scheme="http")}
    secret = set()
    if conn.login:
        values["MLFLOW_TRACKING_USERNAME"] = str(conn.login)
        secret.add("MLFLOW_TRACKING_USERNAME")
    if conn.password:
        values["MLFLOW_TRACKING_PASSWORD"] = str(conn.password)
        secret.add("MLFLOW_TRACKING_PASSWORD")
    return TrackerEnv(values, frozenset(secret))


def tracker_env(backends: list[str], settings: TrackerSettings, lookup: Callable[[str], Any | None]) -> TrackerEnv:
    """The variables of every tracker in ``backends``, from the connections ``lookup`` returns
    (None: no such connection, a ConfigError naming it)."""
    env = TrackerEnv()
    for tracker in chosen_trackers(backends):
        conn_id = settings.conn_id(tracker)
        conn = lookup(conn_id)
        if conn is None:
            raise ConfigError(f"{SECTION}.{tracker.value}.conn_id", conn_id,
                              f"no such Airflow connection, and {LOGGER_KEY}={backends} logs to {tracker.value}",
                              f"create the connection {conn_id!r}, name another one in the run profile's "
                              f"{SECTION}.{tracker.value}.conn_id, or leave {tracker.value} out of {LOGGER_KEY}")
        env = env.merged(connection_env(tracker, conn, conn_id))
    return env


def registry_env(settings: TrackerSettings, lookup: Callable[[str], Any | None]) -> TrackerEnv | None:
    """The MLflow server of the run profile's model registry (``settings.registry``) from the MLflow connection
    ``lookup`` returns; None when the profile names no registry. A missing connection is a ConfigError naming it."""
    if settings.registry is None:
        return None
    conn_id = settings.conn_id(Tracker.MLFLOW)
    conn = lookup(conn_id)
    if conn is None:
        where = f"{SECTION}.{Tracker.MLFLOW.value}"
        raise ConfigError(f"{where}.conn_id", conn_id, f"no such Airflow connection, and the run profile registers "
                          f"its model as {settings.registry.model_name!r} on MLflow ({where}.{REGISTRY_KEY})",
                          f"create the connection {conn_id!r}, name another one in {where}.conn_id, or remove "
                          f"{where}.{REGISTRY_KEY}")
    return connection_env(Tracker.MLFLOW, conn, conn_id)


def exposure_problem(env: TrackerEnv, auth_mode: str, *, dashboard_url: str) -> ConfigError | None:
    """Refuse tracker credentials for a cluster whose Jobs API anyone can use (auth disabled): it runs
    whatever it is sent as the cluster's user, who can read the job's credentials file."""
    if not env.secret or auth_mode != "disabled":
        return None
    return ConfigError("cluster.auth_mode", auth_mode,
                       f"the job's tracker credentials ({', '.join(sorted(env.secret))}) would be readable by "
                       f"anyone who can reach the Jobs API at {dashboard_url}: without auth it runs their code as "
                       "the user that reads the job's credentials file",
                       "run on a cluster with auth_mode: token, or leave the tracker out of trainer.logger")


@dataclass(frozen=True)
class MlflowRun:
    """A run on an MLflow server: its ids and its page in MLflow's UI."""

    experiment_id: str
    run_id: str
    url: str


#: verl's Tracking attaches to this MLflow run instead of creating one (``mlflow.start_run(run_id=…)``).
MLFLOW_RUN_VAR = "MLFLOW_RUN_ID"


def mlflow_run(env: TrackerEnv, *, experiment_name: str, run_name: str, timeout_s: float = 10.0) -> MlflowRun | None:
    """The MLflow run of a pipeline run, through MLflow's REST API: the newest run named ``run_name``
    in the experiment ``experiment_name`` (verl's ``trainer.experiment_name`` and
    ``trainer.project_name``), else a new one (and the experiment, when missing).

    Passed to the job as ``MLFLOW_RUN_ID``, every attempt of the run (retries, resumes) logs to this
    one run, and its page is known before the job starts. None (logged) when the server cannot be
    asked: verl then creates the run itself, and no link is shown.
    """
    import requests

    uri = env.values.get("MLFLOW_TRACKING_URI", "").rstrip("/")
    if not uri.startswith(("http://", "https://")):
        return None  # a local store (sqlite:, file:) has no UI address
    user, password = env.values.get("MLFLOW_TRACKING_USERNAME"), env.values.get("MLFLOW_TRACKING_PASSWORD")
    session = requests.Session()
    if user or password:
        session.auth = (user or "", password or "")
    api = f"{uri}/api/2.0/mlflow"

    def call(method: str, path: str, **kwargs: Any) -> Any:
        r = session.request(method, f"{api}/{path}", timeout=timeout_s, **kwargs)
        if r.status_code == 404 or (r.status_code == 400 and "ALREADY_EXISTS" in r.text):
            return None
        r.raise_for_status()
        return r.json()

    try:
        found = call("GET", "experiments/get-by-name", params={"experiment_name": experiment_name})
        if found is None:  # a first run of this project (a concurrent run may create it first)
            call("POST", "experiments/create", json={"name": experiment_name})
            found = call("GET", "experiments/get-by-name", params={"experiment_name": experiment_name})
        experiment_id = str(found["experiment"]["experiment_id"])
        quoted = run_name.replace("\\", "\\\\").replace("'", "\\'")
        runs = (call("POST", "runs/search", json={
            "experiment_ids": [experiment_id], "filter": f"attributes.run_name = '{quoted}'",
            "order_by": ["attributes.start_time DESC"], "max_results": 1}) or {}).get("runs") or []
        if runs:
            run_id = str(runs[0]["info"]["run_id"])
        else:
            import time

            created = call("POST", "runs/create", json={
                "experiment_id": experiment_id, "run_name": run_name, "start_time": int(time.time() * 1000),
                "tags": [{"key": "mlflow.runName", "value": run_name}]})
            run_id = str(created["run"]["info"]["run_id"])
    except (requests.RequestException, KeyError, TypeError, ValueError) as e:
        log.warning("MLflow at %s: cannot find or create run %s of experiment %s (%s): verl will create it, and "
                    "no link is shown", uri, run_name, experiment_name, type(e).__name__)
        return None
    finally:
        session.close()
    return MlflowRun(experiment_id, run_id, f"{uri}/#/experiments/{quote(experiment_id)}/runs/{quote(run_id)}")


#: The job's variable naming its tracker-credentials file (a path: safe in the runtime_env).
ENV_FILE_VAR = "VERL_PIPELINE_TRACKER_ENV_FILE"
#: Ray runs this in every worker process of the job before its tasks and actors (verl's TaskRunner,
#: which creates verl's ``Tracking``): it loads the credentials file into the process environment.
SETUP_HOOK = "verl_pipeline.trackers.load_env_file"


def with_secret_env(runtime_env: Mapping[str, Any], values: Mapping[str, str], *, directory: Any,
                    name: str) -> dict[str, Any]:
    """``runtime_env`` that gives every worker of the job ``values`` without carrying them.

    Ray writes a job's ``runtime_env`` into its session logs (``runtime_env_agent.log``) and the
    Jobs API returns it to anyone who can read the job: the values go to ``directory/name`` (0600,
    in a 0700 directory, on the storage every node mounts), and the runtime_env carries its path
    (``VERL_PIPELINE_TRACKER_ENV_FILE``) and Ray's ``worker_process_setup_hook`` that loads it.
    """
    import copy
    import json
    import os
    from pathlib import Path

    from verl_pipeline.auth import private_dir
    from verl_pipeline.paths import atomic_path

    path = private_dir(Path(directory)) / name
    with atomic_path(path) as tmp:  # mkstemp: created 0600
        tmp.write_text(json.dumps(dict(values)))
        os.chmod(tmp, 0o600)
    out = copy.deepcopy(dict(runtime_env))
    out.setdefault("env_vars", {})[ENV_FILE_VAR] = str(path)
    out["worker_process_setup_hook"] = SETUP_HOOK
    return out


def load_env_file() -> None:
    """Ray's ``worker_process_setup_hook`` of a job with tracker credentials: the variables of the
    file ``$VERL_PIPELINE_TRACKER_ENV_FILE`` names join this process's environment."""
    import json
    import os

    path = os.environ.get(ENV_FILE_VAR)
    if not path:
        return
    with open(path, encoding="utf-8") as f:
        values = json.load(f)
    os.environ.update({str(k): str(v) for k, v in values.items()})


__all__ = [
    "ENV_FILE_VAR",
    "LOGGER_KEY",
    "MLFLOW_RUN_VAR",
    "PIPELINE_BACKENDS",
    "SECTION",
    "SETUP_HOOK",
    "MlflowRun",
    "Tracker",
    "TrackerEnv",
    "TrackerSettings",
    "chosen_trackers",
    "connection_env",
    "exposure_problem",
    "load_env_file",
    "logger_backends",
    "mlflow_run",
    "supported_backends",
    "tracker_env",
    "verl_tracking",
    "with_secret_env",
]
