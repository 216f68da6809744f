"""The backend lifecycle every cluster kind implements, and the readiness gate they share."""

from __future__ import annotations

import abc
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.auth import PIPELINE_TOKEN_VAR, AuthMode, read_token_file
from verl_pipeline.exceptions import ClusterError
from verl_pipeline.jobs.client import RayJobsClient

log = logging.getLogger(__name__)

#: Cluster-profile settings every backend accepts: read by the submit step, not by the backend
#: (``probe_timeout_s``: seconds each node has for the environment probe, :mod:`verl_pipeline.cluster.probe`).
COMMON_SETTINGS = ("probe_timeout_s",)
#: What every Ray node the pipeline starts runs with, whatever the backend: no usage reports to Ray's
#: servers (nothing of a run leaves the site, and a site's nodes may have no way out).
RAY_NODE_ENV = {"RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class ClusterHandle:
    """Everything needed to reach (and, when owned, tear down) a provisioned cluster.

    It travels through XCom, a trigger's kwargs and a state file, so it holds no secret: the token
    of a token-auth cluster is read, when needed, from the explicit argument (an Airflow
    connection's password), else ``token_file`` (written 0600 by the backend that started the
    cluster), else ``$VERL_PIPELINE_RAY_TOKEN``.
    """

    backend: str
    name: str
    dashboard_url: str
    #: True when the pipeline started the cluster and teardown must stop it.
    owned: bool
    #: The cluster's Ray auth as its backend started or found it (every backend sets it; a bare handle means none).
    auth_mode: str = AuthMode.DISABLED.value
    conn_id: str | None = None
    gcs_address: str | None = None
    expected_nodes: int = 1
    expected_cpus: float = 0
    expected_gpus: float = 0
    #: Backend-specific facts (PIDs, temp dir, ports …).
    extra: dict[str, Any] = field(default_factory=dict)
    #: The file holding the cluster's Ray token (a path, never the token itself).
    token_file: str | None = None
    #: CA file or directory verifying an ``https`` dashboard (a path; from the Airflow connection).
    ca_bundle: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ClusterHandle:
        return cls(**data)

    def token(self) -> str | None:
        """The cluster's Ray token when it uses token auth: from ``token_file``, else
        ``$VERL_PIPELINE_RAY_TOKEN``; None for an auth-disabled cluster."""
        if self.auth_mode != AuthMode.TOKEN.value:
            return None
        if self.token_file:
            return read_token_file(Path(self.token_file))
        return os.environ.get(PIPELINE_TOKEN_VAR) or None

    def client(self, token: str | None = None, *, session: Any = None) -> RayJobsClient:
        """A Jobs API client for this cluster (no I/O until used, except reading a token file).

        ``token`` (an Airflow connection's password) wins over :meth:`token`. The client carries
        the cluster's auth mode and token itself: the process environment (``RAY_AUTH_MODE``) is
        neither read nor written, so clients of token-auth and auth-disabled clusters coexist.
        """
        if token is None:
            token = self.token()
        return RayJobsClient(self.dashboard_url, token=token, auth_mode=self.auth_mode, session=session,
                             ca_bundle=self.ca_bundle)


@dataclass(frozen=True)
class ClusterStatus:
    ready: bool
    nodes_alive: int
    cpus: float
    gpus: float
    ray_version: str | None
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ClusterHealth:
    """Whether a provisioned cluster's infrastructure (allocation, pods, processes) is still there.

    ``infrastructure`` is True when ``alive`` is False because the site took the cluster away
    (cancelled, preempted, node failure …): a failure to retry on a fresh cluster, not the job's fault.
    """

    alive: bool
    state: str
    detail: str
    infrastructure: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def probe(client: RayJobsClient) -> ClusterStatus:
    """One look at the cluster: Jobs API version, alive nodes and their total resources."""
    try:
        version = client.version()
        nodes = [n for n in client.nodes() if n.alive]
    except ClusterError as e:
        return ClusterStatus(False, 0, 0, 0, None, str(e))
    cpus = sum(n.resources.get("CPU", 0.0) for n in nodes)
    gpus = sum(n.resources.get("GPU", 0.0) for n in nodes)
    return ClusterStatus(True, len(nodes), cpus, gpus, str(version.get("ray_version")), "ok")


def wait_ready(
    handle: ClusterHandle,
    *,
    timeout_s: float,
    client: RayJobsClient | None = None,
    still_starting: Any = None,
    poll_s: float = 1.0,
) -> ClusterStatus:
    """Block until the Jobs API answers and the expected nodes, CPUs and GPUs are all alive.

    ``still_starting`` is an optional callable raising ClusterError when the backend knows the
    cluster died while starting (so the caller does not wait out the whole timeout).
    """
    client = client or handle.client()
    deadline = time.monotonic() + timeout_s
    last = ClusterStatus(False, 0, 0, 0, None, "not probed yet")
    while True:
        last = probe(client)
        if (
            last.ready
            and last.nodes_alive >= handle.expected_nodes
            and last.cpus >= handle.expected_cpus
            and last.gpus >= handle.expected_gpus
        ):
            log.info(
                "Ray cluster %s ready: %d node(s), %.0f CPU, %.0f GPU, Ray %s, Jobs API at %s",
                handle.name, last.nodes_alive, last.cpus, last.gpus, last.ray_version, handle.dashboard_url,
            )
            return last
        if still_starting is not None:
            still_starting()
        if time.monotonic() > deadline:
            raise ClusterError(
                f"Ray cluster {handle.name} at {handle.dashboard_url} was not ready after {timeout_s:.0f}s: "
                f"expected {handle.expected_nodes} node(s) / {handle.expected_cpus:g} CPU / "
                f"{handle.expected_gpus:g} GPU, saw {last.nodes_alive} node(s) / {last.cpus:g} CPU / "
                f"{last.gpus:g} GPU ({last.detail}). Raise cluster ready_timeout_s or check the cluster."
            )
        time.sleep(poll_s)


class ClusterBackend(abc.ABC):
    """One way of getting a Ray cluster. Implementations do no I/O in ``__init__``."""

    kind: str

    @classmethod
    @abc.abstractmethod
    def from_spec(cls, spec: dict[str, Any]) -> ClusterBackend:
        """The backend a cluster profile's ``cluster`` section describes; ConfigError naming a bad key."""

    @abc.abstractmethod
    def provision(self, name: str) -> ClusterHandle:
        """Create (or reach) the cluster and return once it is ready."""

    @abc.abstractmethod
    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        """Release whatever ``provision`` created. Safe to call twice and after a failed provision."""

    def status(self, handle: ClusterHandle) -> ClusterStatus:
        return probe(handle.client())

    def health(self, handle: ClusterHandle) -> ClusterHealth:
        """Is the cluster still there? Default: its Jobs API answers."""
        st = probe(handle.client())
        return ClusterHealth(st.ready, "READY" if st.ready else "UNREACHABLE", st.detail,
                             infrastructure=not st.ready)

    def for_run(self, run_dir: Path) -> ClusterBackend:
        """This backend bound to a run directory (backends that keep files per run override it)."""
        return self

    def end_time(self, handle: ClusterHandle) -> float | None:
        """When the cluster's allocation ends (epoch seconds), None when it has no end (the default)."""
        return None
