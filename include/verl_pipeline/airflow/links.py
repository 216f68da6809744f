"""The task buttons of the submit and wait tasks in the Airflow UI: the job's Ray dashboard page, through
Airflow (``Ray job``), and the run's page on its MLflow server (``MLflow run``). The wait task's ``Run
report`` button is the API server's own (:mod:`verl_pipeline.airflow.report_link`)."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperatorLink

from verl_pipeline.airflow.report_app import dashboard_url
from verl_pipeline.jobs.ids import job_page_url


def job_link(dag_id: str, run_id: str, submission_id: str, *, base_url: str) -> str:
    """The job's page in the run's dashboard as the API server proxies it (the cluster's token is added
    there, behind Airflow's read access to the run: :mod:`verl_pipeline.airflow.dashboard_proxy`)."""
    return job_page_url(dashboard_url(dag_id, run_id, base_url=base_url), submission_id)


class RayJobLink(BaseOperatorLink):
    """``Ray job``: the job's dashboard page, stored in XCom when the job is submitted or waited on.

    Always the proxied page, whatever the cluster's auth: the dashboard's own address is often
    reachable only from the cluster's network (a loopback head on a worker, a Slurm node), and the
    proxy applies Airflow's access check to a cluster without auth too. The direct address stays in
    the task log for those on the cluster's network.
    """

    name = "Ray job"

    def persist(self, context: Any, submission_id: str) -> None:
        from airflow.sdk.configuration import conf  # the task's view of airflow.cfg

        url = job_link(context["dag"].dag_id, context["run_id"], submission_id,
                       base_url=conf.get("api", "base_url", fallback=""))
        context["ti"].xcom_push(key=self.xcom_key, value=url)

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(key=self.xcom_key, ti_key=ti_key)
        return str(value) if value else ""


class MlflowRunLink(BaseOperatorLink):
    """``MLflow run``: the run's page on the MLflow server, stored in XCom once the run is found."""

    name = "MLflow run"

    def persist(self, context: Any, url: str) -> None:
        context["ti"].xcom_push(key=self.xcom_key, value=url)

    def get_link(self, operator: Any, *, ti_key: Any) -> str:
        from airflow.sdk.execution_time.xcom import XCom

        value = XCom.get_value(key=self.xcom_key, ti_key=ti_key)
        return str(value) if value else ""


def persist_tracker_links(context: Any, links: dict[str, str]) -> None:
    """Store the tracker pages (``tracker_links`` of the submit task's result) for this task's buttons.

    A run without MLflow stores an empty link (no button): Airflow reads every extra link's XCom when
    the task ends and logs an error for one that is missing."""
    MlflowRunLink().persist(context, links.get(MlflowRunLink.name) or "")


__all__ = ["MlflowRunLink", "RayJobLink", "job_link", "persist_tracker_links"]
