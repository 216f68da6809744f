"""The pipeline DAG's task ids: tasks find each other's results by id (``xcom_pull``), the UI finds the report."""

from __future__ import annotations

PROVISION_TASK = "provision_ray_cluster"
PREPROCESS_TASK = "preprocess_data"
PLAN_MODELS_TASK = "plan_models"
PREFETCH_TASK = "prefetch_model"
SUBMIT_TASK = "submit_verl_job"
WAIT_TASK = "wait_for_verl_job"
TEARDOWN_TASK = "teardown_ray_cluster"
EXPORT_TASK = "export_model"
REPORT_TASK = "report_run"

#: The provision task's XCom naming the run directory (the frozen spec, the cluster record …).
RUN_DIR_KEY = "run_dir"
#: The wait task's XCom holding its latest restart decision (``jobs.budget.RestartBudget.record``): the
#: restart budget while the run goes on, shown by the "Run report" tab until the report exists.
RESTART_BUDGET_KEY = "restart_budget"
