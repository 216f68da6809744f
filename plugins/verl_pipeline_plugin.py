"""Registers the verl pipeline's UI pieces with Airflow (the "Ray job" task button)."""

from __future__ import annotations

from airflow.plugins_manager import AirflowPlugin

from verl_pipeline.airflow.links import RayJobLink


class VerlPipelinePlugin(AirflowPlugin):
    name = "verl_pipeline"
    operator_extra_links = [RayJobLink()]
