"""The nodes-and-GPUs part of a wait on a Ray job: counts the cluster's live nodes and keeps its GPUs' readings.

Both come from one request, Ray's node summary, which the waiters of one cluster share
(:class:`~verl_pipeline.jobs.shared_reads.SharedClusterReads`: a read at most half a poll old serves
them all). On a cluster the pipeline owns the nodes are counted (:class:`~verl_pipeline.jobs.watchdog.NodeWatch`:
every other poll, every poll once one is missing, at once when the job's log speaks of a death) and
each count brings the GPUs' readings; the summary is also read when a GPU sample is due and no count
read it, where the counts cannot keep up with the sample interval (a cluster whose nodes are not
counted, or polls longer than half the interval: decided once, so a late poll on a busy triggerer
does not add reads). The latest readings go into the progress line and a hang's evidence; one sample per GPU
node every ``sample_interval`` seconds (at most one per poll) goes to the run's GPU usage file, in
one append a minute (:data:`GPU_WRITE_INTERVAL_S`) and one when the wait ends.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.gpu_usage import NodeGpuSample, append_lines, sample_lines
from verl_pipeline.jobs.logstream import TaskLog
from verl_pipeline.jobs.progress import GpuSummary
from verl_pipeline.jobs.run_files import FileWrite
from verl_pipeline.jobs.shared_reads import NODE_SUMMARY_SHARED_FOR_POLLS, Cluster, SharedClusterReads
from verl_pipeline.jobs.watchdog import NODE_COUNT_EVERY_POLLS, NodeWatch, speaks_of_a_death

#: The samples of a wait are appended to the run's GPU usage file at most this often, and when the wait
#: ends: a file write a minute, not one per sample; a triggerer that dies loses at most this much.
GPU_WRITE_INTERVAL_S = 60.0


class ClusterWatch:
    """Counts one cluster's nodes for a wait and samples their GPUs.

    :param expected_nodes: the nodes the cluster was provisioned with (0: not counted).
    :param grace_polls: short counts in a row that mean a node is lost.
    :param usage_file: the run's GPU usage file (None: no samples recorded).
    :param sample_interval: seconds between two samples of a node in ``usage_file`` (0: none).
    :param poll_interval: the wait's poll interval (a shared read serves for half of it).
    :param reads: the process's shared node summaries; ``cluster``: this cluster's key in them.
    """

    def __init__(self, *, job_id: str, expected_nodes: int, grace_polls: int, usage_file: Path | None,
                 sample_interval: float, poll_interval: float, reads: SharedClusterReads, cluster: Cluster,
                 log: TaskLog) -> None:
        self.job_id = job_id
        self.nodes = NodeWatch(expected_nodes, grace_polls) if expected_nodes else None
        self.usage_file = usage_file if sample_interval > 0 else None
        self.sample_interval = sample_interval
        self.max_age = poll_interval * NODE_SUMMARY_SHARED_FOR_POLLS
        #: Reads for the GPU samples alone, where the counts come less often than a sample is due.
        self._sample_reads = self.nodes is None or poll_interval * NODE_COUNT_EVERY_POLLS > sample_interval
        self.reads = reads
        self.cluster = cluster
        self.log = log
        #: The GPU nodes as last read (alive nodes with GPUs).
        self.gpus: list[NodeGpuSample] = []
        self._read_at = float("-inf")
        self._sampled_at = float("-inf")
        self._appended_at = float("-inf")
        self._to_write: list[str] = []  # the samples due, as the file's lines
        self._death_in_log = False

    @property
    def reads_nodes(self) -> bool:
        """Whether this wait reads the cluster's nodes at all (it counts them, or records their GPUs)."""
        return self.nodes is not None or self.usage_file is not None

    def observe_record(self, text: str) -> None:
        """A record of the job's log: one that says something died makes the next look count the nodes."""
        if self.nodes is not None and not self._death_in_log and speaks_of_a_death(text):
            self._death_in_log = True

    def summary(self) -> GpuSummary | None:
        """The GPUs as last read, for the progress line and a hang's evidence."""
        return GpuSummary.of(self.gpus)

    async def look(self, hook: Any) -> int | None:
        """Count the nodes when due, and read the GPUs when a sample is due; the nodes alive when a
        node is lost (None: none lost, or not counted on this poll)."""
        count = self.nodes is not None and self.nodes.due(reason=self._death_in_log)
        self._death_in_log = False
        # The counts read the GPUs too; where they come too seldom, a sample due is a read for the GPUs
        # alone. On a counted cluster the first count (at most two polls in) is also the first sample.
        first = self.nodes is not None and self._read_at == float("-inf")
        sample = (self._sample_reads and self.usage_file is not None and not first
                  and time.monotonic() - self._read_at >= self.sample_interval)
        if not (count or sample):
            return None
        nodes = await self.read(hook)
        if self.nodes is None or not count:
            return None
        alive = self.nodes.expected if nodes is None else sum(1 for n in nodes if n.alive)  # unreadable: no verdict
        return alive if self.nodes.counted(alive) else None

    async def read(self, hook: Any) -> list[Any] | None:
        """Ray's node summary (None when it could not be read); keeps its GPU readings, and queues a
        sample of them for the run's GPU usage file when one is due."""
        now = self._read_at = time.monotonic()
        try:
            at, nodes = await self.reads.read(self.cluster, self.max_age, hook.anodes)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self.log.warning("Could not read the Ray nodes of %s: %s", self.job_id, e)
            return None
        self.gpus = [NodeGpuSample(time=at, node_id=n.node_id, node_ip=n.ip, gpus=n.gpus)
                     for n in nodes if n.alive and n.gpus]
        if self.usage_file is not None and self.gpus and now - self._sampled_at >= self.sample_interval:
            self._to_write += sample_lines(self.gpus)
            self._sampled_at = now
        return list(nodes)

    def writes(self, *, final: bool = False) -> list[FileWrite]:
        """The queued GPU samples' append to the run's GPU usage file, when one is due (``final``: the
        wait ends)."""
        now = time.monotonic()
        if not self._to_write or self.usage_file is None or (not final
                                                              and now - self._appended_at < GPU_WRITE_INTERVAL_S):
            return []
        lines, self._to_write, self._appended_at = self._to_write, [], now
        path = self.usage_file
        return [FileWrite("record the GPU usage (not recorded from now on)", lambda: append_lines(path, lines),
                          self._failed)]

    def _failed(self, error: OSError) -> None:
        self.usage_file = None
