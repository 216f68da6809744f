from __future__ import annotations

import runpy
from pathlib import Path

import pytest

from verl_pipeline.airflow.links import MlflowRunLink, RayJobLink, job_link
from verl_pipeline.airflow.operators import SubmitVerlJobOperator, WaitForVerlJobOperator
from verl_pipeline.airflow.report_app import URL_PREFIX, dashboard_url
from verl_pipeline.airflow.report_link import RunReportLink
from verl_pipeline.jobs.ids import job_page_url

REPO = Path(__file__).resolve().parents[2]


def test_plugin_registers_the_links_the_report_app_and_the_run_view() -> None:
    from verl_pipeline.airflow.report_app import ReportApp, view_href

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


def test_the_ray_job_button_is_the_proxied_job_page() -> None:
    run_id = "manual__2026-12-01T15:46:29.123+00:00"
    quoted = "manual__2026-12-01T15%3A46%3A29.123%2B00%3A00"
    assert dashboard_url("verl_ppo", run_id, base_url="") == f"{URL_PREFIX}/runs/verl_ppo/{quoted}/dashboard/"
    assert job_link("verl_ppo", run_id, "verl-x-a1", base_url="http://h:8080/airflow/") == (
        f"http://h:8080/airflow{URL_PREFIX}/runs/verl_ppo/{quoted}/dashboard/#/jobs/verl-x-a1")


def test_the_button_is_persisted_under_its_xcom_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.airflow.context import FakeDag, FakeTI

    monkeypatch.setenv("AIRFLOW__API__BASE_URL", "http://airflow.example:8080")
    ti = FakeTI({})
    RayJobLink().persist({"ti": ti, "dag": FakeDag(), "run_id": "manual__r"}, "verl-x-a1")
    assert ti.xcoms == {f"pushed:{RayJobLink().xcom_key}":
                        f"http://airflow.example:8080{URL_PREFIX}/runs/verl_ppo/manual__r/dashboard/#/jobs/verl-x-a1"}
