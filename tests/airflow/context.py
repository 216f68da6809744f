"""The part of an Airflow task context the pipeline's operators read, for tests that call ``execute``
directly: XCom by task id (and key), pushes, the DAG's id — and what the provision task leaves for
every later task (the run's frozen spec, its directory in XCom)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from verl_pipeline.airflow.operators.base import freeze_run, provisioned_spec
from verl_pipeline.airflow.task_ids import PROVISION_TASK
from verl_pipeline.spec import RunSpec

#: Airflow's key of a task's return value.
RETURN_VALUE = "return_value"


class FakeTI:
    """A task instance whose ``xcom_pull(task_ids=…, key=…)`` returns the given results.

    ``xcoms`` maps a task id to its return value, and ``"<task id>:<key>"`` to another key's value;
    ``xcom_push`` records ``"pushed:<key>"`` (and ``"<task_id>:<key>"`` when the TI has a task id).
    """

    def __init__(self, xcoms: dict[str, Any], *, task_id: str | None = None) -> None:
        self.xcoms = xcoms
        self.task_id = task_id

    def xcom_pull(self, task_ids: str, key: str = RETURN_VALUE) -> Any:
        return self.xcoms.get(task_ids if key == RETURN_VALUE else f"{task_ids}:{key}")

    def xcom_push(self, key: str, value: Any) -> None:
        self.xcoms[f"pushed:{key}"] = value
        if self.task_id:
            self.xcoms[f"{self.task_id}:{key}"] = value


@dataclass(frozen=True)
class FakeDag:
    dag_id: str = "verl_ppo"


def task_context(xcoms: dict[str, Any], params: dict[str, Any] | None = None, *, run_id: str | None = None,
                 **extra: Any) -> dict[str, Any]:
    """A context of its own run (run directories, attempt records are per run) unless ``run_id`` is given."""
    return {"ti": FakeTI(xcoms), "params": params or {}, "run_id": run_id or f"manual__test_{time.time_ns()}",
            "dag": FakeDag(), **extra}


def provisioned(context: dict[str, Any]) -> RunSpec:
    """What the provision task leaves behind for ``context``'s run (:func:`freeze_run`): its spec,
    frozen, and the XCom that names its directory — without a cluster."""
    spec = provisioned_spec(context)
    ti = context["ti"]
    task_id, ti.task_id = ti.task_id, PROVISION_TASK
    try:
        freeze_run(context, spec)
    finally:
        ti.task_id = task_id
    return spec
