"""Render the Ray job for a run: entrypoint (verl overrides) and runtime_env."""

from __future__ import annotations

import json
import logging
import shlex
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from verl_pipeline.constants import Mode, WorldSizeChange
from verl_pipeline.paths import package_dir
from verl_pipeline.rundir import RunDir
from verl_pipeline.spec import RunSpec
from verl_pipeline.trackers import LOGGER_KEY, logger_backends
from verl_pipeline.trainer.jobfiles import JobFiles, plan
from verl_pipeline.trainer.length import EPOCHS_KEY, STEPS_KEY, length_of
from verl_pipeline.trainer.nodes.decisions import Decision, decide_for_spec
from verl_pipeline.trainer.overrides import entrypoint, render_overrides
from verl_pipeline.trainer.owned import (
    ACTOR_KEEP_KEY,
    CRITIC_KEEP_KEY,
    DEFAULT_CHECKPOINTS_KEPT,
    DEFAULT_PROJECT,
    OWNED_KEYS,
    rule_text,
)
from verl_pipeline.trainer.reward import ANSWER_FORM
from verl_pipeline.trainer.scaling import nccl_env, uses_critic

log = logging.getLogger(__name__)

#: verl's recommended environment for every worker (see verl's runtime_env.yaml), plus tokenizers
#: parallelism off: forked dataloader workers deadlock with it on; and vLLM's INFO lines, which verl
#: silences (``VLLM_LOGGING_LEVEL=WARN`` unless the job sets it): the waiter times the engine's start
#: and its CUDA graph capture by them (``jobs/startup/markers.py``). vLLM prints a few INFO lines per
#: step (sleep and wake); Ray folds the same line from many workers into one.
BASE_ENV = {
    "TOKENIZERS_PARALLELISM": "false",
    "TORCH_NCCL_AVOID_RECORD_STREAMS": "1",
    "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    "VLLM_LOGGING_LEVEL": "INFO",
}

PREFLIGHT_COMMAND = ("python", "-m", "verl_pipeline.trainer.preflight")


@dataclass(frozen=True)
class RenderedJob:
    mode: Mode
    entrypoint: str
    overrides: list[str]
    runtime_env: dict[str, Any]
    settings: dict[str, Any]
    derived: dict[str, str]
    #: What a retry on another world size does (the run profile's ``on_world_size_change``).
    on_world_size_change: WorldSizeChange = WorldSizeChange.FAIL
    #: What was decided for the nodes the job runs on (``trainer.decisions.Decision.to_dict``).
    decision: dict[str, Any] = field(default_factory=dict)
    #: The run's own files shipped in the job's working_dir and checked on the nodes (``trainer/jobfiles.py``).
    files: JobFiles = field(default_factory=JobFiles)

    def undecided_settings(self) -> dict[str, Any]:
        """The job's settings without the keys its decision set: the run's own and the pipeline's, what a
        decision for the probed nodes starts from (``steps.decide_for_nodes`` takes them from the job rendered
        before the probe, whose decision only adds keys the run leaves unset)."""
        decided = set((self.decision or {}).get("settings") or {})
        return {k: v for k, v in self.settings.items() if k not in decided}

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["mode"] = self.mode.value
        d["on_world_size_change"] = self.on_world_size_change.value
        return d


