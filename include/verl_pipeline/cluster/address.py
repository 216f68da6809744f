"""An existing Ray cluster reached by its dashboard URL. The pipeline never tears it down.

A dashboard with auth disabled is used only on loopback or over https, unless the profile says
``allow_insecure: true`` (:func:`verl_pipeline.auth.exposure_problem`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from verl_pipeline import auth
from verl_pipeline.admission import POOL_KEY
from verl_pipeline.cluster.base import COMMON_SETTINGS, ClusterBackend, ClusterHandle, wait_ready
from verl_pipeline.exceptions import ClusterError, ConfigError

log = logging.getLogger(__name__)


class Endpoint(NamedTuple):
    """A Ray dashboard as an Airflow connection (or the CLI's ``--address``) names it."""

    dashboard_url: str
    #: The Ray auth token (a connection's password): never logged, never put in a handle.
    token: str | None
    #: CA file or directory for an ``https`` dashboard signed by a private CA.
    ca_bundle: str | None = None


@dataclass(frozen=True)
class AddressBackend(ClusterBackend):
    """Use a running cluster. ``dashboard_url`` comes from the profile or from an Airflow connection."""

    dashboard_url: str | None = None
    conn_id: str | None = None
    auth_mode: str = "disabled"
    expected_nodes: int = 1
    expected_gpus: float = 0
    ready_timeout_s: float = 120.0
    #: The profile accepts an auth-disabled dashboard on plain http beyond loopback.
    allow_insecure: bool = False
    #: From the Airflow connection's password or $VERL_PIPELINE_RAY_TOKEN; never put in the handle.
    token: str | None = field(default=None, repr=False)
    #: CA file/directory for an https dashboard (the connection's ``ca_bundle`` extra); a path.
    ca_bundle: str | None = None
    kind: str = "address"

    def with_endpoint(self, dashboard_url: str, token: str | None, ca_bundle: str | None = None) -> AddressBackend:
        """This backend pointed at a URL/token (and CA bundle) resolved from an Airflow connection."""
        return replace(self, dashboard_url=dashboard_url, token=token, ca_bundle=ca_bundle or self.ca_bundle)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> AddressBackend:
        known = {"backend", "dashboard_url", "conn_id", "auth_mode", "allow_insecure", "ca_bundle", "expected_nodes",
                 "expected_gpus", "ready_timeout_s", POOL_KEY, *COMMON_SETTINGS}
        for key in spec:
            if key not in known:
                raise ConfigError(f"cluster.{key}", spec[key], "unknown setting of the address backend",
                                  f"use one of {sorted(known - {'backend'})}")
        url = spec.get("dashboard_url")
        conn_id = spec.get("conn_id")
        if not url and not conn_id:
            raise ConfigError("cluster.dashboard_url", url, "the address backend needs the dashboard URL",
                              "set dashboard_url: http://head:8265 or conn_id: ray_default")
        if url and not str(url).startswith(("http://", "https://")):
            raise ConfigError("cluster.dashboard_url", url, "must be an http(s) URL of the Ray dashboard",
                              "http://head:8265")
        # Someone else's cluster: its mode is whatever it was started with, so the profile says it.
        mode = auth.auth_mode(spec, default=auth.AuthMode.DISABLED)
        insecure = auth.allow_insecure(spec)
        if url:
            problem = auth.exposure_problem(str(url), mode, allowed=insecure)
            if problem:
                raise problem
        ca_bundle = spec.get("ca_bundle")
        if ca_bundle is not None and not Path(str(ca_bundle)).expanduser().is_absolute():
            raise ConfigError("cluster.ca_bundle", ca_bundle, "must be an absolute path to a CA file or directory",
                              "ca_bundle: /etc/ssl/certs/my-ca.pem")
        return cls(
            dashboard_url=url,
            conn_id=conn_id,
            auth_mode=mode.value,
            allow_insecure=insecure,
            ca_bundle=str(Path(str(ca_bundle)).expanduser()) if ca_bundle else None,
            expected_nodes=int(spec.get("expected_nodes", 1)),
            expected_gpus=float(spec.get("expected_gpus", 0)),
            ready_timeout_s=float(spec.get("ready_timeout_s", 120)),
        )

    def provision(self, name: str) -> ClusterHandle:
        if not self.dashboard_url:
            raise ConfigError("cluster.dashboard_url", None, "no dashboard URL was resolved",
                              f"set the Airflow connection {self.conn_id} host/port or dashboard_url")
        # Also for a URL from the Airflow connection (unknown when the profile was read).
        problem = auth.exposure_problem(self.dashboard_url, auth.AuthMode(self.auth_mode), allowed=self.allow_insecure)
        if problem:
            raise problem
        if self.ca_bundle and not Path(self.ca_bundle).exists():
            raise ClusterError(f"ca_bundle={self.ca_bundle!r}: no such CA file or directory (fix: the path of the "
                               "PEM file that signed the dashboard's certificate, readable on this worker)")
        handle = ClusterHandle(
            backend=self.kind,
            name=name,
            dashboard_url=self.dashboard_url,
            owned=False,
            auth_mode=self.auth_mode,
            conn_id=self.conn_id,
            expected_nodes=self.expected_nodes,
            expected_gpus=self.expected_gpus,
            ca_bundle=self.ca_bundle,
            extra={"allow_insecure": self.allow_insecure},
        )
        wait_ready(handle, timeout_s=self.ready_timeout_s, client=handle.client(self.token))
        return handle

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        log.info("Cluster %s at %s is not owned by the pipeline: left running", handle.name, handle.dashboard_url)
        return {"stopped_processes": 0, "owned": False}
