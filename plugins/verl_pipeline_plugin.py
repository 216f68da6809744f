"""Registers the verl pipeline's UI pieces with Airflow: the "Ray job", "Run report" and "MLflow run" task buttons,
the app the API server serves behind Airflow's auth (run reports, and each run's Ray dashboard with the cluster's
token added by the server) and a "Run report" tab on DAG runs."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from verl_pipeline.airflow.links import MlflowRunLink, RayJobLink
from verl_pipeline.airflow.report_app import URL_PREFIX, ReportApp, view_href
from verl_pipeline.airflow.report_link import RunReportLink


class VerlPipelinePlugin(AirflowPlugin):
    name = "verl_pipeline"
    operator_extra_links = [RayJobLink(), RunReportLink(), MlflowRunLink()]
    fastapi_apps = [{"app": ReportApp(), "url_prefix": URL_PREFIX,
                     "name": "verl pipeline run reports and Ray dashboards"}]
    external_views = [{
        "name": "Run report",
        "href": view_href(),
        "destination": "dag_run",
        "url_route": "verl-run-report",
    }]
