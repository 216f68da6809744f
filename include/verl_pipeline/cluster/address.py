"""An existing Ray cluster reached by its dashboard URL. The pipeline never tears it down."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

from verl_pipeline.cluster.base import COMMON_SETTINGS, ClusterBackend, ClusterHandle, wait_ready
from verl_pipeline.exceptions import ConfigError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddressBackend(ClusterBackend):
    """Use a running cluster. ``dashboard_url`` comes from the profile or from an Airflow connection."""

    dashboard_url: str | None = None
    conn_id: str | None = None
    auth_mode: str = "disabled"
    expected_nodes: int = 1
    expected_gpus: float = 0
    ready_timeout_s: float = 120.0
    #: From the Airflow connection's password or $VERL_PIPELINE_RAY_TOKEN; never put in the handle.
    token: str | None = field(default=None, repr=False)
    kind: str = "address"

    def with_endpoint(self, dashboard_url: str, token: str | None) -> AddressBackend:
        """This backend pointed at a URL/token resolved from an Airflow connection."""
        return replace(self, dashboard_url=dashboard_url, token=token)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> AddressBackend:
        known = {"backend", "dashboard_url", "conn_id", "auth_mode", "expected_nodes", "expected_gpus",
                 "ready_timeout_s", *COMMON_SETTINGS}
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
        auth = str(spec.get("auth_mode", "disabled"))
        if auth not in ("disabled", "token"):
            raise ConfigError("cluster.auth_mode", auth, "must be disabled or token", "auth_mode: token")
        return cls(
            dashboard_url=url,
            conn_id=conn_id,
            auth_mode=auth,
            expected_nodes=int(spec.get("expected_nodes", 1)),
            expected_gpus=float(spec.get("expected_gpus", 0)),
            ready_timeout_s=float(spec.get("ready_timeout_s", 120)),
        )

    def provision(self, name: str) -> ClusterHandle:
        if not self.dashboard_url:
            raise ConfigError("cluster.dashboard_url", None, "no dashboard URL was resolved",
                              f"set the Airflow connection {self.conn_id} host/port or dashboard_url")
        handle = ClusterHandle(
            backend=self.kind,
            name=name,
            dashboard_url=self.dashboard_url,
            owned=False,
            auth_mode=self.auth_mode,
            conn_id=self.conn_id,
            expected_nodes=self.expected_nodes,
            expected_gpus=self.expected_gpus,
        )
        wait_ready(handle, timeout_s=self.ready_timeout_s, client=handle.client(self.token))
        return handle

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        log.info("Cluster %s at %s is not owned by the pipeline: left running", handle.name, handle.dashboard_url)
        return {"stopped_processes": 0, "owned": False}
