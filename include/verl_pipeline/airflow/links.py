"""A task button in the Airflow UI that opens the Ray dashboard page of the task's job."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink


def ray_job_url(dashboard_url: str, submission_id: str) -> str:
    return f"{dashboard_url.rstrip('/')}/#/jobs/{submission_id}"


class RayJobLink(BaseOperatorLink):
    """``Ray job``: the dashboard URL is stored in XCom when the job is submitted or waited on."""

    name = "Ray job"

    def persist(self, context: Any, url: str) -> None:
        context["ti"].xcom_push(key=self.xcom_key, value=url)

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(key=self.xcom_key, ti_key=ti_key)
        return str(value) if value else ""


class RunReportLink(BaseOperatorLink):
    """``Run report``: the run's report page, served by this project's plugin in the API server
    (:mod:`verl_pipeline.airflow.report_app`). The plugin attaches it to the wait task by operator class
    (:attr:`operators`), so the API server itself computes it: empty until the run has a report."""

    name = "Run report"

    @property
    def operators(self) -> list[type[Any]]:  # type: ignore[override]
        # Imported here: the wait operator's module imports this one.
        from verl_pipeline.airflow.operators import WaitForVerlJobOperator

        return [WaitForVerlJobOperator]

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf
        from airflow.utils.session import create_session

        from verl_pipeline.airflow.report_app import ReportNotFound, find_report, report_url

        with create_session() as session:
            try:
                find_report(ti_key.dag_id, ti_key.run_id, session=session)
            except ReportNotFound:
                return ""
        return report_url(ti_key.dag_id, ti_key.run_id, base_url=conf.get("api", "base_url", fallback=""))
