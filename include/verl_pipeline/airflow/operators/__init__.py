"""Operators of the pipeline's DAGs, one module per step.

Each builds the run's spec from the DAG run's params, calls a plain step from
:mod:`verl_pipeline.steps` (Ray I/O through :class:`~verl_pipeline.airflow.hooks.RayJobsHook`), and
returns a small JSON-able result for XCom.

==================  ===========================================================================
module              step
==================  ===========================================================================
``provision``       validate the run (params, profiles, verl's own checks), start/reach the cluster
``preprocess``      the data as verl's parquet, and the preprocessed-data Asset
``models``          plan the run's models; prefetch each into the shared cache
``submit``          render, probe every node, submit the verl job (or reattach)
``wait``            defer to the trigger; act on the one decision of :mod:`verl_pipeline.jobs.outcome`
``export``          merge the trained model (verl's merger), verify it, publish ``models/<profile>``
``evaluate``        score the trained, base and champion models on the run's cluster
``report``          the run report (report.json, plots, report.html), for failed runs too
``teardown``        stop the job, release the cluster — always; ``cleanup_failed_run`` for runs
                    that ended without their teardown task
==================  ===========================================================================
"""

from __future__ import annotations

from verl_pipeline.airflow.operators.base import HF_CONN_ID, PipelineOperator, run_name, spec_from_context
from verl_pipeline.airflow.operators.evaluate import EvaluateModelOperator
from verl_pipeline.airflow.operators.export import ExportModelOperator
from verl_pipeline.airflow.operators.models import PlanModelsOperator, PrefetchModelOperator
from verl_pipeline.airflow.operators.preprocess import PreprocessDataOperator
from verl_pipeline.airflow.operators.provision import ProvisionRayClusterOperator
from verl_pipeline.airflow.operators.report import ReportRunOperator
from verl_pipeline.airflow.operators.submit import SubmitVerlJobOperator
from verl_pipeline.airflow.operators.teardown import TeardownRayClusterOperator, cleanup_failed_run
from verl_pipeline.airflow.operators.wait import WaitForVerlJobOperator
from verl_pipeline.airflow.task_ids import (
    EVALUATE_TASK,
    EXPORT_TASK,
    PLAN_MODELS_TASK,
    PREFETCH_TASK,
    PREPROCESS_TASK,
    PROVISION_TASK,
    REPORT_TASK,
    SUBMIT_TASK,
    TEARDOWN_TASK,
    WAIT_TASK,
)

__all__ = [
    "EVALUATE_TASK",
    "EXPORT_TASK",
    "HF_CONN_ID",
    "PLAN_MODELS_TASK",
    "PREFETCH_TASK",
    "PREPROCESS_TASK",
    "PROVISION_TASK",
    "REPORT_TASK",
    "SUBMIT_TASK",
    "TEARDOWN_TASK",
    "WAIT_TASK",
    "EvaluateModelOperator",
    "ExportModelOperator",
    "PipelineOperator",
    "PlanModelsOperator",
    "PrefetchModelOperator",
    "PreprocessDataOperator",
    "ProvisionRayClusterOperator",
    "ReportRunOperator",
    "SubmitVerlJobOperator",
    "TeardownRayClusterOperator",
    "WaitForVerlJobOperator",
    "cleanup_failed_run",
    "run_name",
    "spec_from_context",
]
