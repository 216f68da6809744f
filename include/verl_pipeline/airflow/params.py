"""The DAG's Params (the UI trigger form), JSON-schema validated by Airflow before a run starts."""

from __future__ import annotations

from typing import Any

from airflow.sdk import Param

from verl_pipeline.profiles import DEFAULT_PROFILE, list_profiles
from verl_pipeline.trainer.nodes.attention import SDPA_OVERRIDE

MAX_ACTIVE_RUNS_ENV = "VERL_PIPELINE_MAX_ACTIVE_RUNS"
DEFAULT_MAX_ACTIVE_RUNS = 4


def max_active_runs() -> int:
    """How many ``verl_ppo`` runs may be active at once (``$VERL_PIPELINE_MAX_ACTIVE_RUNS``, default 4).

    Each run has its own cluster, ports, run directory and job ids on the embedded default."""
    import os

    from verl_pipeline.exceptions import ConfigError

    text = os.environ.get(MAX_ACTIVE_RUNS_ENV, "").strip()
    if not text:
        return DEFAULT_MAX_ACTIVE_RUNS
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(MAX_ACTIVE_RUNS_ENV, text, "must be a whole number >= 1", f"{MAX_ACTIVE_RUNS_ENV}=4")
    return int(text)


def default_args() -> dict[str, Any]:
    """Task defaults of the pipeline's DAGs: retries with exponential backoff, for a task's own try
    failing (its worker lost, a cluster that cannot be provisioned just now). The run's restarts
    after infrastructure failures of its job are not these: the wait task restarts the job within
    its try while the run's restart budget lasts (the run profile's ``restarts:``,
    :mod:`verl_pipeline.jobs.restart_budget`); the user's errors fail at once whatever this says."""
    from datetime import timedelta

    return {
        "owner": "ml-platform",
        "retries": 2,
        "retry_delay": timedelta(seconds=20),
        "retry_exponential_backoff": True,
        "max_retry_delay": timedelta(minutes=10),
    }


def optional_choice(choices: list[str], *, default_label: str, description: str) -> Param:
    """A drop-down whose empty choice means "the profile's value".

    Airflow's form (3.3) labels each enum value through ``values_display`` and, for a value missing
    there, falls back to the label of ``None``; so every choice is labelled, ``None`` with what it means,
    and the form shows no literal "null". ``"null"`` in ``type`` makes the field optional (no asterisk)."""
    labels: dict[str | None, str] = {None: default_label, **{c: c for c in choices}}
    return Param(None, type=["null", "string"], enum=[None, *choices], values_display=labels,
                 description=description)


def build_params() -> dict[str, Any]:
    """Params of ``verl_ppo``. An empty field (``None``) means "the profile's value"."""
    profiles = list_profiles() or [DEFAULT_PROFILE]
    return {
        "profile": Param(DEFAULT_PROFILE, type="string", enum=profiles,
                         description=f"Run profile from configs/profiles (model profile + cluster profile), "
                                     f"e.g. {DEFAULT_PROFILE}."),
        "model_profile": optional_choice(
            list_profiles("models"), default_label="(the run profile's)",
            description="Model profile from configs/models, e.g. qwen2.5-0.5b-ppo. Empty: the run profile's."),
        "cluster_profile": optional_choice(
            list_profiles("clusters"), default_label="(the run profile's)",
            description="Cluster profile from configs/clusters, e.g. h100-ib; its shape (nodes x GPUs) "
                        "replaces the run profile's. Empty: the run profile's."),
        "placement": optional_choice(
            ["colocated", "separate"], default_label="(the profile's, else colocated)",
            description="colocated: actor and rollout share every GPU (verl's hybrid engine); "
                        "separate: rollout gets its own GPU pool (verl's separate_async trainer), "
                        "half the nodes by default. Empty: the profile's (colocated)."),
        # "null" in type: optional in the form (no asterisk); a cleared text area sends null, read as none.
        "verl_overrides": Param([], type=["null", "array"],
                                # A blank line (a trailing newline in the form) is allowed, and skipped.
                                items={"type": "string", "pattern": r"^(\s*|\+{0,2}[A-Za-z_][\w.]*=.*)$"},
                                description="verl settings, one KEY=VALUE per line, winning over every profile, "
                                            "e.g. actor_rollout_ref.actor.optim.lr=1e-6 or "
                                            f"{SDPA_OVERRIDE} "
                                            "(+ appends a key verl's YAML does not list). Empty: none."),
        "data_source": Param(None, type=["null", "string"],
                             description="builtin:arithmetic; an absolute file/glob/directory (JSONL, JSON, CSV, "
                                         "Parquet; train.* + test.*); an fsspec URL (s3://, gs://...); "
                                         "hf://name?config=...&revision=.... Empty: the profile's."),
        "recipe": optional_choice(
            list_profiles("recipes"), default_label="(the profile's, else gsm8k)",
            description="Preprocessing recipe from configs/recipes, e.g. gsm8k, math, generic, or verl for "
                        "Parquet already in verl's schema. Empty: the profile's (gsm8k)."),
        "model_source": Param(None, type=["null", "string"],
                              description="builtin:tiny-qwen2, hf://org/name@revision or an absolute model "
                                          "directory. Empty: the model profile's."),
        "nnodes": Param(None, type=["null", "integer"], minimum=1, maximum=1024,
                        description="Nodes of the target cluster (global batch grows with it), e.g. 4. "
                                    "Empty: profile."),
        "n_gpus_per_node": Param(None, type=["null", "integer"], minimum=1, maximum=16,
                                 description="GPUs per node of the target cluster, e.g. 8. Empty: profile."),
        "total_training_steps": Param(None, type=["null", "integer"], minimum=1,
                                      description="verl trainer.total_training_steps, e.g. 200. Empty: profile."),
        "mode": optional_choice(
            ["auto", "train", "preflight"], default_label="(the profile's)",
            description="auto: train when the cluster has GPUs, preflight (checks only, no training) when it "
                        "has none. Empty: the profile's (auto in the shipped ones)."),
    }
