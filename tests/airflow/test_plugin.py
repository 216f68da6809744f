from __future__ import annotations

import runpy
from pathlib import Path

from verl_pipeline.airflow.links import RayJobLink
from verl_pipeline.airflow.operators import SubmitVerlJobOperator, WaitForVerlJobOperator
from verl_pipeline.airflow.report_link import RunReportLink
from verl_pipeline.airflow.tracker_links import MlflowRunLink
from verl_pipeline.jobs.ids import job_page_url

REPO = Path(__file__).resolve().parents[2]


def test_plugin_registers_the_links_the_report_app_and_the_run_view() -> None:
    from verl_pipeline.airflow.report_app import URL_PREFIX, ReportApp, view_href

    ns = runpy.run_path(str(REPO / "plugins" / "verl_pipeline_plugin.py"))
    plugin = ns["VerlPipelinePlugin"]
    assert plugin.name == "verl_pipeline"
    assert [type(link) for link in plugin.operator_extra_links] == [RayJobLink, RunReportLink, MlflowRunLink]
    # Attached by the plugin to the wait task only (Airflow matches the operator's class and module).
    assert RunReportLink().operators == [WaitForVerlJobOperator]
    [app] = plugin.fastapi_apps
    assert isinstance(app["app"], ReportApp) and app["url_prefix"] == URL_PREFIX
    [view] = plugin.external_views
    assert view["destination"] == "dag_run" and view["href"] == view_href() and view["url_route"]


def test_operators_carry_the_link_and_it_points_at_the_job_page() -> None:
    for op in (SubmitVerlJobOperator, WaitForVerlJobOperator):
        assert any(isinstance(link, RayJobLink) for link in op.operator_extra_links)
    assert job_page_url("http://127.0.0.1:8265/", "verl-x-a1") == "http://127.0.0.1:8265/#/jobs/verl-x-a1"


def test_link_is_persisted_under_its_xcom_key() -> None:
    pushed: dict[str, object] = {}

    class TI:
        def xcom_push(self, key: str, value: object) -> None:
            pushed[key] = value

    RayJobLink().persist({"ti": TI()}, "http://h/#/jobs/j")
    assert pushed == {RayJobLink().xcom_key: "http://h/#/jobs/j"}
