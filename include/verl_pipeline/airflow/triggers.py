"""Deferrable wait on a Ray job: polls with async HTTP, forwards new log lines, yields one event."""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

from verl_pipeline.constants import JobState

CLASSPATH = "verl_pipeline.airflow.triggers.RayJobTrigger"


class RayJobTrigger(BaseTrigger):
    """Wait until a Ray job is terminal.

    Never raises: every outcome is one ``TriggerEvent`` with ``status`` ``success``, ``failed``,
    ``stopped``, ``node_lost`` or ``error``, plus ``job_id``, ``message`` and ``log_offset``
    (characters of the job log already forwarded, so a resumed trigger does not repeat them).

    ``node_lost``: fewer Ray nodes than the cluster was provisioned with stayed alive for
    ``node_grace_polls`` polls while the job still ran. A job can hang instead of failing when a
    node dies (collectives waiting on a dead peer, work waiting for a node that will not return),
    so the waiter does not wait for the job to notice.
    """

    def __init__(
        self,
        *,
        cluster: dict[str, Any],
        job_id: str,
        conn_id: str | None = None,
        poll_interval: float = 5.0,
        log_offset: int = 0,
        forward_logs: bool = True,
        max_poll_errors: int = 12,
        expected_nodes: int = 0,
        node_grace_polls: int = 3,
    ) -> None:
        super().__init__()
        self.cluster = cluster
        self.job_id = job_id
        self.conn_id = conn_id
        self.poll_interval = poll_interval
        self.log_offset = log_offset
        self.forward_logs = forward_logs
        self.max_poll_errors = max_poll_errors
        self.expected_nodes = expected_nodes
        self.node_grace_polls = node_grace_polls

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (
            CLASSPATH,
            {
                "cluster": self.cluster,
                "job_id": self.job_id,
                "conn_id": self.conn_id,
                "poll_interval": self.poll_interval,
                "log_offset": self.log_offset,
                "forward_logs": self.forward_logs,
                "max_poll_errors": self.max_poll_errors,
                "expected_nodes": self.expected_nodes,
                "node_grace_polls": self.node_grace_polls,
            },
        )

    def _hook(self) -> Any:
        from verl_pipeline.airflow.hooks import RayJobsHook

        return RayJobsHook(self.cluster, conn_id=self.conn_id)

    async def _forward(self, hook: Any) -> None:
        logs = await hook.alogs(self.job_id)
        if len(logs) <= self.log_offset:
            return
        chunk = logs[self.log_offset:]
        # Forward whole lines only; a partial last line waits for the next poll.
        cut = chunk.rfind("\n") + 1
        if cut == 0:
            return
        for line in chunk[:cut].splitlines():
            self.log.info("[%s] %s", self.job_id, line)
        self.log_offset += cut

    async def run(self) -> AsyncIterator[TriggerEvent]:
        errors = 0
        short_polls = 0
        try:
            hook = self._hook()
            while True:
                try:
                    info = await hook.aget_job(self.job_id)
                    if self.forward_logs and info is not None:
                        await self._forward(hook)
                    errors = 0
                except asyncio.CancelledError:
                    raise
                except Exception as e:  # the cluster may be briefly unreachable: retry a few times
                    errors += 1
                    self.log.warning("Polling Ray job %s failed (%d/%d): %s", self.job_id, errors,
                                     self.max_poll_errors, e)
                    if errors >= self.max_poll_errors:
                        yield TriggerEvent({"status": "error", "job_id": self.job_id, "log_offset": self.log_offset,
                                            "message": f"Ray Jobs API unreachable: {e}"})
                        return
                    await asyncio.sleep(self.poll_interval)
                    continue
                if info is None:
                    yield TriggerEvent({"status": "error", "job_id": self.job_id, "log_offset": self.log_offset,
                                        "message": f"Ray job {self.job_id} does not exist on the cluster"})
                    return
                if info.status.is_terminal():
                    if self.forward_logs:
                        try:
                            await self._forward(hook)
                        except Exception as e:
                            self.log.warning("Could not read the last logs of %s: %s", self.job_id, e)
                    status = {JobState.SUCCEEDED: "success", JobState.STOPPED: "stopped"}.get(info.status, "failed")
                    yield TriggerEvent({
                        "status": status, "job_id": self.job_id, "job_status": info.status.value,
                        "message": info.message, "driver_exit_code": info.driver_exit_code,
                        "log_offset": self.log_offset,
                    })
                    return
                if self.expected_nodes:
                    try:
                        alive = await hook.anodes_alive()
                    except asyncio.CancelledError:
                        raise
                    except Exception as e:
                        self.log.warning("Could not count the Ray nodes of %s: %s", self.job_id, e)
                        alive = self.expected_nodes
                    short_polls = short_polls + 1 if alive < self.expected_nodes else 0
                    if short_polls >= self.node_grace_polls:
                        yield TriggerEvent({
                            "status": "node_lost", "job_id": self.job_id, "job_status": info.status.value,
                            "log_offset": self.log_offset,
                            "message": f"Ray node died: {alive} of {self.expected_nodes} nodes alive while job "
                                       f"{self.job_id} was {info.status.value}",
                        })
                        return
                await asyncio.sleep(self.poll_interval)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            yield TriggerEvent({"status": "error", "job_id": self.job_id, "log_offset": self.log_offset,
                                "message": str(e), "stack_trace": traceback.format_exc()})
