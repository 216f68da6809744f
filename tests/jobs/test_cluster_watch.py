"""The nodes-and-GPUs part of a wait, alone: node counts, GPU readings and samples, on a scripted node summary."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.client import NodeInfo
from verl_pipeline.jobs.cluster_watch import ClusterWatch
from verl_pipeline.jobs.gpu_usage import read_samples, readings_from_summary
from verl_pipeline.jobs.run_files import write_all
from verl_pipeline.jobs.shared_reads import SharedClusterReads


class Summary:
    """Ray's node summary as the hook reads it: ``alive[i]`` nodes alive on read ``i`` (the last from
    then on), each worker with two GPUs."""

    def __init__(self, alive: list[int]) -> None:
        self.alive = alive
        self.reads = 0

    async def anodes(self) -> list[NodeInfo]:
        alive = self.alive[min(self.reads, len(self.alive) - 1)]
        self.reads += 1
        gpus = readings_from_summary([{"index": i, "utilizationGpu": 50 + i, "memoryUsed": 1000, "memoryTotal": 8000,
                                       "uuid": f"GPU-{i}"} for i in range(2)])
        return [NodeInfo(f"{k:056d}", k < alive, k == 0, f"10.0.0.{k}", {}, () if k == 0 else gpus) for k in range(3)]


def _watch(*, expected: int = 3, usage: Path | None = None, interval: float = 10.0, poll: float = 1e-6) -> ClusterWatch:
    # Polls a microsecond apart: each look reads the summary afresh (no earlier read is recent enough to share).
    return ClusterWatch(job_id="j", expected_nodes=expected, grace_polls=2, usage_file=usage, sample_interval=interval,
                        poll_interval=poll, reads=SharedClusterReads(), cluster=("http://d:8265", ""),
                        log=logging.getLogger("test.cluster_watch"))


def _looks(watch: ClusterWatch, hook: Any, polls: int, *, died_on: int | None = None) -> list[int | None]:
    async def run() -> list[int | None]:
        out = []
        for poll in range(1, polls + 1):
            if poll == died_on:
                watch.observe_record("ray.exceptions.ActorDiedError: The actor died unexpectedly")
            out.append(await watch.look(hook))
        return out

    return asyncio.run(run())


def test_nodes_are_counted_every_other_poll_and_a_loss_confirmed_by_the_grace_counts() -> None:
    hook = Summary([3, 2])
    # Counts on polls 2 and 4 (all alive, then 2 of 3), every poll once short: lost on the 2nd short count.
    assert _looks(_watch(), hook, 5) == [None, None, None, None, 2]
    assert hook.reads == 3


def test_a_line_that_says_something_died_counts_the_nodes_on_the_next_look() -> None:
    hook = Summary([3])
    watch = _watch()
    _looks(watch, hook, 3, died_on=1)
    assert hook.reads == 2  # polls 1 (the death) and 3 (every other poll from then)


def test_gpus_are_kept_from_each_read_and_sampled_at_most_once_per_interval(tmp_path: Path) -> None:
    usage = tmp_path / "gpu-usage.jsonl"
    watch = _watch(usage=usage, interval=3600.0)
    _looks(watch, Summary([3]), 4)
    summary = watch.summary()
    assert summary is not None and (summary.nodes, summary.gpus, summary.min_pct) == (2, 4, 50.0)
    assert write_all(watch.writes()) == [] and watch.writes() == []  # one sample within the hour, written once
    samples = list(read_samples(usage))
    assert [s.node_ip for s in samples] == ["10.0.0.1", "10.0.0.2"]  # the GPU nodes; the head has none


def test_on_a_cluster_it_does_not_count_the_summary_is_read_for_gpu_samples_alone(tmp_path: Path) -> None:
    hook = Summary([3])
    watch = _watch(expected=0, usage=tmp_path / "gpu-usage.jsonl", interval=3600.0)
    assert _looks(watch, hook, 5) == [None] * 5 and hook.reads == 1
    quiet = Summary([3])
    _looks(_watch(expected=0, usage=None), quiet, 5)
    assert quiet.reads == 0 and not _watch(expected=0, usage=None).reads_nodes


def test_a_usage_file_that_cannot_be_written_is_not_tried_again(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    watch = _watch(usage=tmp_path / "file" / "gpu-usage.jsonl", interval=1e-9)
    _looks(watch, Summary([3]), 2)
    (failed,) = write_all(watch.writes())
    failed[0].failed(failed[1])
    assert watch.usage_file is None
    _looks(watch, Summary([3]), 2)
    assert watch.writes() == []


def test_a_sample_due_between_two_counts_reads_the_gpus_alone(tmp_path: Path) -> None:
    """Polls as long as the sample interval: the counts (every other poll) would sample every two
    intervals; the polls between read the summary for the GPUs."""
    hook = Summary([3])
    watch = _watch(usage=tmp_path / "gpu-usage.jsonl", interval=1e-9)
    _looks(watch, hook, 4)
    assert hook.reads == 3  # polls 2 and 4 count, poll 3 samples (poll 1 leaves the first sample to the first count)
    hourly = Summary([3])
    _looks(_watch(usage=tmp_path / "other.jsonl", interval=3600.0), hourly, 4)
    assert hourly.reads == 2  # the counts alone


def test_samples_are_appended_once_a_minute_and_when_the_wait_ends(tmp_path: Path) -> None:
    usage = tmp_path / "gpu-usage.jsonl"
    watch = _watch(usage=usage, interval=1e-9)
    _looks(watch, Summary([3]), 2)  # the first count: its sample goes out at once
    assert len(watch.writes()) == 1 and watch.writes() == []
    _looks(watch, Summary([3]), 6)
    assert watch.writes() == []  # within GPU_WRITE_INTERVAL_S of the last append: kept for the next
    (last,) = watch.writes(final=True)
    last.write()
    assert len(list(read_samples(usage))) == 2 * 6  # every sample since the first append, two GPU nodes each


def test_a_late_poll_adds_no_read_where_the_counts_keep_up_with_the_samples(tmp_path: Path) -> None:
    """5 s polls, a sample every 10 s: the counts (every other poll) bring every sample. A poll that
    comes late on a busy triggerer does not read for the GPUs alone (it would add to the load)."""
    import time

    hook = Summary([3])
    watch = _watch(usage=tmp_path / "gpu-usage.jsonl", interval=10.0, poll=5.0)
    watch.reads = SharedClusterReads()
    watch.max_age = 0.0  # each count reads afresh here

    async def run() -> None:
        for _ in range(6):
            watch._read_at = time.monotonic() - 60.0  # as if the last read were a minute ago
            await watch.look(hook)

    asyncio.run(run())
    assert hook.reads == 3  # the counts: polls 2, 4 and 6
