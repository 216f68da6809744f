"""The verl keys the pipeline sets itself, and what becomes of a user's value for each.

A run's verl settings come in layers: the profiles' ``verl:`` sections, then the CLI's ``--set`` and
the ``verl_overrides`` param, then the scaling rules for what is left unset. Above them all, the
pipeline sets the keys of :data:`OWNED_KEYS` (:func:`verl_pipeline.trainer.render.job_settings`).
A user's value for one of them is either **honoured** (kept, or merged with what the pipeline
needs) or **refused** by :func:`check_owned_keys`, before any cluster starts, with the setting to
use instead. It is never replaced silently. The same table gives the rule the render step logs for
each key, so the check, the log and the docs cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.trackers import LOGGER_KEY, PIPELINE_BACKENDS
from verl_pipeline.trainer.overrides import flatten, hydra_value
from verl_pipeline.trainer.scaling import SAVE_BYTES_PER_PARAM

#: verl's ``trainer.project_name`` when the user sets none (a tracker's project / MLflow experiment).
DEFAULT_PROJECT = "verl_pipeline"
#: verl's keys for how many of the run's checkpoints its actor and critic keep (verl's default: all of them).
ACTOR_KEEP_KEY = "trainer.max_actor_ckpt_to_keep"
CRITIC_KEEP_KEY = "trainer.max_critic_ckpt_to_keep"
#: The checkpoints a run keeps when the user says nothing: the newest, and the one before it in case the
#: newest turns out unreadable. 0 keeps every one (verl's meaning of 0 and null).
DEFAULT_CHECKPOINTS_KEPT = 2


class Ownership(str, Enum):
    """What the pipeline does with a user's value for a key it sets."""

    #: Kept (or merged with what the pipeline needs), when it passes the key's condition.
    HONOURED = "honoured"
    #: A ConfigError naming the key and what to set instead.
    REFUSED = "refused"


@dataclass(frozen=True)
class Condition:
    """The values of an honoured key the pipeline honours; the others are refused."""

    test: Callable[[Any], bool]
    #: What the value must be, in words.
    must: str
    #: The error's fix.
    fix: str


@dataclass(frozen=True)
class OwnedKey:
    """One verl key the pipeline sets."""

    key: str
    ownership: Ownership
    #: Why the pipeline sets it: the rule the render step logs with the value.
    why: str
    #: Refused: what to set instead (the error's fix). Honoured: what becomes of the user's value.
    instead: str
    #: An honoured key's condition on the user's value (None: any value is honoured).
    condition: Condition | None = None
    #: Sized for the training pool: the logged rule says how the cluster was split (placement: separate).
    pool_sized: bool = False


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _name(value: Any) -> bool:
    return isinstance(value, str) and bool(value.strip())


_RESUMED_BY_THE_PIPELINE = "start a new run (another run name) for a fresh start; a retried job resumes by itself"

