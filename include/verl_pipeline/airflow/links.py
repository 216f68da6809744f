"""A task button in the Airflow UI that opens the Ray dashboard page of the task's job."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink


class RayJobLink(BaseOperatorLink):
    """``Ray job``: the dashboard URL is stored in XCom when the job is submitted or waited on."""

    name = "Ray job"

    def persist(self, context: Any, url: str) -> None:
        context["ti"].xcom_push(key=self.xcom_key, value=url)

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(key=self.xcom_key, ti_key=ti_key)
        return str(value) if value else ""
