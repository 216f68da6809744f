"""The cluster backends by name: the one place that knows them all (``base`` knows none of them)."""

from __future__ import annotations

import logging
from typing import Any

from verl_pipeline.cluster.address import AddressBackend
from verl_pipeline.cluster.base import ClusterBackend, ClusterHandle
from verl_pipeline.cluster.kuberay import KubeRayBackend
from verl_pipeline.cluster.local import LocalBackend
from verl_pipeline.cluster.slurm import SlurmBackend
from verl_pipeline.constants import BackendKind
from verl_pipeline.exceptions import ConfigError, PipelineError
from verl_pipeline.jobs.deadlines import Deadline

log = logging.getLogger(__name__)

#: A cluster profile's ``backend`` → the backend class that reads the rest of its ``cluster`` section.
BACKENDS: dict[str, type[ClusterBackend]] = {
    BackendKind.LOCAL.value: LocalBackend,
    BackendKind.ADDRESS.value: AddressBackend,
    BackendKind.SLURM.value: SlurmBackend,
    BackendKind.KUBERAY.value: KubeRayBackend,
}


def get_backend(spec: dict[str, Any]) -> ClusterBackend:
    """The backend for a cluster profile's ``cluster`` section (its ``backend`` names it)."""
    kind = spec.get("backend")
    backend = BACKENDS.get(str(kind))
    if backend is None:
        raise ConfigError("cluster.backend", kind, "unknown backend", f"use one of: {', '.join(BACKENDS)}")
    return backend.from_spec(spec)


def cluster_deadline(handle: ClusterHandle, spec: dict[str, Any] | None = None) -> Deadline | None:
    """When the cluster's allocation ends, if its backend has an end (a Slurm job's EndTime); never raises."""
    try:
        end = get_backend({"backend": handle.backend, **(spec or {})}).end_time(handle)
    except (PipelineError, OSError) as e:
        log.warning("Cannot read when cluster %s ends: %s", handle.name, e)
        return None
    return Deadline(end, f"{handle.backend} allocation of {handle.name} ({_label(handle)}) ends") if end else None


def _label(handle: ClusterHandle) -> str:
    job_id = handle.extra.get("job_id")
    return f"Slurm job {job_id} EndTime" if job_id else handle.backend


__all__ = ["BACKENDS", "cluster_deadline", "get_backend"]