def job_settings(
    spec: RunSpec, *, train_files: str, val_files: str, model_path: str, critic_path: str | None = None,
    reward_path: str | None = None, train_rows: int | None = None,
) -> dict[str, Any]:
    """Every verl setting of the run: the user's, then the keys the pipeline owns (paths, shape, logging).

    Every key set here is in :data:`~verl_pipeline.trainer.owned.OWNED_KEYS`; ``build_run_spec`` has
    refused a user's value for each of them that is not honoured here. ``train_rows``: the training rows
    preprocessing wrote (its counts), which the run's steps or epochs are counted against (``trainer/length.py``).
    """
    settings = dict(spec.verl)
    length = length_of(spec, settings, train_rows)
    project, experiment = tracker_names(spec)
    backends = logger_backends(settings.get(LOGGER_KEY))
    settings.update(
        {
            "data.train_files": train_files,
            "data.val_files": val_files,
            "actor_rollout_ref.model.path": model_path,
            # The training pool: the whole cluster, or what rollout's own pool leaves (placement: separate).
            "trainer.nnodes": spec.train_nnodes,
            "trainer.n_gpus_per_node": spec.train_gpus_per_node,
            STEPS_KEY: length.steps,
            EPOCHS_KEY: length.epochs,
            "trainer.project_name": project,
            "trainer.experiment_name": experiment,
            # Absolute and on shared storage so resume_mode=auto finds the latest checkpoint.
            "trainer.default_local_dir": str(spec.checkpoint_dir),
            "trainer.resume_mode": "auto",
            # The user's trackers, plus what the pipeline reads (trackers.PIPELINE_BACKENDS).
            LOGGER_KEY: backends,
        }
    )
    if settings.get("trainer.save_freq") is None:
        # Retries resume from checkpoints, so a run must write some: at least one at the end.
        settings["trainer.save_freq"] = max(1, length.steps)
    for key in (ACTOR_KEEP_KEY, *([CRITIC_KEEP_KEY] if uses_critic(settings) else [])):
        # verl keeps every checkpoint unless told: a week-long run would fill its storage.
        if settings.get(key) is None:
            settings[key] = DEFAULT_CHECKPOINTS_KEPT
    if uses_critic(settings):
        settings["critic.model.path"] = critic_path or model_path
    if reward_path:
        # The prefetched reward model; the model profile configures the rest of
        # verl's reward.reward_model section (enable, rollout engine).
        settings["reward.reward_model.model_path"] = reward_path
    return settings


def tracker_names(spec: RunSpec) -> tuple[str, str]:
    """verl's ``trainer.project_name`` and ``trainer.experiment_name`` of the run: the project and the
    run name every tracker shows (for MLflow: the experiment and the run's name)."""
    return str(spec.verl.get("trainer.project_name") or DEFAULT_PROJECT), spec.run_key


def _pool_note(spec: RunSpec) -> str:
    if spec.pools is None:
        return ""
    return f"; the training pool of a {spec.nnodes} x {spec.n_gpus_per_node} cluster: {spec.pools.reason}"


def pipeline_rules(spec: RunSpec, settings: dict[str, Any], notes: dict[str, str] | None = None) -> dict[str, str]:
    """The rule behind every key the pipeline owns that ``settings`` has (added to the scaling rules in ``render``);
    ``notes`` adds to a key's rule (the run's length: why its steps and epochs are what they are)."""
    notes = notes or {}
    return {owned.key: rule_text(owned, settings[owned.key],
                                 (_pool_note(spec) if owned.pool_sized else "") + notes.get(owned.key, ""))
            for owned in OWNED_KEYS if owned.key in settings}


