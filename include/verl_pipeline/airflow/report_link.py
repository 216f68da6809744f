"""The ``Run report`` button of the wait task: the run's report page, once the run has one."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink

from verl_pipeline.airflow.operators import WaitForVerlJobOperator
from verl_pipeline.airflow.report_app import ReportNotFound, find_report, report_url


class RunReportLink(BaseOperatorLink):
    """``Run report``: the run's report page, served by this project's plugin in the API server
    (:mod:`verl_pipeline.airflow.report_app`). The plugin attaches it to the wait task by operator class
    (:attr:`operators`), so the API server itself computes it: empty until the run has a report."""

    name = "Run report"

    @property
    def operators(self) -> list[type[Any]]:  # type: ignore[override]
        return [WaitForVerlJobOperator]

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.configuration import conf
        from airflow.utils.session import create_session

        with create_session() as session:
            try:
                find_report(ti_key.dag_id, ti_key.run_id, session=session)
            except ReportNotFound:
                return ""
        return report_url(ti_key.dag_id, ti_key.run_id, base_url=conf.get("api", "base_url", fallback=""))
