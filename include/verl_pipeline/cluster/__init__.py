"""Ray cluster backends behind one lifecycle: provision → wait ready → address → teardown."""

from __future__ import annotations

from verl_pipeline.cluster.base import ClusterBackend, ClusterHandle, get_backend

__all__ = ["ClusterBackend", "ClusterHandle", "get_backend"]
