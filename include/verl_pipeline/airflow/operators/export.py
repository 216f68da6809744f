"""Export the trained model after a successful training run, and publish it as the profile's model Asset.

Runs after the wait, beside the teardown, on the run's files only: verl's merger over the newest
complete checkpoint (:mod:`verl_pipeline.models.export`), the project's model verification, the
manifest ``<run_dir>/model.json``, then an event on ``verl-pipeline://models/<profile>`` through the
:func:`~verl_pipeline.airflow.assets.trained_model_alias` outlet. The task is skipped, saying why,
when the run trained nothing (preflight), when its profile says ``export: false``, or when its
checkpoints are not FSDP's (Megatron).
"""

from __future__ import annotations

from typing import Any

from airflow.sdk.exceptions import AirflowSkipException

from verl_pipeline.airflow.operators.base import PipelineOperator, spec_from_context, task_error
from verl_pipeline.airflow.task_ids import PREFETCH_TASK, PREPROCESS_TASK, SUBMIT_TASK
from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import PipelineError
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec


def skip_reason(submitted: dict[str, Any] | None, *, export: bool = True, strategy: str = "fsdp") -> str | None:
    """Why there is no model to export (None: there is one). The submit task's XCom says what ran;
    ``export`` is the run profile's switch; ``strategy`` the actor's ``actor_rollout_ref.actor.strategy``."""
    from verl_pipeline.jobs.checkpoints import FSDP_STRATEGIES

    if not submitted:
        return "no job was submitted"
    mode = submitted.get("mode")
    if mode != Mode.TRAIN.value:
        return f"the job ran in {mode} mode and trained no step: there is no checkpoint to export"
    if not export:
        return "the run profile says export: false"
    if strategy not in FSDP_STRATEGIES:
        return f"actor strategy {strategy!r}: only FSDP checkpoints are exported (verl's merger --backend fsdp)"
    return None


def run_skip_reason(spec: RunSpec, submitted: dict[str, Any] | None) -> str | None:
    """:func:`skip_reason` for a run: its profile's ``export`` and its rendered job's actor strategy."""
    if skip_reason(submitted) is not None:
        return skip_reason(submitted)
    settings = (RunDir(spec.run_dir).job() or {}).get("settings", {})
    return skip_reason(submitted, export=spec.export_model,
                       strategy=str(settings.get("actor_rollout_ref.actor.strategy", "fsdp")))


class ExportModelOperator(PipelineOperator):
    """Merge the run's newest complete checkpoint into HuggingFace safetensors, verify it, publish it.

    Returns the export manifest (``model_dir``, ``step``, ``final_reward``…) for XCom; the Asset event's
    ``extra`` carries the same facts a serving DAG needs.
    """

    ui_color = "#fdebd0"

    def __init__(self, *, publishes: bool = True, **kwargs: Any) -> None:
        from verl_pipeline.airflow.assets import trained_model_alias

        #: Whether this task publishes the model (``verl_ppo``, ``promoted: false``); a retraining DAG's
        #: publish task does instead, only for a promoted run.
        self.publishes = publishes
        if publishes:
            kwargs.setdefault("outlets", [trained_model_alias()])
        super().__init__(**kwargs)

    def execute(self, context: Any) -> dict[str, Any]:
        from verl_pipeline.jobs.checkpoints import current_segment, list_checkpoints, save_contents
        from verl_pipeline.models.export import export_run
        from verl_pipeline.models.prefetch import models_by_role
        from verl_pipeline.trainer.scaling import uses_critic

        submitted = self._pull(context, SUBMIT_TASK)
        reason = skip_reason(submitted)
        if reason:
            raise AirflowSkipException(f"no model exported: {reason}")
        try:
            spec = spec_from_context(context)
            # The job that trained the model: the run's last attempt (a retry's, or the wait task's).
            attempts = RunDir(spec.run_dir).attempts()
            job_id = attempts[-1].submission_id if attempts else submitted.get("submission_id") or "?"
            reason = run_skip_reason(spec, submitted)
            if reason:
                raise AirflowSkipException(f"no model exported: {reason}")
            settings = (RunDir(spec.run_dir).job() or {}).get("settings", {})
            # After a merge on a changed world size the newest checkpoints are the newest segment's.
            ckpt, start, _ = current_segment(spec.checkpoint_dir)
            checkpoints = list_checkpoints(ckpt, contents=save_contents(settings), critic=uses_critic(settings))
            manifest = export_run(
                run_dir=spec.run_dir, checkpoints=checkpoints, run_key=spec.run_key, run_name=spec.run_name,
                profile=spec.profile, job_id=job_id, data=self._pull(context, PREPROCESS_TASK),
                actor_model=models_by_role(self._pull(context, PREFETCH_TASK)).get("actor"), start_step=start)
        except (OSError, ValueError) as e:
            raise task_error(PipelineError(f"the model of job {job_id} could not be exported: {e}")) from e
        except PipelineError as e:
            raise task_error(e) from e
        events = context.get("outlet_events") if self.publishes else None
        if events is not None:
            from verl_pipeline.airflow.assets import model_event_extra, trained_model_alias, trained_model_asset

            events[trained_model_alias()].add(trained_model_asset(spec.profile),
                                              extra={**model_event_extra(manifest.to_dict()), "promoted": False})
        self.log.info("Job %s: model of step %d exported to %s and published as %s", job_id, manifest.step,
                      manifest.model_dir, f"verl-pipeline://models/{spec.profile}")
        return manifest.to_dict()
