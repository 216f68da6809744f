"""Building a run's spec from YAML profiles (``configs/``) and the DAG run's params, validated — once.

A run = model profile (``configs/models``) + cluster profile (``configs/clusters``) + the run
profile (``configs/profiles``, which names the two) + the params of the DAG run; later layers
override earlier ones. The scaling rules (``trainer/scaling.py``) then derive what depends on the
shape, and every rule verl would only enforce on GPUs is checked here (``trainer/shape.py``), before
any cluster starts; errors name the key, the value, the rule and a value that would pass. The
provision task freezes the result (:class:`~verl_pipeline.spec.RunSpec`); nothing builds it again
for that run.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, TypeVar

import yaml

from verl_pipeline.admission import admission_of
from verl_pipeline.auth import check_job_env
from verl_pipeline.constants import DEFAULT_RECIPE, DEFAULT_TRAINER_COMMAND, Mode, Placement, SetBy, WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir, pipeline_home
from verl_pipeline.promotion import SECTION as PROMOTION_SECTION
from verl_pipeline.promotion import PromotionRule
from verl_pipeline.restarts import SECTION as RESTARTS_SECTION
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.scores import SECTION as EVALUATION_SECTION
from verl_pipeline.scores import EvaluationSettings
from verl_pipeline.spec import SECTION as WATCH_SECTION
from verl_pipeline.spec import (
    DataSource,
    Hardware,
    ModelFacts,
    ModelSource,
    PoolSplit,
    RunSpec,
    WatchSettings,
    require_shared,
)
from verl_pipeline.trackers import LOGGER_KEY, TrackerSettings, logger_backends
from verl_pipeline.trackers import SECTION as TRACKERS_SECTION
from verl_pipeline.trainer import scaling
from verl_pipeline.trainer.jobfiles import EXTRA_KEY as EXTRA_FILES_KEY
from verl_pipeline.trainer.modelfacts import facts_for, read_config
from verl_pipeline.trainer.overrides import flatten, parse_overrides, spellings
from verl_pipeline.trainer.owned import check_owned_keys
from verl_pipeline.trainer.shape import check_shape

#: Params a DAG run (or the CLI) may set; None means "take the profile's value".
PARAM_KEYS = ("profile", "model_profile", "cluster_profile", "data_source", "recipe", "model_source", "nnodes",
              "n_gpus_per_node", "total_training_steps", "mode", "placement", "verl_overrides")
#: The retraining DAG's param that promotes a run whatever its evaluation says: it decides what the
#: publish task does, not what the run is, so the spec does not read it.
PROMOTE_ANYWAY_PARAM = "promote_anyway"
DEFAULT_PROFILE = "smoke"
E = TypeVar("E", bound=Enum)


def list_profiles(kind: str = "profiles") -> list[str]:
    """Names of the YAML profiles of one kind (``profiles``, ``models`` or ``clusters``)."""
    folder = configs_dir() / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


# The param (and CLI flag) that names a profile of each kind.
_PROFILE_FIELD = {"profiles": "profile", "models": "model_profile", "clusters": "cluster_profile"}


def load_yaml_profile(kind: str, name: str) -> dict[str, Any]:
    param = _PROFILE_FIELD.get(kind, kind.rstrip("s"))
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError(param, name, "is not a profile name", f"use one of {list_profiles(kind)}")
    path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(param, name, f"no such profile in {path.parent}", f"use one of {list_profiles(kind)}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), type(data).__name__, "a profile must be a YAML mapping")
    return data


def _deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _int_param(params: dict[str, Any], key: str, default: Any, lo: int, hi: int) -> int:
    value = params.get(key)
    if value is None or value == "":
        value = default
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            value = int(str(value))
        except ValueError:
            raise ConfigError(key, params.get(key), "must be an integer", f"{key}: {default}") from None
    if not lo <= value <= hi:
        raise ConfigError(key, value, f"must be between {lo} and {hi}", f"{key}: {min(max(value, lo), hi)}")
    return value


def _world_size_change(value: Any, profile: str) -> WorldSizeChange:
    try:
        return WorldSizeChange(value) if value is not None else WorldSizeChange.FAIL
    except ValueError:
        raise ConfigError(f"profiles/{profile}.on_world_size_change", value, "unknown choice",
                          "fail (refuse a retry on another world size) or merge (continue from the merged "
                          "weights, optimizer state lost)") from None


def _export_model(value: Any, profile: str) -> bool:
    return _flag(value, f"profiles/{profile}.export",
                 "export: true (merge and publish the trained model) or export: false")


def _flag(value: Any, key: str, fix: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(key, value, "must be true or false", fix)
    return value


def build_run_spec(
    params: dict[str, Any] | None,
    *,
    run_name: str,
    model_profile: str | None = None,
    cluster_profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    nccl_debug: bool | None = None,
    model_config: ModelConfigReader | None = None,
) -> RunSpec:
    """Resolve and validate a run from its params (DAG params or CLI flags).

    ``model_profile``/``cluster_profile`` (CLI flags, or the params of the same names) replace the
    run profile's choices; ``overrides`` (flat verl keys, the CLI's ``--set``) and the
    ``verl_overrides`` param are the last layer and win over every profile and scaling rule.
    ``model_config`` reads the actor's own config.json where it is on this machine (the model facts are checked
    against it and completed from it: ``trainer/modelfacts.py``); by default a local directory's is read.
    """
    params = _known_params(params)
    profile_name = params.get("profile") or DEFAULT_PROFILE
    prof = load_yaml_profile("profiles", profile_name)
    model_profile = model_profile or params.get("model_profile") or str(prof.get("model_profile", ""))
    cluster_profile = cluster_profile or params.get("cluster_profile") or str(prof.get("cluster_profile", ""))
    mprof = load_yaml_profile("models", model_profile)
    cprof = load_yaml_profile("clusters", cluster_profile)
    # Flat keys, a section given whole read key by key: each meets the profiles' and the pipeline's own.
    overrides = {**_param_overrides(params), **flatten(dict(overrides or {}))}

    nnodes, n_gpus_per_node = resolve_shape(params, prof, cprof, cluster_profile)
    trainer = dict(prof.get("trainer") or {})
    steps = _int_param(params, "total_training_steps", trainer.get("total_training_steps", 1), 1, 10_000_000)
    mode = _choice(Mode, params.get("mode") or prof.get("mode") or Mode.AUTO.value, "mode",
                   "unknown mode", "auto, train or preflight")
    models = _models(dict(mprof.get("model") or {}), params, model_profile, model_config or local_model_config)
    hardware = Hardware.from_profile(cprof, cluster_profile)
    data = _data(dict(prof.get("data") or {}), params)
    storage = _storage(dict(cprof.get("storage") or {}), cluster_profile)
    cluster = dict(cprof.get("cluster") or {})
    if "backend" not in cluster:
        raise ConfigError(f"clusters/{cluster_profile}.cluster.backend", None, "is required", "backend: local")
    runtime = dict(cprof.get("runtime") or {})
    check_job_env(dict(runtime.get("env") or {}), f"clusters/{cluster_profile}.runtime.env")
    _flag(runtime.get("warm_caches", True), f"clusters/{cluster_profile}.runtime.warm_caches",
          "warm_caches: true (the workers' compile caches on the shared storage) or false")
    placement = _choice(Placement, params.get("placement") or prof.get("placement") or Placement.COLOCATED.value,
                        "placement", "unknown placement", "colocated or separate")
    layers = [mprof.get("verl") or {}, cprof.get("verl") or {}, prof.get("verl") or {}]
    check_owned_keys([*layers, overrides])  # a key the pipeline sets is honoured or refused, never replaced
    verl_settings, derived, pools = derive_verl_settings(
        layers, dict(mprof.get("scaling") or {}), models["model_facts"], hardware, nnodes=nnodes,
        n_gpus_per_node=n_gpus_per_node, overrides=overrides, placement=placement,
    )
    verl_settings, data["data_options"] = _reward_function(verl_settings, data["data_options"], derived)
    verl_settings, job_files = _job_files(verl_settings, prof.get(EXTRA_FILES_KEY), profile_name)
    spec = RunSpec(
        run_name=run_name, profile=profile_name, model_profile=model_profile, cluster_profile=cluster_profile,
        **models, **data, **storage, cluster=cluster, runtime=runtime, hardware=hardware,
        nnodes=nnodes, n_gpus_per_node=n_gpus_per_node, total_training_steps=steps, mode=mode, placement=placement,
        steps_set_by=_steps_set_by(params, trainer), epochs_set_by=_epochs_set_by(layers, overrides),
        pools=pools, verl=verl_settings, derived=derived, trainer_command=_trainer_command(prof),
        nccl_debug=bool(runtime.get("nccl_debug", False)) if nccl_debug is None else nccl_debug,
        watch=WatchSettings.from_profile(prof.get(WATCH_SECTION), profile_name),
        restarts=RestartPolicy.from_profile(prof.get(RESTARTS_SECTION), profile_name),
        evaluation=EvaluationSettings.from_profile(prof.get(EVALUATION_SECTION), profile_name),
        promotion=PromotionRule.from_profile(prof.get(PROMOTION_SECTION), profile_name),
        trackers=TrackerSettings.from_profile(prof.get(TRACKERS_SECTION), profile_name),
        on_world_size_change=_world_size_change(prof.get("on_world_size_change"), profile_name),
        export_model=_export_model(prof.get("export", True), profile_name),
        validate_on_resume=_flag(prof.get("validate_on_resume", False), f"profiles/{profile_name}.validate_on_resume",
                                 "validate_on_resume: false (only the attempt that starts at step 0 validates "
                                 "before training) or true"),
        admission=admission_of(cluster, cluster_profile, nnodes * n_gpus_per_node), job_files=job_files,
    )
    logger_backends(verl_settings.get(LOGGER_KEY))  # an unknown tracker fails here, before any cluster
    check_shape(spec)
    check_storage(spec)
    return spec


def _known_params(params: dict[str, Any] | None) -> dict[str, Any]:
    """The params given a value; one this pipeline does not have is refused."""
    params = {k: v for k, v in (params or {}).items() if v is not None and k != PROMOTE_ANYWAY_PARAM}
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ConfigError(unknown[0], params[unknown[0]], "is not a parameter of this pipeline",
                          f"use only {list(PARAM_KEYS)}")
    return params


def _choice(kind: type[E], text: Any, key: str, rule: str, fix: str) -> E:
    try:
        return kind(text)
    except ValueError:
        raise ConfigError(key, text, rule, fix) from None


#: Reads a model's own config.json where the model is on this machine: ``(config, path)``, else None.
ModelConfigReader = Callable[[ModelSource], "tuple[dict[str, Any], str] | None"]


def local_model_config(source: ModelSource) -> tuple[dict[str, Any], str] | None:
    """A local model directory's config.json, when this machine sees it (other sources: None)."""
    return read_config(source.ref) if source.kind == "path" else None


