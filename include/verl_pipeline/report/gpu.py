"""Each node's GPU utilisation and memory over the run, summarised from the waiter's samples (pure).

The waiter appends what Ray's node summary says of every GPU to the run's ``gpu-usage.jsonl``
(:mod:`verl_pipeline.jobs.gpu_usage`). Utilisation is judged over the **training window** only:
from each attempt's first training step (as the waiter saw it arrive) to its last metrics line.
Before that the GPUs sit idle while the engines and models load, which says nothing about how well
the run keeps them busy. Peak memory is over every sample: a job that runs out of memory while it
loads runs out all the same.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass

from verl_pipeline.jobs.gpu_usage import NodeGpuSample

MIB_PER_GIB = 1024.0

#: A span of epoch seconds, start and end included.
Window = tuple[float, float]


@dataclass(frozen=True)
class NodeGpuSummary:
    """One node's GPUs over the run.

    A node's utilisation at one sample is the mean of its GPUs'; the mean, median and lowest are of
    those, over the samples in the training window (None: no sample fell in it).
    """

    node_id: str
    node_ip: str
    n_gpus: int
    #: Samples of the node in the training window, and in the whole run.
    samples_in_window: int
    samples: int
    mean_utilization_pct: float | None
    median_utilization_pct: float | None
    min_utilization_pct: float | None
    #: The most memory any one GPU of the node used at any sample, and that GPU's total (MiB).
    peak_memory_used_mib: float | None
    memory_total_mib: float | None

    @property
    def label(self) -> str:
        """How the report names the node: its address and the start of Ray's node id."""
        return f"{self.node_ip or 'node'} ({self.node_id[:8]})"

    @property
    def peak_memory_pct(self) -> float | None:
        if self.peak_memory_used_mib is None or not self.memory_total_mib:
            return None
        return 100.0 * self.peak_memory_used_mib / self.memory_total_mib


def in_windows(time: float, windows: Iterable[Window]) -> bool:
    return any(start <= time <= end for start, end in windows)


def by_node(samples: Iterable[NodeGpuSample]) -> dict[str, list[NodeGpuSample]]:
    """The samples of each node, oldest first, nodes in the report's order (by address, then id)."""
    nodes: dict[str, list[NodeGpuSample]] = {}
    for s in sorted(samples, key=lambda s: (s.node_ip, s.node_id, s.time)):
        nodes.setdefault(s.node_id, []).append(s)
    return nodes


def summarise_node(samples: list[NodeGpuSample], windows: list[Window]) -> NodeGpuSummary:
    """One node's summary (``samples``: that node's, at least one)."""
    in_window = [u for s in samples if in_windows(s.time, windows) and (u := s.mean_utilization_pct) is not None]
    peak = max((g for s in samples for g in s.gpus), key=lambda g: g.memory_used_mib, default=None)
    return NodeGpuSummary(
        node_id=samples[0].node_id, node_ip=samples[0].node_ip, n_gpus=max(len(s.gpus) for s in samples),
        samples_in_window=len(in_window), samples=len(samples),
        mean_utilization_pct=statistics.fmean(in_window) if in_window else None,
        median_utilization_pct=statistics.median(in_window) if in_window else None,
        min_utilization_pct=min(in_window) if in_window else None,
        peak_memory_used_mib=peak.memory_used_mib if peak else None,
        memory_total_mib=peak.memory_total_mib if peak else None)


def summarise(samples: Iterable[NodeGpuSample], windows: list[Window]) -> list[NodeGpuSummary]:
    """Every node's summary, in the report's order; ``windows``: the training window's spans."""
    return [summarise_node(node_samples, windows) for node_samples in by_node(samples).values()]
