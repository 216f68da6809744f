"""verl PPO post-training on a Ray cluster: provision → preprocess → prefetch → submit → wait → teardown."""

from __future__ import annotations

from airflow.sdk import DAG

from verl_pipeline.airflow.operators import cleanup_failed_run
from verl_pipeline.airflow.params import build_params, default_args, max_active_runs
from verl_pipeline.airflow.pipeline import wire_pipeline

DOC = """
### verl PPO on Ray

Provisions the Ray cluster of the chosen profile (embedded default: a local Ray head on loopback),
converts the data to verl's parquet, prefetches every model of the run (actor, critic, reward
model: one mapped task each, into the cache every node shares, pinned and verified), submits the
verl job through Ray's Jobs API and waits for it without holding a worker slot, then tears the cluster down — always.

On a cluster **without GPUs** the job runs **preflight** (verl's own config composition and
validation for the target shape, data and model checks, reward scoring of the ground truths)
instead of training. Profiles live in `configs/`; see docs/configuration.md in the repository.
"""

with DAG(
    dag_id="verl_ppo",
    description="verl PPO/GRPO post-training on a Ray cluster",
    doc_md=DOC,
    schedule=None,
    catchup=False,
    # Several experiments at once ($VERL_PIPELINE_MAX_ACTIVE_RUNS, default 4); each run has its own cluster.
    max_active_runs=max_active_runs(),
    tags=["verl", "ray", "rl"],
    params=build_params(),
    # A run marked failed by hand or cut by a DAG-run timeout skips its teardown task: clean up here.
    on_failure_callback=cleanup_failed_run,
    default_args=default_args(),
) as dag:
    wire_pipeline()
