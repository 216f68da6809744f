"""When the job's allocation ends, told to verl so it saves a checkpoint before it.

verl saves ahead of a deadline when ``MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP`` (epoch
seconds) is set in its workers' environment: after each step, ``should_save_ckpt_esi`` saves when
the time left is at most the longest step so far + 60 s (its save estimate) +
``trainer.esi_redundant_time``. In verl 0.9.1 only the legacy trainer (``trainer.use_v1=false``)
calls it; the default V1 trainer ignores the deadline (the pipeline says so in the task log).

The pipeline knows the end of an allocation from:

- the cluster's backend (``ClusterBackend.end_time``: a Slurm job's ``EndTime``), read at each
  submit (``cluster.registry.cluster_deadline``), so a retry on a new allocation gets the new end;
- the Airflow task's ``execution_timeout``: its start + the timeout (Airflow stops the job then),
  passed by the caller.

The earliest one wins (:func:`earliest`).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from verl_pipeline.trainer.render import RenderedJob, with_settings

log = logging.getLogger(__name__)

DEADLINE_ENV = "MLP_CURRENT_CAPACITY_BLOCK_EXPIRATION_TIMESTAMP"
REDUNDANT_KEY = "trainer.esi_redundant_time"


@dataclass(frozen=True)
class Deadline:
    """The end of an allocation (epoch seconds) and what sets it, for the log."""

    at: float
    source: str

    def describe(self, now: float | None = None) -> str:
        left = self.at - (time.time() if now is None else now)
        stamp = datetime.fromtimestamp(self.at).isoformat(timespec="seconds")
        return f"{stamp} ({left:.0f}s from now, {self.source})"


def earliest(deadlines: Iterable[Deadline | None]) -> Deadline | None:
    known = [d for d in deadlines if d is not None]
    return min(known, key=lambda d: d.at) if known else None


def task_deadline(start: datetime | None, execution_timeout: timedelta | None) -> Deadline | None:
    """The Airflow task's end: its start + ``execution_timeout`` (None without a timeout)."""
    if start is None or execution_timeout is None:
        return None
    return Deadline((start + execution_timeout).timestamp(), f"the Airflow task's execution_timeout "
                    f"{execution_timeout}")


def with_deadline(job: RenderedJob, deadline: Deadline | None, *, job_id: str) -> RenderedJob:
    """``job`` with the deadline in its runtime_env (every worker inherits it) and verl's margin set."""
    if deadline is None:
        return job
    env = copy.deepcopy(job.runtime_env)
    env.setdefault("env_vars", {})[DEADLINE_ENV] = str(int(deadline.at))
    job = with_settings(job, {REDUNDANT_KEY: job.settings.get(REDUNDANT_KEY, 0)},
                        {REDUNDANT_KEY: f"{job.settings.get(REDUNDANT_KEY, 0)!r} — verl saves when the time left "
                                        "<= longest step + 60 s + this; the deadline is $" + DEADLINE_ENV})
    if job.settings.get("trainer.use_v1", True) is not False:
        log.warning("Ray job %s: the allocation ends at %s, but verl 0.9.1's default V1 trainer does not save "
                    "ahead of a deadline (only trainer.use_v1=false calls should_save_ckpt_esi): steps since the "
                    "last save_freq save are lost when it ends", job_id, deadline.describe())
    else:
        log.info("Ray job %s: the allocation ends at %s; verl saves a checkpoint before it", job_id,
                 deadline.describe())
    return replace(job, runtime_env=env)


__all__ = ["DEADLINE_ENV", "Deadline", "earliest", "task_deadline", "with_deadline"]
