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
The variables join the job's ``runtime_env`` only in the submit call (:class:`TrackerEnv`): they
are in no rendered job, run file, XCom or log line.
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
def supported_backends() -> tuple[str, ...]:
    """``Tracking.supported_backend`` of the installed verl.

    verl's module is loaded from its file, not through ``import verl`` (whose ``__init__`` imports
    torch and tensordict: ~10 s on a busy worker for a list of names).
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
    return tuple(str(b) for b in module.Tracking.supported_backend)


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


@dataclass(frozen=True)
class TrackerSettings:
    """The run profile's ``trackers:`` section: which Airflow connection holds each tracker's credentials."""

    conn_ids: dict[str, str] = field(default_factory=dict)

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
        conn_ids = {}
        for name, entry in section.items():
            if name not in Tracker._value2member_map_:
                raise ConfigError(f"{where}.{name}", entry, "no connection settings for this tracker",
                                  f"one of {[t.value for t in Tracker]}")
            if not isinstance(entry, Mapping) or set(entry) - {"conn_id"}:
                raise ConfigError(f"{where}.{name}", entry, "takes only conn_id",
                                  f"{name}: {{conn_id: {Tracker(name).default_conn_id}}}")
            conn_id = entry.get("conn_id")
            if not isinstance(conn_id, str) or not conn_id:
                raise ConfigError(f"{where}.{name}.conn_id", conn_id, "must be an Airflow connection id",
                                  f"conn_id: {Tracker(name).default_conn_id}")
            conn_ids[name] = conn_id
        return cls(conn_ids)

    def to_dict(self) -> dict[str, Any]:
        return {name: {"conn_id": conn_id} for name, conn_id in self.conn_ids.items()}


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


def exposure_problem(env: TrackerEnv, auth_mode: str, *, dashboard_url: str) -> ConfigError | None:
    """Refuse tracker credentials for a cluster whose Jobs API anyone can read (auth disabled):
    the Jobs API returns a job's ``runtime_env``, the credentials included."""
    if not env.secret or auth_mode != "disabled":
        return None
    return ConfigError("cluster.auth_mode", auth_mode,
                       f"the job's tracker credentials ({', '.join(sorted(env.secret))}) would be readable by "
                       f"anyone who can reach the Jobs API at {dashboard_url} (it returns the job's runtime_env)",
                       "run on a cluster with auth_mode: token, or leave the tracker out of trainer.logger")


def mlflow_run_url(env: TrackerEnv, *, experiment_name: str, run_name: str, timeout_s: float = 10.0) -> str | None:
    """The MLflow UI page of the newest run named ``run_name`` in the experiment ``experiment_name``
    (verl's ``trainer.project_name`` and ``trainer.experiment_name``), found through MLflow's REST
    API; None when the server has no such run or cannot be asked."""
    import requests

    uri = env.values.get("MLFLOW_TRACKING_URI", "")
    if not uri.startswith(("http://", "https://")):
        return None  # a local store (sqlite:, file:) has no UI address
    user, password = env.values.get("MLFLOW_TRACKING_USERNAME"), env.values.get("MLFLOW_TRACKING_PASSWORD")
    auth = (user or "", password or "") if user or password else None
    api = f"{uri.rstrip('/')}/api/2.0/mlflow"
    try:
        r = requests.get(f"{api}/experiments/get-by-name", params={"experiment_name": experiment_name},
                         auth=auth, timeout=timeout_s)
        if r.status_code == 404:
            return None
        r.raise_for_status()
        experiment_id = str(r.json()["experiment"]["experiment_id"])
        quoted = run_name.replace("\\", "\\\\").replace("'", "\\'")
        r = requests.post(f"{api}/runs/search", auth=auth, timeout=timeout_s,
                          json={"experiment_ids": [experiment_id], "filter": f"attributes.run_name = '{quoted}'",
                                "order_by": ["attributes.start_time DESC"], "max_results": 1})
        r.raise_for_status()
        runs = r.json().get("runs") or []
    except (requests.RequestException, KeyError, ValueError) as e:
        log.warning("MLflow at %s: cannot look up run %s of experiment %s: %s", uri, run_name, experiment_name,
                    type(e).__name__)
        return None
    if not runs:
        return None
    run_id = str(runs[0]["info"]["run_id"])
    return f"{uri.rstrip('/')}/#/experiments/{quote(experiment_id)}/runs/{quote(run_id)}"


__all__ = ["LOGGER_KEY", "PIPELINE_BACKENDS", "SECTION", "Tracker", "TrackerEnv", "TrackerSettings",
           "chosen_trackers", "connection_env", "exposure_problem", "logger_backends", "mlflow_run_url",
           "supported_backends", "tracker_env"]