def render_job(
    spec: RunSpec,
    *,
    mode: Mode,
    train_files: str,
    val_files: str,
    model_path: str,
    critic_path: str | None = None,
    reward_path: str | None = None,
    length_filter: dict[str, Any] | None = None,
    decision: Decision | None = None,
    train_rows: int | None = None,
) -> RenderedJob:
    """The exact entrypoint and runtime_env that will be submitted for ``spec`` in ``mode``.

    ``length_filter`` is what preprocessing recorded of its prompt-length filter (``stats.json``):
    when it matches the run, verl's own filter is turned off (:mod:`verl_pipeline.trainer.prefilter`).
    ``decision`` is what was decided for the nodes the job goes to (:mod:`verl_pipeline.trainer.nodes.decisions`);
    without one, what can be decided without a probe (nodes not probed) is. ``train_rows``: the training rows
    preprocessing wrote, which the run's length is counted against (:mod:`verl_pipeline.trainer.length`).
    """
    if mode is Mode.AUTO:
        raise ValueError("resolve Mode.AUTO against the cluster before rendering")
    settings = job_settings(spec, train_files=train_files, val_files=val_files, model_path=model_path,
                            critic_path=critic_path, reward_path=reward_path, train_rows=train_rows)
    length = length_of(spec, spec.verl, train_rows)  # what job_settings rendered, with its reason
    if length.disagrees:
        log.warning("Run %s: %s", spec.run_name, length.rule)
    if decision is None:
        decision = decide_for_spec(spec, settings)
    settings.update(decision.settings)
    filter_rule = None
    if length_filter:
        from verl_pipeline.trainer.prefilter import FILTER_KEY, filter_already_done, model_tokenizer_digest

        filter_rule = filter_already_done(length_filter, settings, model_tokenizer_digest(model_path))
        if filter_rule:
            settings[FILTER_KEY] = False
    files = plan(settings, spec.job_files, shared_roots=spec.shared_roots, local=spec.cluster.get("backend") == "local")
    settings.update(files.settings())  # each shipped file by its name in the working_dir
    overrides = render_overrides(settings)
    length_notes = {key: f"; {length.rule}" for key in (STEPS_KEY, EPOCHS_KEY)}
    if mode is Mode.TRAIN:
        command: tuple[str, ...] = spec.trainer_command
    else:
        run_dir = RunDir(spec.run_dir)
        forms = spec.data_options.get("check_solution") or ANSWER_FORM
        command = (*PREFLIGHT_COMMAND, "--summary-path", str(run_dir.preflight_file),
                   "--validation-record", str(run_dir.validation_file),
                   "--answer-form", json.dumps(forms, sort_keys=True), "--")
    env = dict(BASE_ENV)
    if spec.hardware is not None:
        env.update(nccl_env(spec.hardware, debug=spec.nccl_debug))
    elif spec.nccl_debug:
        env["NCCL_DEBUG"] = "INFO"
    env.update(decision.env)  # the warm caches; the cluster profile's runtime.env below still wins
    env.update({str(k): str(v) for k, v in (spec.runtime.get("env") or {}).items()})
    runtime_env: dict[str, Any] = {"env_vars": env}
    if spec.runtime.get("ship_package", True):
        runtime_env["py_modules"] = [str(package_dir())]
    if files.shipped:
        runtime_env["working_dir"] = str(RunDir(spec.run_dir).job_files_dir)
    return RenderedJob(
        mode=mode,
        entrypoint=entrypoint(command, overrides),
        overrides=overrides,
        runtime_env=runtime_env,
        settings=settings,
        derived={**spec.derived, **pipeline_rules(spec, settings, length_notes),
                 **({"data.filter_overlong_prompts": filter_rule} if filter_rule else {}), **decision.derived()},
        on_world_size_change=spec.on_world_size_change,
        decision=decision.to_dict(),
        files=files,
    )


def with_settings(job: RenderedJob, updates: dict[str, Any], rules: dict[str, str] | None = None) -> RenderedJob:
    """``job`` with some verl settings changed: the overrides and the entrypoint rendered again."""
    settings = {**job.settings, **updates}
    overrides = render_overrides(settings)
    words = shlex.split(job.entrypoint)
    command = words[: len(words) - len(job.overrides)]
    return replace(job, entrypoint=entrypoint(command, overrides), overrides=overrides, settings=settings,
                   derived={**job.derived, **(rules or {})})


def split_entrypoint_overrides(argv: list[str]) -> tuple[list[str], list[str]]:
    """Split ``[opts…, "--", overrides…]`` as the preflight entrypoint receives it."""
    if "--" in argv:
        i = argv.index("--")
        return argv[:i], argv[i + 1:]
    return [], argv


__all__ = ["BASE_ENV", "DEFAULT_PROJECT", "RenderedJob", "job_settings", "render_job", "split_entrypoint_overrides",
           "tracker_names", "with_settings"]
