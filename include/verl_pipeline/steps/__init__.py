"""The pipeline's steps as plain functions: the Airflow operators and the CLI both call these.

One module per part of a run, in the DAG's order:

- :mod:`.spec`: verl's own validation of the run's shape; the frozen spec every later task starts from;
- :mod:`.data`: the preprocess step;
- :mod:`.cluster`: provision, health, status, mode and teardown of the run's Ray cluster;
- :mod:`.job`: the job prepared for the cluster as it is (rendered, staged, probed, decided, validated);
- :mod:`.submit`: one attempt's submission.
"""

from __future__ import annotations

from verl_pipeline.steps.cluster import (
    backend_spec,
    choose_mode,
    cluster_health,
    cluster_problems,
    cluster_status,
    current_handle,
    ensure_cluster,
    find_handle,
    provision,
    teardown,
)
from verl_pipeline.steps.data import preprocess, tokenizer_for_model
from verl_pipeline.steps.job import (
    PreparedJob,
    check_environment,
    check_paths_visible,
    decide_for_nodes,
    job_needs,
    prepare_job,
    probe_cluster,
    render,
    resume_point,
    save_run_files,
    stage_job_files,
    validate_decided,
)
from verl_pipeline.steps.spec import freeze, frozen_or, load_frozen, validate_spec_with_verl
from verl_pipeline.steps.submit import Submitted, submit_attempt, warn_checkpoint_room

__all__ = [
    "PreparedJob",
    "Submitted",
    "backend_spec",
    "check_environment",
    "check_paths_visible",
    "choose_mode",
    "cluster_health",
    "cluster_problems",
    "cluster_status",
    "current_handle",
    "decide_for_nodes",
    "ensure_cluster",
    "find_handle",
    "freeze",
    "frozen_or",
    "job_needs",
    "load_frozen",
    "prepare_job",
    "preprocess",
    "probe_cluster",
    "provision",
    "render",
    "resume_point",
    "save_run_files",
    "stage_job_files",
    "submit_attempt",
    "teardown",
    "tokenizer_for_model",
    "validate_decided",
    "validate_spec_with_verl",
    "warn_checkpoint_room",
]
