"""The part of an Airflow task context the pipeline's file-only operators read, for tests that call
``execute`` directly: XCom by task id, the DAG's id."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class FakeTI:
    """A task instance whose ``xcom_pull(task_ids=…)`` returns the given results."""

    def __init__(self, xcoms: dict[str, Any]) -> None:
        self.xcoms = xcoms

    def xcom_pull(self, task_ids: str) -> Any:
        return self.xcoms.get(task_ids)


@dataclass(frozen=True)
class FakeDag:
    dag_id: str = "verl_ppo"
