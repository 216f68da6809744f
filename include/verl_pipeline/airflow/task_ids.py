"""The pipeline DAG's task ids: tasks find each other's results by id (``xcom_pull``), the UI's pages by
:func:`stored_xcom`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

PROVISION_TASK = "provision_ray_cluster"
PREPROCESS_TASK = "preprocess_data"
PLAN_MODELS_TASK = "plan_models"
PREFETCH_TASK = "prefetch_model"
SUBMIT_TASK = "submit_verl_job"
WAIT_TASK = "wait_for_verl_job"
TEARDOWN_TASK = "teardown_ray_cluster"
EXPORT_TASK = "export_model"
EVALUATE_TASK = "evaluate_model"
REPORT_TASK = "report_run"

#: The provision task's XCom naming the run directory (the frozen spec, the cluster record …).
RUN_DIR_KEY = "run_dir"
#: The wait task's XCom holding its latest restart decision (``jobs.restart_budget.RestartBudget.record``): the
#: restart budget while the run goes on, shown by the "Run report" tab until the report exists.
RESTART_BUDGET_KEY = "restart_budget"


def stored_xcom(session: Session, *, dag_id: str, run_id: str, task_id: str, key: str = "return_value") -> Any | None:
    """A task's XCom in a DAG run as the metadata database holds it: the row (its ``value`` is plain JSON, or
    JSON text), None when the task has not pushed it. The API server's pages read XComs only so: Airflow's
    XComDecoder could build arbitrary classes from a stored value."""
    from airflow.models.xcom import XComModel

    return session.execute(
        XComModel.get_many(key=key, run_id=run_id, dag_ids=dag_id, task_ids=task_id,
                           map_indexes=-1).with_only_columns(XComModel.value)
    ).first()
