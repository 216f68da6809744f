"""An existing Ray cluster reached by its dashboard URL. The pipeline never tears it down.

Its ``auth_mode`` is the project's default (:data:`~verl_pipeline.constants.DEFAULT_AUTH_MODE`, token)
unless the profile says otherwise. A dashboard with auth disabled is used only on loopback or over
https, unless the profile says ``allow_insecure: true`` (:func:`verl_pipeline.auth.exposure_problem`);
so is a token-auth one for which no token was given (every request would go without one).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NamedTuple

from verl_pipeline import auth
from verl_pipeline.admission import POOL_KEY
from verl_pipeline.cluster.base import ClusterBackend, ClusterHandle, wait_ready
from verl_pipeline.cluster.settings import Key, absolute_path, read_settings, setting
from verl_pipeline.constants import DEFAULT_AUTH_MODE
from verl_pipeline.exceptions import ClusterError, ConfigError

log = logging.getLogger(__name__)


class Endpoint(NamedTuple):
    """A Ray dashboard as an Airflow connection (or the CLI's ``--address``) names it."""

    dashboard_url: str
    #: The Ray auth token (a connection's password): never logged, never put in a handle.
    token: str | None
    #: CA file or directory for an ``https`` dashboard signed by a private CA.
    ca_bundle: str | None = None


def _dashboard_url(key: Key, value: Any) -> str:
    if not isinstance(value, str) or not value.startswith(("http://", "https://")):
        raise key.refuse(value, "must be an http(s) URL of the Ray dashboard", "http://head:8265")
    return value


@dataclass(frozen=True)
class AddressBackend(ClusterBackend):
    """Use a running cluster. ``dashboard_url`` comes from the profile or from an Airflow connection."""

    dashboard_url: str | None = field(default=None, metadata=setting(parse=_dashboard_url))
    conn_id: str | None = field(default=None, metadata=setting(example="ray_default"))
    #: Someone else's cluster: its mode is whatever it was started with; a profile of one without auth says so.
    auth_mode: str = field(default=DEFAULT_AUTH_MODE.value,
                           metadata=setting(choices=tuple(m.value for m in auth.AuthMode)))
    expected_nodes: int = field(default=1, metadata=setting(ge=1))
    expected_gpus: float = field(default=0.0, metadata=setting(ge=0))
    ready_timeout_s: float = field(default=120.0, metadata=setting(gt=0))
    #: The profile accepts an auth-disabled dashboard on plain http beyond loopback.
    allow_insecure: bool = field(default=False, metadata=setting())
    #: From the Airflow connection's password or $VERL_PIPELINE_RAY_TOKEN; never put in the handle.
    token: str | None = field(default=None, repr=False)
    #: CA file/directory for an https dashboard (the connection's ``ca_bundle`` extra); a path.
    ca_bundle: str | None = field(default=None, metadata=setting(parse=absolute_path(
        rule="must be an absolute path to a CA file or directory", example="/etc/ssl/certs/my-ca.pem")))
    kind: str = "address"

    def with_endpoint(self, dashboard_url: str, token: str | None, ca_bundle: str | None = None) -> AddressBackend:
        """This backend pointed at a URL/token (and CA bundle) resolved from an Airflow connection."""
        return replace(self, dashboard_url=dashboard_url, token=token, ca_bundle=ca_bundle or self.ca_bundle)

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> AddressBackend:
        b = read_settings(cls, spec, also=(POOL_KEY,))
        if not b.dashboard_url and not b.conn_id:
            raise ConfigError("cluster.dashboard_url", b.dashboard_url, "the address backend needs the dashboard URL",
                              "set dashboard_url: http://head:8265 or conn_id: ray_default")
        if b.dashboard_url:
            problem = auth.exposure_problem(b.dashboard_url, auth.AuthMode(b.auth_mode), allowed=b.allow_insecure)
            if problem:
                raise problem
        return b

    def provision(self, name: str) -> ClusterHandle:
        if not self.dashboard_url:
            raise ConfigError("cluster.dashboard_url", None, "no dashboard URL was resolved",
                              f"set the Airflow connection {self.conn_id} host/port or dashboard_url")
        # Also for a URL from the Airflow connection (unknown when the profile was read).
        problem = auth.exposure_problem(self.dashboard_url, auth.AuthMode(self.auth_mode), allowed=self.allow_insecure)
        if problem:
            raise problem
        problem = self._tokenless_problem()
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

    def _tokenless_problem(self) -> ConfigError | None:
        """Token auth with no token to send (neither the connection's password nor the variable): the
        requests go without one, and only an open cluster answers them. Refused where an open one would be."""
        if auth.AuthMode(self.auth_mode) is not auth.AuthMode.TOKEN or self.token \
                or os.environ.get(auth.PIPELINE_TOKEN_VAR) or not self.dashboard_url:
            return None
        if auth.exposure_problem(self.dashboard_url, auth.AuthMode.DISABLED, allowed=self.allow_insecure) is None:
            return None
        return ConfigError(
            "cluster.auth_mode", self.auth_mode,
            f"no Ray token was given for {self.dashboard_url} (the Airflow connection's password, else "
            f"${auth.PIPELINE_TOKEN_VAR}): every request would go without one, and a cluster that answers them is "
            f"open: {auth.SHADOWRAY}",
            "give the cluster's token; for a cluster without auth, set auth_mode: disabled (then serve the dashboard "
            "over https, or set allow_insecure: true if only trusted hosts reach the port)")

    def teardown(self, handle: ClusterHandle) -> dict[str, Any]:
        log.info("Cluster %s at %s is not owned by the pipeline: left running", handle.name, handle.dashboard_url)
        return {"stopped_processes": 0, "owned": False}
