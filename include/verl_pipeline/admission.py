"""Admission to a shared cluster: an Airflow pool sized by the cluster's GPUs.

Runs of their own cluster (local, Slurm, KubeRay) never compete for GPUs. Runs that target one
existing ``address`` cluster do: a second verl job submitted while the first holds the GPUs fails
verl's resource check after its driver started, or waits with half its placement groups. A cluster
profile that names a pool (``cluster.pool``) makes such runs queue in Airflow instead: each run
takes as many slots as GPUs it needs (``nnodes x n_gpus_per_node``) out of a pool of
``cluster.expected_gpus`` slots.

This module holds the fact and its rules; :mod:`verl_pipeline.airflow.policy` applies it to the
run's wait task, which is the task that submits a pooled run's job and holds the slots for the
job's whole life.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from verl_pipeline.exceptions import ConfigError

#: The cluster-profile key that names the pool.
POOL_KEY = "pool"
#: What an Airflow pool name may be made of here (it is also a file-name-safe label).
_POOL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,255}")


@dataclass(frozen=True)
class Admission:
    """A run's claim on a shared cluster: ``slots`` of the ``size`` slots of Airflow pool ``pool``."""

    pool: str
    #: The GPUs the run needs (all of them, the rollout pool's too when placement is separate).
    slots: int
    #: The cluster's GPUs (``cluster.expected_gpus``): the pool's size when the pipeline creates it.
    size: int

    def describe(self) -> str:
        return f"{self.slots} of the {self.size} slots of Airflow pool {self.pool!r}"

    def to_dict(self) -> dict[str, Any]:
        return {"pool": self.pool, "slots": self.slots, "size": self.size}


def admission_of(cluster: dict[str, Any], cluster_profile: str, n_gpus: int) -> Admission | None:
    """The run's admission from its cluster profile's ``cluster`` section (None: no pool named).

    ConfigError, before any cluster starts, when the pool is named on a cluster the run owns, has no
    valid name, or can never admit the run (it needs more GPUs than the cluster has: Airflow would
    leave the task waiting for ever)."""
    name = cluster.get(POOL_KEY)
    if name is None:
        return None
    key = f"clusters/{cluster_profile}.cluster.{POOL_KEY}"
    backend = cluster.get("backend")
    if backend != "address":
        raise ConfigError(key, name, f"only an existing (address) cluster is shared by runs; a {backend} cluster "
                          "is the run's own", "remove pool: from this profile")
    if not isinstance(name, str) or not _POOL_NAME.fullmatch(name):
        raise ConfigError(key, name, "must be an Airflow pool name of letters, digits, '_', '.' or '-'",
                          "pool: shared_gpus")
    size_key = f"clusters/{cluster_profile}.cluster.expected_gpus"
    try:
        size = float(cluster.get("expected_gpus", 0))
    except (TypeError, ValueError):
        raise ConfigError(size_key, cluster.get("expected_gpus"), "must be a number", "expected_gpus: 8") from None
    if size < 1 or size != int(size):
        raise ConfigError(size_key, cluster.get("expected_gpus"),
                          "a pooled cluster needs its whole number of GPUs: it is the pool's size", "expected_gpus: 8")
    if n_gpus > size:
        raise ConfigError(size_key, int(size), f"the run needs {n_gpus} GPUs (nnodes x n_gpus_per_node) and the pool "
                          "could never admit it", f"a shape of at most {int(size)} GPUs, or expected_gpus: {n_gpus}")
    return Admission(pool=name, slots=max(1, n_gpus), size=int(size))
