"""Write the run report (:mod:`verl_pipeline.report`) after the wait, whatever the wait did.

The task runs beside the teardown, on the run's files only (no cluster), and its XCom says where
the report is: ``{"report_dir": …, "html": …, …}`` (the UI plugin finds it there).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowException, AirflowSkipException

from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context
from verl_pipeline.airflow.operators.wait_result import succeeded
from verl_pipeline.airflow.task_ids import WAIT_TASK
from verl_pipeline.exceptions import PipelineError


class ReportRunOperator(PipelineOperator):
    """Write ``<run_dir>/report/`` (report.json, plots, report.html) for a finished or failed run.

    The run succeeded when the wait task returned ``SUCCEEDED``; anything else (a failed wait, a run
    that ended before its wait) is reported as failed, with the steps and attempts it got to. A run
    whose params are invalid has no run directory: the task is skipped.
    """

    ui_color = "#e8f0fe"

    def __init__(self, *, wait_task_id: str = WAIT_TASK, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.wait_task_id = wait_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.report.build import RunOutcome
        from verl_pipeline.report.write import write_report

        try:
            spec = spec_from_context(context)
        except PipelineError as e:
            raise AirflowSkipException(f"no run report: the run has no frozen spec (its provision failed), "
                                       f"nothing ran ({e})") from e
        waited = self._pull(context, self.wait_task_id)
        ok = succeeded(waited)
        try:
            files = write_report(spec.run_dir, status=RunOutcome.SUCCEEDED if ok else RunOutcome.FAILED,
                                 spec=spec.to_dict())
        except (OSError, ValueError, PipelineError) as e:
            raise AirflowException(f"the run report of {spec.run_key} could not be written: {e}") from e
        result = files.to_dict()
        self.log.info("Run report of %s (job %s): %s", spec.run_key, (waited or {}).get("job_id"), result["html"])
        return result