def _models(section: dict[str, Any], params: dict[str, Any], model_profile: str,
            model_config: ModelConfigReader) -> dict[str, Any]:
    """The model profile's ``model:`` section (the ``model_source`` param wins for the actor): the run's
    models and the size facts of the actor (checked against its own config.json where ``model_config`` reads one)."""
    patterns = section.get("allow_patterns")

    def source(key: str) -> ModelSource | None:
        text = section.get(key)
        return ModelSource.parse(text, key=f"model.{key}", allow_patterns=patterns) if text else None

    actor = ModelSource.parse(params.get("model_source") or section.get("source", ""), allow_patterns=patterns)
    return {"model": actor, "critic_model": source("critic_source"), "reward_model": source("reward_source"),
            "model_facts": facts_for(section, model_profile, model_config(actor))}


def _steps_set_by(params: dict[str, Any], trainer: dict[str, Any]) -> SetBy:
    """Who set the run's total_training_steps: the param (CLI flag), the run profile, or nobody."""
    if params.get("total_training_steps") not in (None, ""):
        return SetBy.ASKED
    return SetBy.PROFILE if trainer.get("total_training_steps") is not None else SetBy.DEFAULT


def _epochs_set_by(layers: list[dict[str, Any]], overrides: dict[str, Any]) -> SetBy | None:
    """Who set ``trainer.total_epochs``: an override (``--set``, ``verl_overrides``), a profile, or nobody (None)."""
    key = "trainer.total_epochs"
    if any(spelled in overrides for spelled in spellings(key)):
        return SetBy.ASKED
    if any(spelled in flatten(layer) for layer in layers for spelled in spellings(key)):
        return SetBy.PROFILE
    return None


