"""Each node's GPU utilisation and memory over a run, as Ray's dashboard reports them.

Ray's node summary (``GET /nodes?view=summary``, the request the waiter already makes to count live
nodes) carries, per node, a ``gpus`` list: for each GPU its NVML ``index`` and ``uuid``,
``utilizationGpu`` (%), ``memoryUsed`` and ``memoryTotal`` (MiB). A :class:`NodeGpuSample` is one
node's reading at one time; the waiter appends them to the run's ``RunDir.gpu_usage_file`` (one JSON
line each), the report summarises and plots them per physical GPU (the UUID names one across raylet
restarts, which give the node a new Ray node id; samples written before the UUID was recorded fall
back to the node's address and the GPU's index), and the hang watchdog reads the latest as evidence
(GPUs idle at 0% and GPUs busy with no new step say different things).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class GpuReading:
    """One GPU of a node at one time."""

    index: int
    #: Percent of the sample period a kernel ran (NVML's utilisation); None when the node did not say.
    utilization_pct: float | None
    memory_used_mib: float
    memory_total_mib: float
    #: NVML's UUID of the GPU (``GPU-…``); None in samples from before it was recorded.
    uuid: str | None = None

    @property
    def memory_pct(self) -> float | None:
        return 100.0 * self.memory_used_mib / self.memory_total_mib if self.memory_total_mib else None


@dataclass(frozen=True)
class NodeGpuSample:
    """One node's GPUs at ``time`` (epoch seconds)."""

    time: float
    node_id: str
    node_ip: str
    gpus: tuple[GpuReading, ...]

    @property
    def mean_utilization_pct(self) -> float | None:
        values = [g.utilization_pct for g in self.gpus if g.utilization_pct is not None]
        return sum(values) / len(values) if values else None

    def to_dict(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict (a deep copy): the waiter writes one of these per GPU node every 10 s.
        return {"time": self.time, "node_id": self.node_id, "node_ip": self.node_ip,
                "gpus": [{"index": g.index, "utilization_pct": g.utilization_pct, "memory_used_mib": g.memory_used_mib,
                          "memory_total_mib": g.memory_total_mib, "uuid": g.uuid} for g in self.gpus]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NodeGpuSample:
        return cls(time=float(d["time"]), node_id=str(d["node_id"]), node_ip=str(d.get("node_ip", "")),
                   gpus=tuple(GpuReading(**g) for g in d.get("gpus", ())))


def readings_from_summary(gpus: Iterable[dict[str, Any]] | None) -> tuple[GpuReading, ...]:
    """The ``gpus`` list of one node in Ray's node summary, as readings (unknown fields skipped)."""
    out = []
    for i, g in enumerate(gpus or ()):
        util = g.get("utilizationGpu")
        out.append(GpuReading(index=int(g.get("index", i)),
                              utilization_pct=None if util is None else float(util),
                              memory_used_mib=float(g.get("memoryUsed") or 0.0),
                              memory_total_mib=float(g.get("memoryTotal") or 0.0),
                              uuid=str(g["uuid"]) if g.get("uuid") else None))
    return tuple(out)


def sample_lines(samples: Iterable[NodeGpuSample]) -> list[str]:
    """The file's lines of the samples of nodes that have GPUs (nodes without GPUs are not written)."""
    return [json.dumps(s.to_dict(), separators=(",", ":")) + "\n" for s in samples if s.gpus]


def append_lines(path: Path, lines: list[str]) -> None:
    """Append lines of :func:`sample_lines` (a waiter keeps its samples as text until it appends them:
    strings, not objects the garbage collector has to walk, for a minute's worth per wait)."""
    if lines:
        with path.open("a") as f:
            f.writelines(lines)


def append_samples(path: Path, samples: Iterable[NodeGpuSample]) -> None:
    """Append samples of nodes that have GPUs (one line each); nodes without GPUs are not written."""
    append_lines(path, sample_lines(samples))


def read_samples(path: Path) -> Iterator[NodeGpuSample]:
    """The samples in ``path``, oldest first, read line by line (a week of a large cluster's samples is
    hundreds of MB); a torn last line (a killed writer) is skipped."""
    try:
        f = path.open(encoding="utf-8", errors="replace")
    except FileNotFoundError:
        return
    with f:
        for line in f:
            try:
                yield NodeGpuSample.from_dict(json.loads(line))
            except (ValueError, KeyError, TypeError):
                continue
