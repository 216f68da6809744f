"""The package as an Airflow provider: what ``pip install verl-pipeline`` registers in an existing Airflow.

Airflow reads :func:`get_provider_info` through the ``apache_airflow_provider`` entry point (pyproject.toml)
and lists it with ``airflow providers list``: the operators, the hook and its connection type (the
connection form of "Ray (verl pipeline)" in the UI), the trigger and the buttons. Every class is named by
its dotted path, so reading the info imports nothing of Airflow or Ray.

What a provider cannot register stays in ``plugins/verl_pipeline_plugin.py``: the report app served by the
API server, the "Run report" tab, and the buttons' attachment to the operators (Airflow 3 shows a
provider's extra links only in ``airflow providers links``; a plugin's are the ones on the task). A
provider's own ``plugins`` entries load only with ``[core] lazy_discover_providers = False``, and beside
the plugins folder they would register the plugin twice, so the info names none.
"""

from __future__ import annotations

from typing import Any

from verl_pipeline import __version__

#: The distribution's name: Airflow refuses a provider whose info names another.
PACKAGE_NAME = "verl-pipeline"
#: The connection type of :class:`~verl_pipeline.airflow.hooks.RayJobsHook` (its ``conn_type``).
CONNECTION_TYPE = "verl_ray"
INTEGRATION = "verl on Ray"

_OPERATOR_MODULES = [f"verl_pipeline.airflow.operators.{step}" for step in
                     ("provision", "preprocess", "models", "submit", "wait", "export", "report", "teardown")]


def get_provider_info() -> dict[str, Any]:
    """The provider's metadata in the form of Airflow's ``provider_info.schema.json``."""
    return {
        "package-name": PACKAGE_NAME,
        "name": "verl pipeline",
        "description": "verl RL post-training (PPO/GRPO) on Ray clusters: operators, a deferrable wait, the Ray "
                       "Jobs hook and its connection type.",
        "versions": [__version__],
        "integrations": [{
            "integration-name": INTEGRATION,
            "external-doc-url": "https://verl.readthedocs.io/",
            "tags": ["ml"],
        }],
        "operators": [{"integration-name": INTEGRATION,
                       "python-modules": [*_OPERATOR_MODULES, "verl_pipeline.airflow.retrain"]}],
        "hooks": [{"integration-name": INTEGRATION, "python-modules": ["verl_pipeline.airflow.hooks"]}],
        "triggers": [{"integration-name": INTEGRATION, "python-modules": ["verl_pipeline.airflow.triggers"]}],
        "connection-types": [{
            "hook-class-name": "verl_pipeline.airflow.hooks.RayJobsHook",
            "hook-name": "Ray (verl pipeline)",
            "connection-type": CONNECTION_TYPE,
            "ui-field-behaviour": {
                "hidden-fields": ["login"],
                "relabeling": {"password": "Ray auth token", "schema": "Scheme"},
                "placeholders": {"host": "ray-head", "port": "8265", "schema": "http or https",
                                 "password": "the cluster's token (RAY_AUTH_MODE=token)"},
            },
            "conn-fields": {
                "dashboard_url": {"label": "Dashboard URL (instead of scheme://host:port)",
                                  "schema": {"type": ["string", "null"]}},
                "ca_bundle": {"label": "CA bundle that verifies https", "schema": {"type": ["string", "null"]}},
            },
        }],
        "extra-links": [
            "verl_pipeline.airflow.links.RayJobLink",
            "verl_pipeline.airflow.report_link.RunReportLink",
            "verl_pipeline.airflow.links.MlflowRunLink",
        ],
    }