def _data(section: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    """The run profile's ``data:`` section (the ``data_source`` and ``recipe`` params win): the source and
    the preprocessing options."""
    data = DataSource.parse(params.get("data_source") or section.pop("source", "builtin:arithmetic"))
    section.pop("source", None)
    if params.get("recipe"):
        section["recipe"] = params["recipe"]
    recipe = section.get("recipe")
    if recipe is not None and recipe not in list_profiles("recipes"):
        raise ConfigError("recipe", recipe, "no such recipe in configs/recipes", f"one of {list_profiles('recipes')}")
    return {"data": data, "data_options": section}


def _reward_function(settings: dict[str, Any], options: dict[str, Any],
                     derived: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The run's reward function named once (:func:`verl_pipeline.trainer.reward.resolve`), imported and its
    signature checked here, before any cluster; written into both the verl settings (the job scores with
    it) and the data options (preprocessing checks the rows with it), with the recipe's answer form
    (``check_solution``)."""
    from verl_pipeline.trainer import reward

    recipe = load_yaml_profile("recipes", str(options.get("recipe") or DEFAULT_RECIPE))
    # How a correct answer is written (per data_source for rows in verl's schema): preprocessing checks
    # rows with it and the preflight scores with it.
    options = {**options, "check_solution": reward.answer_forms(recipe.get("check_solution"),
                                                                options.get("check_solution"))}
    fn = reward.resolve(settings, options, recipe, base=configs_dir())
    if fn is None:
        return settings, options
    reward.load(fn)
    derived[reward.PATH_KEY] = f"the run's reward function, named by {fn.named_by} ({fn.label})"
    return reward.apply(settings, fn), {**options, "custom_reward_path": fn.path, "custom_reward_name": fn.name,
                                        "custom_reward_kwargs": dict(fn.kwargs)}


def _job_files(settings: dict[str, Any], extra: Any, profile_name: str) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The run's own files (``trainer/jobfiles.py``): every path a verl setting names made absolute and found
    here, and the run profile's ``job_files`` list."""
    from verl_pipeline.trainer import jobfiles

    if extra is not None and not isinstance(extra, list):
        raise ConfigError(f"profiles/{profile_name}.{EXTRA_FILES_KEY}", extra, "must be a list of files",
                          f"{EXTRA_FILES_KEY}: [my_task/tools.py]")
    updates, files = jobfiles.absolute(settings, extra or [], base=configs_dir())
    return {**settings, **updates}, files


def _storage(section: dict[str, Any], cluster_profile: str) -> dict[str, Any]:
    """The cluster profile's ``storage:`` section: the root, the explicit locations (absolute), the shared mounts."""
    root_text = section.get("root")
    storage_root = Path(root_text).expanduser().resolve() if root_text else pipeline_home()
    storage_paths: dict[str, str] = {}
    for name in ("data", "models", "checkpoints", "caches"):
        value = section.get(name)
        if value is None:
            continue
        if not Path(str(value)).is_absolute():
            raise ConfigError(f"clusters/{cluster_profile}.storage.{name}", value,
                              "storage paths must be absolute (every node resolves them the same way)",
                              f"{storage_root / name}")
        storage_paths[name] = str(value)
    shared = section.get("shared")
    return {"storage_root": storage_root, "storage_paths": storage_paths,
            "shared_roots": tuple(str(Path(str(r))) for r in shared) if shared else (str(storage_root),)}


def _trainer_command(prof: dict[str, Any]) -> tuple[str, ...]:
    command = prof.get("trainer_command") or list(DEFAULT_TRAINER_COMMAND)
    if not isinstance(command, list) or not command or not all(isinstance(w, str) and w for w in command):
        raise ConfigError("trainer_command", command, "must be a non-empty list of words",
                          "[python, -m, verl.trainer.main_ppo]")
    return tuple(command)


#: What each param (and the CLI's ``--nccl-debug``) sets in the spec, as text: what an explicit value is
#: compared with in a frozen run (``verl_overrides`` is compared key by key).
_ASKED_IN_SPEC: dict[str, Callable[[RunSpec], Any]] = {
    "profile": lambda s: s.profile,
    "model_profile": lambda s: s.model_profile,
    "cluster_profile": lambda s: s.cluster_profile,
    "data_source": lambda s: str(s.data),
    "recipe": lambda s: s.data_options.get("recipe"),
    "model_source": lambda s: str(s.model),
    "nnodes": lambda s: s.nnodes,
    "n_gpus_per_node": lambda s: s.n_gpus_per_node,
    "total_training_steps": lambda s: s.total_training_steps,
    "mode": lambda s: s.mode.value,
    "placement": lambda s: s.placement.value,
    "nccl_debug": lambda s: s.nccl_debug,
}


@dataclass(frozen=True)
class Asked:
    """What a command or a DAG run set explicitly: the params (CLI flags) given a value, and the flat verl
    keys of ``--set`` / ``verl_overrides``. A run already frozen must agree with each (:meth:`conflicts`):
    the user asked for it, so it is not dropped with a warning as a changed profile file is."""

    params: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, params: dict[str, Any] | None, *, model_profile: str | None = None,
           cluster_profile: str | None = None, overrides: dict[str, Any] | None = None,
           nccl_debug: bool | None = None) -> Asked:
        """From :func:`build_run_spec`'s arguments (the same ones)."""
        given = {k: v for k, v in (params or {}).items() if v is not None and v != "" and k != "verl_overrides"}
        extra = {"model_profile": model_profile, "cluster_profile": cluster_profile, "nccl_debug": nccl_debug}
        given.update({k: v for k, v in extra.items() if v is not None})
        flat = {**_param_overrides(params or {}), **flatten(dict(overrides or {}))}
        return cls(given, flat)

    def conflicts(self, built: RunSpec, frozen: RunSpec) -> dict[str, tuple[Any, Any]]:
        """Each explicit value the frozen run does not have: name -> (what was asked, what the run has).
        ``built`` is the spec the same arguments make now (it reads the asked values as the run did)."""
        out = {}
        for name in self.params:
            now, then = _ASKED_IN_SPEC[name](built), _ASKED_IN_SPEC[name](frozen)
            if now != then:
                out[name] = (now, then)
        for key in self.overrides:
            now, then = built.verl.get(key), frozen.verl.get(key)
            if now != then:
                out[key] = (now, then)
        return out


def _param_overrides(params: dict[str, Any]) -> dict[str, Any]:
    """The ``verl_overrides`` param (a list of ``key=value`` / ``+key=value``) as flat settings."""
    items = params.get("verl_overrides") or []
    if not isinstance(items, list):
        raise ConfigError("verl_overrides", items, "must be a list of KEY=VALUE strings",
                          '["actor_rollout_ref.actor.optim.lr=1e-6", "+key=value"]')
    return parse_overrides(items, field="verl_overrides")


def resolve_shape(params: dict[str, Any], prof: dict[str, Any], cprof: dict[str, Any],
                  cluster_profile: str) -> tuple[int, int]:
    """``(nnodes, n_gpus_per_node)``: a param wins; then the run profile's ``trainer`` section, but only
    while the run uses the run profile's own cluster profile (its shape was written for that
    cluster); then the cluster profile's ``hardware``; then 1."""
    hardware = dict(cprof.get("hardware") or {})
    own_cluster = str(prof.get("cluster_profile", "")) == cluster_profile
    trainer = dict(prof.get("trainer") or {}) if own_cluster else {}
    nnodes = _int_param(params, "nnodes", trainer.get("nnodes", hardware.get("nnodes", 1)), 1, 1024)
    n_gpus_per_node = _int_param(params, "n_gpus_per_node",
                                 trainer.get("n_gpus_per_node", hardware.get("n_gpus_per_node", 1)), 1, 16)
    return nnodes, n_gpus_per_node


# verl keys the project's own rules compute with, and their type (verl's YAML has the same).
_NUMERIC_KEYS: dict[str, type] = {
    "data.train_batch_size": int, "data.max_prompt_length": int, "data.max_response_length": int,
    "actor_rollout_ref.rollout.n": int, "actor_rollout_ref.rollout.tensor_model_parallel_size": int,
    "actor_rollout_ref.actor.ppo_mini_batch_size": int, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": int,
    "critic.ppo_mini_batch_size": int, "critic.ppo_micro_batch_size_per_gpu": int,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": int,
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": int,
    "trainer.save_freq": int, "trainer.test_freq": int, "trainer.total_epochs": int,
    "actor_rollout_ref.model.lora_rank": int, "critic.model.lora_rank": int,
    "actor_rollout_ref.rollout.gpu_memory_utilization": float, "actor_rollout_ref.actor.optim.lr": float,
    "critic.optim.lr": float,
}


def check_types(settings: dict[str, Any]) -> None:
    """A value of the wrong type for a numeric verl key fails here, naming it, before any arithmetic."""
    for key, kind in _NUMERIC_KEYS.items():
        for spelled in spellings(key):
            value = settings.get(spelled)
            if value is None:
                continue
            ok = (isinstance(value, int) if kind is int else isinstance(value, int | float))
            if isinstance(value, bool) or not ok:
                example = "256" if kind is int else "1e-6" if key.endswith("lr") else "0.6"
                raise ConfigError(key, value, f"must be {'an integer' if kind is int else 'a number'}",
                                  f"{key}={example}")


def derive_verl_settings(
    layers: list[dict[str, Any]],
    scaling_section: dict[str, Any],
    facts: ModelFacts,
    hardware: Hardware,
    *,
    nnodes: int,
    n_gpus_per_node: int,
    overrides: dict[str, Any] | None = None,
    placement: Placement = Placement.COLOCATED,
) -> tuple[dict[str, Any], dict[str, str], PoolSplit | None]:
    """Merge the ``verl:`` layers (later wins), then apply the scaling rules to what is not set.

    Returns the flat settings, for every derived (or explicitly kept) key the rule behind it, and
    with ``placement: separate`` the split of the GPUs (the batch rules then size for the training pool).
    """
    merged: dict[str, Any] = {}
    for layer in layers:
        merged = _deep_merge(merged, layer)
    settings = flatten(merged)
    settings.update(dict(overrides or {}))
    check_types(settings)
    pools = scaling.split_pools(nnodes, n_gpus_per_node, settings) if placement is Placement.SEPARATE else None
    explicit = set(settings)
    result = scaling.derive(settings, scaling_section, facts, hardware,
                            nnodes=pools.train_nnodes if pools else nnodes,
                            n_gpus_per_node=pools.train_gpus_per_node if pools else n_gpus_per_node,
                            explicit=explicit)
    if pools is not None:
        scaling.separate_settings(result, pools, explicit)
    rollout_gpus = pools.rollout_nnodes * pools.rollout_gpus_per_node if pools else nnodes * n_gpus_per_node
    scaling.rollout_settings(result, facts, hardware, rollout_gpus=rollout_gpus, explicit=explicit)
    return result.settings, {r.key: r.text() for r in result.rules}, pools


def check_storage(spec: RunSpec) -> None:
    """Checkpoints must be absolute and on storage every node shares (``resume_mode=auto`` reads them back)."""
    ckpt = spec.checkpoint_dir
    if not ckpt.is_absolute():
        raise ConfigError("trainer.default_local_dir", str(ckpt), "must be an absolute path",
                          f"{spec.storage_root / 'checkpoints'}")
    for name, path in (("checkpoints", ckpt), ("data", spec.data_root), ("models", spec.model_cache),
                       ("caches", spec.cache_root)):
        require_shared(f"clusters/{spec.cluster_profile}.storage.{name}", path, spec.shared_roots,
                       "other nodes would not see it")


