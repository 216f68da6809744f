"""The pipeline's tasks, wired once for every DAG that runs it (``verl_ppo`` and the retraining DAGs).

provision → preprocess → plan models → prefetch (one mapped task per model) → submit → wait
→ export → evaluate → teardown: the evaluation is a job on the run's cluster, so the teardown waits
for it; the export and the evaluation are skipped when the run trained nothing. After the evaluation,
beside the teardown, the tasks that need only the run's files (publish; then the run report).
Teardown is the setup's Airflow teardown task and runs whatever happened (``ALL_DONE``): a provision
that failed after starting Ray processes still gets them cleaned up.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any


def wire_pipeline(*, emit_asset: bool = True, after_wait: Sequence[Any] = (), export_publishes: bool = True) -> None:
    """Create the pipeline's tasks in the DAG being defined (call inside ``with DAG(...)``).

    ``emit_asset``: the preprocess task updates the run profile's preprocessed-data Asset (off for a
    DAG scheduled on that Asset: it must not trigger itself). ``after_wait``: tasks run between the
    wait, in order, beside the teardown (they read the run's files, not the cluster).
    ``export_publishes``: the export task publishes the trained-model Asset (off where a publish task in
    ``after_wait`` does, for promoted runs only).
    """
    from airflow.sdk import TriggerRule, chain

    from verl_pipeline.airflow import operators as op

    provision = op.ProvisionRayClusterOperator(task_id=op.PROVISION_TASK)
    preprocess = op.PreprocessDataOperator(task_id=op.PREPROCESS_TASK, emit_asset=emit_asset)
    plan_models = op.PlanModelsOperator(task_id=op.PLAN_MODELS_TASK)
    # One mapped instance per distinct model of the run (actor, critic, reward model), in parallel.
    prefetch = op.PrefetchModelOperator.partial(
        task_id=op.PREFETCH_TASK, map_index_template="{{ model_label }}",
    ).expand(model=plan_models.output)
    submit = op.SubmitVerlJobOperator(task_id=op.SUBMIT_TASK)
    wait = op.WaitForVerlJobOperator(task_id=op.WAIT_TASK)
    # Teardown must not be retried into a long backoff: it runs once more at most, quickly.
    teardown = op.TeardownRayClusterOperator(task_id=op.TEARDOWN_TASK, retries=1,
                                      retry_delay=timedelta(seconds=5))

    chain(provision, preprocess, plan_models, prefetch, submit, wait, teardown)
    # The trained model is exported and evaluated before the after_wait tasks, e.g. publish_run; the
    # evaluation runs on the cluster, so the teardown comes after it (whatever it did: ALL_DONE).
    export = op.ExportModelOperator(task_id=op.EXPORT_TASK, publishes=export_publishes)
    evaluate = op.EvaluateModelOperator(task_id=op.EVALUATE_TASK)
    chain(wait, export, evaluate, *after_wait)
    evaluate >> teardown
    # The run report, for failed runs too, with the evaluation and the promotion verdict when there are.
    # A teardown (of the run's setup) in Airflow's eyes only so that it never decides the DAG run's
    # state: a report written for a failed run is no success.
    report = op.ReportRunOperator(task_id=op.REPORT_TASK)
    (after_wait[-1] if after_wait else evaluate) >> report
    wait >> report
    report.as_teardown(setups=provision)
    report.trigger_rule = TriggerRule.ALL_DONE
    teardown.as_teardown(setups=provision)
    # A teardown normally runs only when its setup succeeded; a provision that failed (or was killed)
    # after starting Ray processes must still be cleaned up, so teardown runs whatever happened.
    teardown.trigger_rule = TriggerRule.ALL_DONE