OWNED_KEYS: tuple[OwnedKey, ...] = (
    OwnedKey("trainer.nnodes", Ownership.REFUSED,
             "the training pool's nodes, the shape every batch rule and cluster check is sized for",
             "the nnodes param (CLI --nnodes); else the run profile's trainer.nnodes (with its own cluster "
             "profile), else the cluster profile's hardware.nnodes", pool_sized=True),
    OwnedKey("trainer.n_gpus_per_node", Ownership.REFUSED,
             "the training pool's GPUs per node, the shape every batch rule and cluster check is sized for",
             "the n_gpus_per_node param (CLI --n-gpus-per-node); else the run profile's trainer.n_gpus_per_node (with "
             "its own cluster profile), else the cluster profile's hardware.n_gpus_per_node",
             pool_sized=True),
    OwnedKey("trainer.total_training_steps", Ownership.REFUSED,
             "the run's length, which progress, the hang watchdog, the last save and merged segments count against",
             "the total_training_steps param (CLI --total-training-steps), else the run profile's "
             "trainer.total_training_steps; or trainer.total_epochs, which wins from a later layer"),
    OwnedKey("trainer.total_epochs", Ownership.HONOURED,
             "verl ends a run after its epochs even before its steps: the run's length is one rule of steps, epochs "
             "and the training rows (trainer/length.py)",
             "kept: from a later layer than the steps, the steps are epochs x the training rows' batches; else "
             "raised to cover the steps",
             condition=Condition(_positive_int, "a positive number of epochs",
                                 "trainer.total_epochs=3, or unset: the steps set the run's length")),
    OwnedKey("trainer.default_local_dir", Ownership.REFUSED,
             "the run's checkpoints, absolute, on storage every node shares, one directory per run (retries "
             "resume from them)",
             "the cluster profile's storage.checkpoints (a run writes to <storage.checkpoints>/<run key>)"),
    OwnedKey("trainer.resume_mode", Ownership.REFUSED,
             "the pipeline reads the run's checkpoints before each submit and picks auto, resume_path (to the "
             "newest complete one) or disable (none is complete)", _RESUMED_BY_THE_PIPELINE),
    OwnedKey("trainer.resume_from_path", Ownership.REFUSED,
             "the checkpoint a retried job resumes from, set with resume_mode=resume_path when the newest one "
             "is incomplete", _RESUMED_BY_THE_PIPELINE),
    OwnedKey("trainer.experiment_name", Ownership.REFUSED,
             "the run key: every attempt of a run logs into the one tracker run of this name",
             "name the run (the DAG run id, or the CLI's --run-name)"),
    OwnedKey("data.train_files", Ownership.REFUSED,
             "the run's preprocessed training parquet, written by the preprocess step",
             "the data_source param (CLI --data-source), else the run profile's data.source"),
    OwnedKey("data.val_files", Ownership.REFUSED,
             "the run's preprocessed validation parquet, written by the preprocess step",
             "the data_source param (CLI --data-source), else the run profile's data.source"),
    OwnedKey("actor_rollout_ref.model.path", Ownership.REFUSED,
             "the actor's weights, prefetched to the cluster's model storage and verified",
             "the model_source param (CLI --model-source), else the model profile's model.source"),
    OwnedKey("critic.model.path", Ownership.REFUSED,
             "the critic's weights, prefetched: the model profile's critic_source, else the actor's",
             "the model profile's model.critic_source"),
    OwnedKey("reward.reward_model.model_path", Ownership.REFUSED,
             "the reward model's weights, prefetched to the cluster's model storage",
             "the model profile's model.reward_source (its verl: reward.reward_model section sets the rest)"),
    OwnedKey("trainer.project_name", Ownership.HONOURED,
             "the trackers' project (MLflow: the experiment)",
             f"kept; unset, {DEFAULT_PROJECT!r}",
             condition=Condition(_name, "a non-empty name",
                                 f"trainer.project_name=my_project, or unset: {DEFAULT_PROJECT!r}")),
    OwnedKey("trainer.save_freq", Ownership.HONOURED,
             "retries resume from checkpoints, so a run always saves",
             "kept when positive; unset, the run saves once, at the end",
             condition=Condition(_positive_int, "a positive number of steps (0 and -1 never save)",
                                 "trainer.save_freq=10, or unset: the run then saves once, at the end")),
    *(OwnedKey(key, Ownership.HONOURED,
               f"the checkpoints kept: verl keeps all unless told (a save is ~{SAVE_BYTES_PER_PARAM} bytes a "
               f"parameter a model: fp32 weights and Adam's moments, ~{7.6 * SAVE_BYTES_PER_PARAM:.0f} GB for a 7B "
               "actor) and prunes only its own process's saves; the pipeline removes older ones before each retry",
               f"kept; 0 keeps every checkpoint; unset, {DEFAULT_CHECKPOINTS_KEPT}",
               condition=Condition(_count, "a number of checkpoints, 0 or more (0: keep every one)",
                                   f"{key}={DEFAULT_CHECKPOINTS_KEPT}, or 0 to keep every checkpoint"))
      for key in (ACTOR_KEEP_KEY, CRITIC_KEEP_KEY)),
    OwnedKey(LOGGER_KEY, Ownership.HONOURED,
             "the pipeline reads verl's file logger ($VERL_FILE_LOGGER_PATH: the run's metrics) and its console "
             "lines (progress, the hang watchdog)",
             f"kept, with {' and '.join(PIPELINE_BACKENDS)} added"),
)
#: The same table by key.
OWNED: dict[str, OwnedKey] = {k.key: k for k in OWNED_KEYS}


def check_owned_keys(layers: Iterable[Mapping[str, Any]]) -> None:
    """Refuse a user's value for an owned key the pipeline would not honour: a ConfigError naming the key.

    ``layers`` are what the user wrote: the profiles' ``verl:`` sections (nested) and the overrides
    (flat ``--set`` / ``verl_overrides`` keys).
    """
    for layer in layers:
        for written, value in flatten(layer).items():
            owned = OWNED.get(written.lstrip("+"))
            if owned is None:
                continue
            if owned.ownership is Ownership.REFUSED:
                raise ConfigError(owned.key, value, f"the pipeline sets it itself: {owned.why}", owned.instead)
            if written != owned.key:
                # The pipeline reads and merges the plain key only: a Hydra append would win over its value.
                raise ConfigError(written, value, f"the pipeline honours {owned.key} only under that name",
                                  f"{owned.key}={hydra_value(value)}")
            condition = owned.condition
            if condition is not None and value is not None and not condition.test(value):
                raise ConfigError(owned.key, value, f"must be {condition.must}: {owned.why}", condition.fix)


def rule_text(owned: OwnedKey, value: Any, note: str = "") -> str:
    """The rule logged with an owned key's value: why the pipeline sets it (``note`` adds to that), and
    what a user sets instead."""
    said = "yours" if owned.ownership is Ownership.HONOURED else "to change it"
    return f"{value!r} — {owned.why}{note} ({said}: {owned.instead})"


__all__ = [
    "ACTOR_KEEP_KEY",
    "CRITIC_KEEP_KEY",
    "DEFAULT_CHECKPOINTS_KEPT",
    "DEFAULT_PROJECT",
    "OWNED",
    "OWNED_KEYS",
    "Condition",
    "OwnedKey",
    "Ownership",
    "check_owned_keys",
    "rule_text",
]
