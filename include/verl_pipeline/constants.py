"""Enumerations shared by the package (``str`` enums so they serialise as plain strings)."""

from __future__ import annotations

from enum import Enum

#: The data recipe (``configs/recipes``) a run uses when its data options name none.
DEFAULT_RECIPE = "gsm8k"
#: The generated data sets (``builtin:<name>``): GSM8K-style word problems, and the example task's
#: one-digit echo (``data/generator.py``), both answered ``#### N``.
BUILTIN_DATA = ("arithmetic", "repeat-digit")


class Placement(str, Enum):
    """Where rollout (generation) runs relative to training."""

    #: verl's hybrid engine: actor and rollout share every GPU, taking turns (verl's default).
    COLOCATED = "colocated"
    #: Rollout on a GPU pool of its own (verl's ``separate_async`` trainer), training on the rest.
    SEPARATE = "separate"


class Mode(str, Enum):
    """What the submitted Ray job does."""

    #: ``train`` on a cluster with GPUs, ``preflight`` on one without.
    AUTO = "auto"
    #: ``python -m verl.trainer.main_ppo`` with the rendered overrides.
    TRAIN = "train"
    #: The project's preflight entrypoint: verl's config composition + validation, data and
    #: model checks, reward scoring of the ground truths; no training.
    PREFLIGHT = "preflight"


class SubmitAction(str, Enum):
    """What submitting a run's job did: the ``action`` of a submission and of the submit task's XCom
    (values as earlier releases wrote them, so their XCom still reads)."""

    #: A new attempt was submitted.
    SUBMITTED = "submitted"
    #: A live job of this run was found and is waited for instead.
    REATTACHED = "reattached"
    #: This run's latest job had already succeeded: nothing submitted.
    ALREADY_SUCCEEDED = "already_succeeded"
    #: A shared cluster: the wait task submits the job once it holds the run's pool slots.
    QUEUED_FOR_POOL = "queued_for_pool"


class WorldSizeChange(str, Enum):
    """The run profile's ``on_world_size_change``: what a retry does when its training pool's world size
    differs from the one that wrote the checkpoint to resume (verl loads shards only at that size)."""

    #: Refuse before submitting, naming both sizes and the choices (the default).
    FAIL = "fail"
    #: Merge the checkpoint's actor with verl's merger and continue from those weights as a new
    #: segment of the run; the optimizer state is lost.
    MERGE = "merge"


class SetBy(str, Enum):
    """Which layer set one of a run's length settings (``total_training_steps``, ``trainer.total_epochs``):
    when both are set, the one of the later layer wins (``trainer/length.py``)."""

    #: Nobody: the pipeline's default (one step).
    DEFAULT = "default"
    #: A profile: the run profile's ``trainer.total_training_steps``, a profile's ``verl:`` section.
    PROFILE = "profile"
    #: The run asked for it: a param / CLI flag, ``--set`` or ``verl_overrides``.
    ASKED = "asked"

    @property
    def rank(self) -> int:
        return (SetBy.DEFAULT, SetBy.PROFILE, SetBy.ASKED).index(self)


class BackendKind(str, Enum):
    """Where the Ray cluster comes from."""

    LOCAL = "local"
    ADDRESS = "address"
    #: An sbatch allocation holding a Ray head + workers until ``scancel``.
    SLURM = "slurm"
    #: A ``RayCluster`` (or ``RayJob``) custom resource of the KubeRay operator.
    KUBERAY = "kuberay"


class AuthMode(str, Enum):
    """Ray's ``RAY_AUTH_MODE`` (Ray >= 2.52): a cluster profile's ``auth_mode``."""

    TOKEN = "token"
    DISABLED = "disabled"


#: Ray's auth where a cluster profile says none: the clusters the pipeline starts (local, Slurm) run with
#: a fresh token, and an existing (``address``) cluster is expected to (``auth_mode: disabled`` says it
#: does not: then only on loopback, over https, or with ``allow_insecure``). KubeRay clusters run without.
DEFAULT_AUTH_MODE = AuthMode.TOKEN


class JobState(str, Enum):
    """Ray job states (mirrors ``ray.job_submission.JobStatus`` without importing Ray)."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    def is_terminal(self) -> bool:
        return self in (JobState.STOPPED, JobState.SUCCEEDED, JobState.FAILED)


#: What a training job runs unless the run profile names another entrypoint (``trainer_command``),
#: e.g. a verl recipe's own main module.
DEFAULT_TRAINER_COMMAND = ("python", "-m", "verl.trainer.main_ppo")

#: Line prefix the preflight entrypoint prints before its JSON summary, so the wait task can
#: find the summary in the job's logs.
PREFLIGHT_SUMMARY_MARKER = "VERL_PIPELINE_PREFLIGHT_SUMMARY "
