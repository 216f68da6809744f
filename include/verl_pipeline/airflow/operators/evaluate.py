"""Evaluate the trained model after the export, on the run's cluster, before the teardown releases it.

The trained model, the base model it started from and the profile's champion (``latest/<profile>``'s
exported model) are scored on the run's validation rows (or the held-out rows its profile names:
``evaluation.data``) with the run's reward function, by one Ray job
(:mod:`verl_pipeline.evaluation`): vLLM on GPUs; on a cluster without GPUs, transformers on a sample of
the rows, marked as a smoke evaluation. The record goes to the run's ``evaluation.json``, which the
promotion rule and the report read. A failed evaluation records why there (``scores.FAILED_KEY``), so the
publish task holds the run back with that reason, and fails the task.
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowSkipException

from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error
from verl_pipeline.airflow.task_ids import EXPORT_TASK, PREFETCH_TASK, PREPROCESS_TASK
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.rundir import RunDir


class EvaluateModelOperator(PipelineOperator):
    """Score the trained, base and champion models (``evaluation.json``); skipped when nothing was exported
    or the run profile says ``evaluation: {enabled: false}``."""

    ui_color = "#e8daef"

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline import steps
        from verl_pipeline.evaluation.run import evaluate_run
        from verl_pipeline.models.prefetch import models_by_role
        from verl_pipeline.scores import FAILED_KEY

        exported = self._pull(context, EXPORT_TASK)
        if not (isinstance(exported, dict) and exported.get("model_dir")):
            raise AirflowSkipException("no model to evaluate: the export made none")
        spec = spec_from_context(context)
        if not spec.evaluation.enabled:
            raise AirflowSkipException("the run profile says evaluation: {enabled: false}")
        handle = steps.current_handle(spec)
        if handle is None:
            raise task_error(PipelineError(f"run {spec.run_key} has no cluster to evaluate on (it was torn down)"))
        base = (models_by_role(self._pull(context, PREFETCH_TASK)).get("actor") or {}).get("path")
        # The held-out rows when the profile names them, else the run's validation split.
        val_path = spec.evaluation.data or (self._pull(context, PREPROCESS_TASK) or {}).get("val_path")
        try:
            outcome = evaluate_run(self.hook(handle).client, spec.run_dir, id_prefix=spec.run_key,
                                   sample=spec.evaluation.sample, max_new_tokens=spec.evaluation.max_new_tokens,
                                   base_model=base, val_path=val_path)
        except PipelineError as e:
            RunDir(spec.run_dir).save_evaluation({FAILED_KEY: str(e)})
            raise task_error(e) from e
        ev = outcome.evaluation
        for role, score in ev.models.items():
            self.log.info("Run %s: %s model %s mean reward %.4g, pass rate %.2f, %d rows%s", spec.run_key, role.value,
                          score.path, score.mean_reward, score.pass_rate, score.n, " (smoke)" if ev.smoke else "")
        for label, error in ev.errors.items():
            self.log.warning("Run %s: the %s model was not scored: %s", spec.run_key, label, error)
        return {"evaluation_file": str(outcome.path), "smoke": ev.smoke, "notes": list(outcome.notes),
                "scores": {r.value: s.mean_reward for r, s in ev.models.items()}, "errors": dict(ev.errors)}
