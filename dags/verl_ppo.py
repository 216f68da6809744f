"""verl PPO post-training on a Ray cluster: provision → preprocess → prefetch → submit → wait → teardown."""

from __future__ import annotations

from datetime import timedelta

from airflow.sdk import DAG, TriggerRule, chain

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
    cleanup_failed_run,
)
from verl_pipeline.airflow.params import build_params, default_args

DOC = """
### verl PPO on Ray

Provisions the Ray cluster of the chosen profile (embedded default: a local Ray head on loopback),
converts the data to verl's parquet, prefetches every model of the run (actor, critic, reward
model: one mapped task each, into the cache every node shares, pinned and verified), submits the
verl job through Ray's Jobs API and waits for it without holding a worker slot, then tears the cluster down — always.

On a cluster **without GPUs** the job runs **preflight** (verl's own config composition and
validation for the target shape, data and model checks, reward scoring of the ground truths)
instead of training. Profiles live in `configs/`; see the README.
"""

with DAG(
    dag_id="verl_ppo",
    description="verl PPO/GRPO post-training on a Ray cluster",
    doc_md=DOC,
    schedule=None,
    catchup=False,
    max_active_runs=1,
    tags=["verl", "ray", "rl"],
    params=build_params(),
    # A run marked failed by hand or cut by a DAG-run timeout skips its teardown task: clean up here.
    on_failure_callback=cleanup_failed_run,
    default_args=default_args(),
) as dag:
    provision = ProvisionRayClusterOperator(task_id=PROVISION_TASK)
    preprocess = PreprocessDataOperator(task_id=PREPROCESS_TASK)
    plan_models = PlanModelsOperator(task_id=PLAN_MODELS_TASK)
    # One mapped instance per distinct model of the run (actor, critic, reward model), in parallel.
    prefetch = PrefetchModelOperator.partial(
        task_id=PREFETCH_TASK, map_index_template="{{ model_label }}",
    ).expand(model=plan_models.output)
    submit = SubmitVerlJobOperator(task_id=SUBMIT_TASK)
    wait = WaitForVerlJobOperator(task_id=WAIT_TASK)
    # Teardown must not be retried into a long backoff: it runs once more at most, quickly.
    teardown = TeardownRayClusterOperator(task_id=TEARDOWN_TASK, retries=1, retry_delay=timedelta(seconds=5))

    chain(provision, preprocess, plan_models, prefetch, submit, wait, teardown)
    teardown.as_teardown(setups=provision)
    # A teardown normally runs only when its setup succeeded; a provision that failed (or was killed)
    # after starting Ray processes must still be cleaned up, so teardown runs whatever happened.
    teardown.trigger_rule = TriggerRule.ALL_DONE
