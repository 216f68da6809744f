"""Validate the run, then start or reach its Ray cluster."""

from __future__ import annotations

from typing import Any

from verl_pipeline.airflow.operators.base import (
    PipelineOperator,
    connection,
    freeze_run,
    provisioned_spec,
    task_error,
)
from verl_pipeline.airflow.tracker_connections import check_tracker_connections
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.rundir import RunDir


class ProvisionRayClusterOperator(PipelineOperator):
    """Validate the run (params, profiles, verl's own config checks), freeze it, then start or reach the cluster.

    Nothing starts when validation fails. The spec is saved in the run directory (``run_spec.json``,
    XCom ``run_dir`` says where) and every later task, retry and resubmission reads it from there;
    a retry of this task keeps the spec the run was first provisioned with. Returns the cluster handle.
    """

    ui_color = "#d6eaf8"

    def __init__(self, *, validate_with_verl: bool = True, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.validate_with_verl = validate_with_verl

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps
        from verl_pipeline.evaluation.held_out import check_held_out

        try:
            spec = provisioned_spec(context)
            self.log.info("Run %s: profile %s (model %s, cluster %s), target %d x %d GPU(s), mode %s",
                          spec.run_name, spec.profile, spec.model_profile, spec.cluster_profile, spec.nnodes,
                          spec.n_gpus_per_node, spec.mode.value)
            for key, rule in spec.derived.items():
                self.log.info("derived %s: %s", key, rule)
            if self.validate_with_verl:
                steps.validate_spec_with_verl(spec, record_in=RunDir(spec.run_dir), reuse=True)
            check_tracker_connections(spec)  # a tracker without its connection fails before any cluster
            check_held_out(spec)  # the held-out rows an evaluation would score, before any cluster
            freeze_run(context, spec)  # checked: what every later task, retry and resubmission reads
            endpoint = None
            conn_id = self.conn_id or spec.cluster.get("conn_id")
            if spec.cluster.get("backend") == "address" and conn_id and not spec.cluster.get("dashboard_url"):
                from verl_pipeline.airflow.hooks import endpoint_from_connection

                endpoint = endpoint_from_connection(connection(conn_id))
            handle = steps.provision(spec, endpoint=endpoint)
        except PipelineError as e:
            raise task_error(e) from e
        return handle.to_dict()
