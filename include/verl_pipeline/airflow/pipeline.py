"""The pipeline's tasks, wired once for every DAG that runs it (``verl_ppo`` and the retraining DAGs).

provision → preprocess → plan models → prefetch (one mapped task per model) → submit → wait
[→ extra tasks, e.g. publish] → teardown. Teardown is the setup's Airflow teardown task and runs
whatever happened (``ALL_DONE``): a provision that failed after starting Ray processes still gets
them cleaned up.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any


def wire_pipeline(*, emit_asset: bool = True, after_wait: Sequence[Any] = ()) -> None:
    """Create the pipeline's tasks in the DAG being defined (call inside ``with DAG(...)``).

    ``emit_asset``: the preprocess task updates the run profile's preprocessed-data Asset (off for a
    DAG scheduled on that Asset: it must not trigger itself). ``after_wait``: tasks run between the
    wait and the teardown, in order.
    """
    from airflow.sdk import TriggerRule, chain

    from verl_pipeline.airflow.operators import (
        PLAN_MODELS_TASK,
        PREFETCH_TASK,
        PREPROCESS_TASK,
        PROVISION_TASK,
        SUBMIT_TASK,
        TEARDOWN_TASK,
        WAIT_TASK,
        PlanModelsOperator,
        PrefetchModelOperator,
        PreprocessDataOperator,
        ProvisionRayClusterOperator,
        SubmitVerlJobOperator,
        TeardownRayClusterOperator,
        WaitForVerlJobOperator,
    )

    provision = ProvisionRayClusterOperator(task_id=PROVISION_TASK)
    preprocess = PreprocessDataOperator(task_id=PREPROCESS_TASK, emit_asset=emit_asset)
    plan_models = PlanModelsOperator(task_id=PLAN_MODELS_TASK)
    # One mapped instance per distinct model of the run (actor, critic, reward model), in parallel.
    prefetch = PrefetchModelOperator.partial(
        task_id=PREFETCH_TASK, map_index_template="{{ model_label }}",
    ).expand(model=plan_models.output)
    submit = SubmitVerlJobOperator(task_id=SUBMIT_TASK)
    wait = WaitForVerlJobOperator(task_id=WAIT_TASK)
    # Teardown must not be retried into a long backoff: it runs once more at most, quickly.
    teardown = TeardownRayClusterOperator(task_id=TEARDOWN_TASK, retries=1, retry_delay=timedelta(seconds=5))

    chain(provision, preprocess, plan_models, prefetch, submit, wait, *after_wait, teardown)
    teardown.as_teardown(setups=provision)
    # A teardown normally runs only when its setup succeeded; a provision that failed (or was killed)
    # after starting Ray processes must still be cleaned up, so teardown runs whatever happened.
    teardown.trigger_rule = TriggerRule.ALL_DONE
