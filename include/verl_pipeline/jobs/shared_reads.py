"""What the waiters of one cluster share in one process (the triggerer): reads of its node summary
and of its job list, and how many waiters it has.

A triggerer runs every deferred wait in one event loop. Waiters of one cluster ask the same
questions (which nodes are alive, what each job's status is); one read, at most a fraction of a poll
old, answers them all, so a cluster of N waiters is read about twice per poll interval instead of N
times. The process's instances live with the trigger (``airflow/triggers.py``), which hands them to
the parts of each wait.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

#: A cluster as its waiters share reads of it: its dashboard URL and the Airflow connection.
Cluster = tuple[str, str]

#: The waiters of one cluster (in one triggerer) share its node summary: a read serves every waiter of
#: that cluster that needs one within this share of its poll interval, so a node loss is seen at most
#: half a poll later than by reading for each waiter, and a cluster of N waiters is read about twice
#: per poll interval instead of N / 2 times.
NODE_SUMMARY_SHARED_FOR_POLLS = 0.5
#: Likewise the job statuses: with at least ``JOB_LIST_MIN_WAITERS`` waiters on one cluster, one read
#: of Ray's job list (``GET /api/jobs/``) at most half a poll old gives each its job's status instead of
#: a request per waiter per poll; a job's end is seen at most half a poll later.
JOB_LIST_SHARED_FOR_POLLS = 0.5
JOB_LIST_MIN_WAITERS = 2
#: Ray's list holds every job the cluster ever ran. Longer than this many jobs per waiter, one list
#: costs more than the waiters' own reads: they read their own until enough waiters joined for the
#: length last read, or ``JOB_LIST_RETRY_S`` passed (the list is read again to measure it).
JOB_LIST_MAX_PER_WAITER = 8
JOB_LIST_RETRY_S = 600.0
#: Shared reads older than this are dropped when another is kept (dead clusters, loops).
_SHARED_READS_KEPT_S = 600.0


@dataclass
class _SharedRead:
    loop: asyncio.AbstractEventLoop
    started: float
    task: asyncio.Task[tuple[float, Any]]


class SharedClusterReads:
    """The latest read of one kind (node summary, job list) of each cluster, shared by its waiters.

    Keyed by the cluster (its dashboard URL and connection) and the event loop (a triggerer runs
    every trigger in one loop; ``airflow dags test`` runs each in its own): a waiter takes a read
    started at most ``max_age`` seconds ago, finished or in flight, else starts one with its own
    hook. A read that failed is not shared.
    """

    def __init__(self) -> None:
        self._reads: dict[Cluster, _SharedRead] = {}

    async def read(self, cluster: Cluster, max_age: float, read: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
        """``(time.time() when read, what was read)``; raises what the read raised."""
        loop, now = asyncio.get_running_loop(), time.monotonic()
        shared = self._reads.get(cluster)
        if (shared is None or shared.loop is not loop or now - shared.started > max_age
                or (shared.task.done() and (shared.task.cancelled() or shared.task.exception() is not None))):
            for key in [k for k, r in self._reads.items() if now - r.started > _SHARED_READS_KEPT_S]:
                del self._reads[key]

            async def timed() -> tuple[float, Any]:
                result = await read()
                return time.time(), result

            shared = self._reads[cluster] = _SharedRead(loop, now, loop.create_task(timed()))
        # A waiter cancelled mid-read (its job ended, the triggerer stops it) leaves the read to the others.
        return await asyncio.shield(shared.task)


class ClusterWaiters:
    """How many waiters of each cluster this process runs now (per event loop), and how long each
    cluster's job list was when last read."""

    def __init__(self) -> None:
        self._count: dict[tuple[Cluster, asyncio.AbstractEventLoop], int] = {}
        self._list_length: dict[Cluster, tuple[int, float]] = {}

    def join(self, cluster: Cluster) -> None:
        key = (cluster, asyncio.get_running_loop())
        self._count[key] = self._count.get(key, 0) + 1

    def leave(self, cluster: Cluster) -> None:
        key = (cluster, asyncio.get_running_loop())
        left = self._count.get(key, 0) - 1
        if left > 0:
            self._count[key] = left
        else:
            self._count.pop(key, None)

    def count(self, cluster: Cluster) -> int:
        return self._count.get((cluster, asyncio.get_running_loop()), 0)

    def share_job_list(self, cluster: Cluster) -> bool:
        """Whether the cluster's waiters read their statuses from its job list: enough of them, and the
        list, as last read, not longer than they are worth (read again after ``JOB_LIST_RETRY_S``)."""
        waiters = self.count(cluster)
        if waiters < JOB_LIST_MIN_WAITERS:
            return False
        seen = self._list_length.get(cluster)
        return (seen is None or seen[0] <= JOB_LIST_MAX_PER_WAITER * waiters
                or time.monotonic() - seen[1] > JOB_LIST_RETRY_S)

    def job_list_read(self, cluster: Cluster, jobs: int) -> None:
        self._list_length[cluster] = (jobs, time.monotonic())
