"""Slurm through slurmrestd (its REST API) instead of the sbatch/scontrol/scancel commands.

Configured in the cluster profile as ``slurmrestd: {url: ..., api_version: v0.0.38, user: ...,
token_env: SLURM_JWT}``. ``url`` is ``unix:/path/to/slurmrestd.socket`` (rest_auth/local: the
daemon's own user submits) or ``http(s)://host:port`` (rest_auth/jwt: the token from
``$SLURM_JWT``, as ``scontrol token`` prints it, sent with the user name).

slurmrestd does not read ``#SBATCH`` lines: the allocation is described by the job properties
the Slurm backend builds from the same profile settings (the script is sent as is, so a user still reads the
``#SBATCH`` lines of what ran).
"""

from __future__ import annotations

import getpass
import logging
import os
import re
from dataclasses import dataclass, fields
from typing import Any

from verl_pipeline.exceptions import ClusterError, ConfigError

log = logging.getLogger(__name__)

#: The REST API versions whose job fields this module reads (tested against slurmrestd 22.05).
#: Later versions changed the shapes (state flag lists, exit codes and limits as objects).
API_VERSIONS = ("v0.0.38",)


@dataclass(frozen=True)
class SlurmRest:
    """The profile's ``slurmrestd`` section; a key it leaves out keeps the field's default."""

    url: str
    api_version: str = API_VERSIONS[0]
    user: str | None = None
    token_env: str = "SLURM_JWT"
    timeout_s: float = 30.0

    @classmethod
    def from_spec(cls, spec: Any) -> SlurmRest:
        if not isinstance(spec, dict) or not isinstance(spec.get("url"), str):
            raise ConfigError("cluster.slurmrestd", spec, "needs url (unix:/path/to/socket or http://host:port)",
                              "slurmrestd: {url: 'unix:/run/slurmrestd/slurmrestd.socket'}")
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(spec) - set(known))
        if unknown:
            raise ConfigError(f"cluster.slurmrestd.{unknown[0]}", spec[unknown[0]], "unknown slurmrestd setting",
                              f"use {', '.join(known)}")
        url = spec["url"]
        if not (url.startswith("unix:/") or re.match(r"^https?://[^/\s]+/?$", url)):
            raise ConfigError("cluster.slurmrestd.url", url, "must be unix:/absolute/socket or http(s)://host:port",
                              "url: 'unix:/run/slurmrestd/slurmrestd.socket'")
        version = str(spec.get("api_version", cls.api_version))
        if version not in API_VERSIONS:
            raise ConfigError("cluster.slurmrestd.api_version", version, "is not a slurmrestd API this backend speaks",
                              f"one of {list(API_VERSIONS)} (`slurmrestd -s list` shows yours)")
        timeout = spec.get("timeout_s", cls.timeout_s)
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or timeout <= 0:
            raise ConfigError("cluster.slurmrestd.timeout_s", timeout, "must be a positive number",
                              f"timeout_s: {cls.timeout_s:g}")
        return cls(url=url.rstrip("/"), api_version=version, user=spec.get("user", cls.user),
                   token_env=str(spec.get("token_env", cls.token_env)), timeout_s=float(timeout))

    def to_dict(self) -> dict[str, Any]:
        return {"url": self.url, "api_version": self.api_version, "user": self.user, "token_env": self.token_env,
                "timeout_s": self.timeout_s}

    # -- HTTP ------------------------------------------------------------------------------------
    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        import httpx

        headers = {"Accept": "application/json"}
        token = os.environ.get(self.token_env)
        if token:
            headers["X-SLURM-USER-NAME"] = self.user or getpass.getuser()
            headers["X-SLURM-USER-TOKEN"] = token
        if self.url.startswith("unix:"):
            transport = httpx.HTTPTransport(uds=self.url[len("unix:"):])
            base = "http://slurmrestd"
        else:
            transport = httpx.HTTPTransport()
            base = self.url
        full = f"{base}/slurm/{self.api_version}/{path}"
        try:
            with httpx.Client(transport=transport, timeout=self.timeout_s) as client:
                r = client.request(method, full, headers=headers, json=body)
        except httpx.HTTPError as e:
            raise ClusterError(f"slurmrestd at {self.url} is unreachable ({type(e).__name__}: {e}); check "
                               "cluster.slurmrestd.url and that slurmrestd runs") from None
        try:
            data: dict[str, Any] = r.json()
        except ValueError:
            data = {}
        errors = [e for e in data.get("errors") or [] if isinstance(e, dict) and (e.get("error_number") or
                                                                                  e.get("error_code"))]
        if r.status_code in (401, 403):
            raise ClusterError(f"slurmrestd at {self.url} refused the request (HTTP {r.status_code}): set "
                               f"${self.token_env} to a token from `scontrol token` (and cluster.slurmrestd.user), "
                               "or use the UNIX socket as the daemon's user")
        if r.status_code >= 400 or errors:
            what = "; ".join(str(e.get("description") or e.get("error")) for e in errors) or r.text[:300]
            raise _RestError(f"slurmrestd {method} {path} failed (HTTP {r.status_code}): {what}", errors)
        return data

    # -- jobs --------------------------------------------------------------------------------------
    def submit(self, script: str, job: dict[str, Any]) -> str:
        data = self._request("POST", "job/submit", {"script": script, "job": job})
        job_id = data.get("job_id")
        if job_id is None:
            raise ClusterError(f"slurmrestd accepted the job but returned no job id: {data}")
        return str(job_id)

    def job(self, job_id: str) -> dict[str, Any] | None:
        """The job's record, or None once Slurm no longer knows it."""
        try:
            data = self._request("GET", f"job/{job_id}")
        except _RestError as e:
            if any("Invalid job id" in str(x.get("error", "")) or "Unable to find" in str(x.get("description", ""))
                   for x in e.errors):
                return None
            raise
        jobs = data.get("jobs") or []
        return jobs[0] if jobs else None

    def cancel(self, job_id: str) -> None:
        try:
            self._request("DELETE", f"job/{job_id}")
        except _RestError as e:
            log.warning("Cancelling Slurm job %s through slurmrestd: %s", job_id, e)

    def jobs_named(self, name: str) -> list[dict[str, Any]]:
        return [j for j in self._request("GET", "jobs").get("jobs") or [] if j.get("name") == name]


class _RestError(ClusterError):
    def __init__(self, message: str, errors: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.errors = errors


def state_of(record: dict[str, Any]) -> tuple[str, str, str, str]:
    """(state, reason, exit code, nodes) of a slurmrestd v0.0.38 job record."""
    return (str(record.get("job_state", "UNKNOWN")), str(record.get("state_reason", "")),
            str(record.get("exit_code", "")), str(record.get("nodes", "")))


def slurm_rest_end_time(record: dict[str, Any]) -> float | None:
    """slurmrestd's ``end_time``: an epoch number (v0.0.38) or ``{"set": …, "number": …}`` (v0.0.40+)."""
    value = record.get("end_time")
    if isinstance(value, dict):
        value = value.get("number") if value.get("set", True) else None
    return float(value) if isinstance(value, int | float) and value > 0 else None
