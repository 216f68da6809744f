"""Each physical GPU's utilisation and memory over the run, summarised from the waiter's samples (pure).

The waiter appends what Ray's node summary says of every GPU to the run's ``gpu-usage.jsonl``
(:mod:`verl_pipeline.jobs.gpu_usage`), one line per node per sample, under the node's Ray node id.
A raylet that restarts comes back under a new node id with the same GPUs, so the report keys a
GPU by what stays: its NVML UUID, or (in samples from before the UUID was recorded) the node's
address and the GPU's index. One GPU is one row and one line in its host's plot, however many
Ray node ids it was seen under.

Utilisation is judged over the **training window** only: from each attempt's first training step
(as the waiter saw it arrive) to its last metrics line. Before that the GPUs sit idle while the
engines and models load, which says nothing about how well the run keeps them busy. Peak memory is
over every sample: a job that runs out of memory while it loads runs out all the same.

The samples are held as columns (:class:`GpuSeries`), not one object per reading: a week of 10 s
samples of 64 GPUs is some four million readings.
"""

from __future__ import annotations

import math
import statistics
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from verl_pipeline.jobs.gpu_usage import GpuReading, NodeGpuSample

MIB_PER_GIB = 1024.0

#: A span of epoch seconds, start and end included.
Window = tuple[float, float]


def gpu_key(node_ip: str, gpu: GpuReading) -> str:
    """What names one physical GPU across raylet restarts: its UUID, else its node's address and index."""
    return gpu.uuid or f"{node_ip}/{gpu.index}"


@dataclass
class GpuSeries:
    """One physical GPU's samples, oldest first, as columns (single precision is exact for MiB and
    percentages); a utilisation not reported is NaN."""

    key: str
    node_ip: str
    index: int
    uuid: str | None
    #: The Ray node ids the GPU was seen under (more than one: its raylet restarted).
    node_ids: list[str] = field(default_factory=list)
    times: array[float] = field(default_factory=lambda: array("d"))
    utilization_pct: array[float] = field(default_factory=lambda: array("f"))
    memory_used_mib: array[float] = field(default_factory=lambda: array("f"))
    memory_total_mib: float = 0.0

    def add(self, time: float, node_id: str, gpu: GpuReading) -> None:
        if node_id not in self.node_ids:
            self.node_ids.append(node_id)
        self.times.append(time)
        self.utilization_pct.append(math.nan if gpu.utilization_pct is None else gpu.utilization_pct)
        self.memory_used_mib.append(gpu.memory_used_mib)
        self.memory_total_mib = max(self.memory_total_mib, gpu.memory_total_mib)

    def in_time_order(self) -> GpuSeries:
        """The same samples sorted by time (the samples of two waiters of one run may interleave)."""
        if all(a <= b for a, b in zip(self.times, self.times[1:], strict=False)):
            return self
        order = sorted(range(len(self.times)), key=self.times.__getitem__)
        return GpuSeries(self.key, self.node_ip, self.index, self.uuid, self.node_ids,
                         array("d", (self.times[i] for i in order)),
                         array("f", (self.utilization_pct[i] for i in order)),
                         array("f", (self.memory_used_mib[i] for i in order)), self.memory_total_mib)


def collect(samples: Iterable[NodeGpuSample]) -> list[GpuSeries]:
    """Every physical GPU's series from the nodes' samples (read once, in one pass), in the report's
    order: by the host's address, then the GPU's index."""
    series: dict[str, GpuSeries] = {}
    for sample in samples:
        for gpu in sample.gpus:
            key = gpu_key(sample.node_ip, gpu)
            one = series.get(key)
            if one is None:
                one = series[key] = GpuSeries(key, sample.node_ip, gpu.index, gpu.uuid)
            one.add(sample.time, sample.node_id, gpu)
    _merge_unnamed(series)
    return sorted((s.in_time_order() for s in series.values()), key=lambda s: (s.node_ip, s.index, s.key))


def _merge_unnamed(series: dict[str, GpuSeries]) -> None:
    """A run whose early samples carry no UUID and later ones do: the early ones join the GPU of the
    same address and index, where exactly one named GPU has them."""
    named: dict[tuple[str, int], list[GpuSeries]] = {}
    for s in series.values():
        if s.uuid is not None:
            named.setdefault((s.node_ip, s.index), []).append(s)
    for key, unnamed in [(k, s) for k, s in series.items() if s.uuid is None]:
        match = named.get((unnamed.node_ip, unnamed.index), [])
        if len(match) == 1:
            into = match[0]
            into.node_ids += [n for n in unnamed.node_ids if n not in into.node_ids]
            into.times += unnamed.times
            into.utilization_pct += unnamed.utilization_pct
            into.memory_used_mib += unnamed.memory_used_mib
            into.memory_total_mib = max(into.memory_total_mib, unnamed.memory_total_mib)
            del series[key]


@dataclass(frozen=True)
class GpuUsage:
    """One physical GPU over the run: its utilisation over the training window (mean, median, lowest;
    None: no sample fell in it) and its peak memory over the whole run."""

    node_ip: str
    index: int
    uuid: str | None
    #: The Ray node ids the GPU was seen under (more than one: its raylet restarted).
    node_ids: list[str]
    #: Samples of the GPU in the training window, and in the whole run.
    samples_in_window: int
    samples: int
    mean_utilization_pct: float | None
    median_utilization_pct: float | None
    min_utilization_pct: float | None
    #: The most memory the GPU used at any sample, and its total (MiB).
    peak_memory_used_mib: float | None
    memory_total_mib: float | None

    @property
    def label(self) -> str:
        """How the report names the GPU: its host's address and its index."""
        return f"{self.node_ip or 'node'} GPU {self.index}"

    @property
    def peak_memory_pct(self) -> float | None:
        if self.peak_memory_used_mib is None or not self.memory_total_mib:
            return None
        return 100.0 * self.peak_memory_used_mib / self.memory_total_mib


def in_windows(time: float, windows: Iterable[Window]) -> bool:
    return any(start <= time <= end for start, end in windows)


def summarise_gpu(series: GpuSeries, windows: list[Window]) -> GpuUsage:
    """One GPU's summary (``series``: at least one sample)."""
    in_window = [u for t, u in zip(series.times, series.utilization_pct, strict=True)
                 if not math.isnan(u) and in_windows(t, windows)]
    peak = max(series.memory_used_mib, default=None)
    return GpuUsage(
        node_ip=series.node_ip, index=series.index, uuid=series.uuid, node_ids=list(series.node_ids),
        samples_in_window=len(in_window), samples=len(series.times),
        mean_utilization_pct=statistics.fmean(in_window) if in_window else None,
        median_utilization_pct=statistics.median(in_window) if in_window else None,
        min_utilization_pct=min(in_window) if in_window else None,
        peak_memory_used_mib=peak, memory_total_mib=series.memory_total_mib if peak is not None else None)


def summarise(series: list[GpuSeries], windows: list[Window]) -> list[GpuUsage]:
    """Every GPU's summary, in the report's order; ``windows``: the training window's spans."""
    return [summarise_gpu(s, windows) for s in series if s.times]


def by_host(series: list[GpuSeries]) -> dict[str, list[GpuSeries]]:
    """The GPUs of each host (by address), hosts and GPUs in the report's order: one plot each."""
    hosts: dict[str, list[GpuSeries]] = {}
    for s in series:
        hosts.setdefault(s.node_ip, []).append(s)
    return hosts
