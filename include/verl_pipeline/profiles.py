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
from pathlib import Path
from typing import Any

import yaml

from verl_pipeline.admission import admission_of
from verl_pipeline.auth import check_job_env
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode, Placement, WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir, pipeline_home
from verl_pipeline.restarts import SECTION as RESTARTS_SECTION
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.spec import SECTION as WATCH_SECTION
from verl_pipeline.spec import (
    DataSource,
    Hardware,
    ModelFacts,
    ModelSource,
    PoolSplit,
    RunSpec,
    WatchSettings,
    under_shared,
)
from verl_pipeline.trackers import LOGGER_KEY, TrackerSettings, logger_backends
from verl_pipeline.trackers import SECTION as TRACKERS_SECTION
from verl_pipeline.trainer import scaling
from verl_pipeline.trainer.overrides import flatten, parse_overrides
from verl_pipeline.trainer.owned import check_owned_keys
from verl_pipeline.trainer.shape import check_shape

#: Params a DAG run (or the CLI) may set; None means "take the profile's value".
PARAM_KEYS = ("profile", "model_profile", "cluster_profile", "data_source", "recipe", "model_source", "nnodes",
              "n_gpus_per_node", "total_training_steps", "mode", "placement", "verl_overrides")
DEFAULT_PROFILE = "smoke"




def list_profiles(kind: str = "profiles") -> list[str]:
    """Names of the YAML profiles of one kind (``profiles``, ``models`` or ``clusters``)."""
    folder = configs_dir() / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


# The param (and CLI flag) that names a profile of each kind.
_PROFILE_FIELD = {"profiles": "profile", "models": "model_profile", "clusters": "cluster_profile"}


def load_yaml_profile(kind: str, name: str) -> dict[str, Any]:
    field = _PROFILE_FIELD.get(kind, kind.rstrip("s"))
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError(field, name, "is not a profile name", f"use one of {list_profiles(kind)}")
    path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(field, name, f"no such profile in {path.parent}", f"use one of {list_profiles(kind)}")
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
    if not isinstance(value, bool):
        raise ConfigError(f"profiles/{profile}.export", value, "must be true or false",
                          "export: true (merge and publish the trained model) or export: false")
    return value


def build_run_spec(
    params: dict[str, Any] | None,
    *,
    run_name: str,
    model_profile: str | None = None,
    cluster_profile: str | None = None,
    overrides: dict[str, Any] | None = None,
    nccl_debug: bool | None = None,
) -> RunSpec:
    """Resolve and validate a run from its params (DAG params or CLI flags).

    ``model_profile``/``cluster_profile`` (CLI flags, or the params of the same names) replace the
    run profile's choices; ``overrides`` (flat verl keys, the CLI's ``--set``) and the
    ``verl_overrides`` param are the last layer and win over every profile and scaling rule.
    """
    params = {k: v for k, v in (params or {}).items() if v is not None}
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ConfigError(unknown[0], params[unknown[0]], "is not a parameter of this pipeline",
                          f"use only {list(PARAM_KEYS)}")
    profile_name = params.get("profile") or DEFAULT_PROFILE
    prof = load_yaml_profile("profiles", profile_name)
    model_profile = model_profile or params.get("model_profile") or str(prof.get("model_profile", ""))
    cluster_profile = cluster_profile or params.get("cluster_profile") or str(prof.get("cluster_profile", ""))
    mprof = load_yaml_profile("models", model_profile)
    cprof = load_yaml_profile("clusters", cluster_profile)
    overrides = {**_param_overrides(params), **dict(overrides or {})}

    nnodes, n_gpus_per_node = resolve_shape(params, prof, cprof, cluster_profile)
    trainer = dict(prof.get("trainer") or {})
    steps = _int_param(params, "total_training_steps", trainer.get("total_training_steps", 1), 1, 10_000_000)

    mode_text = params.get("mode") or prof.get("mode") or Mode.AUTO.value
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise ConfigError("mode", mode_text, "unknown mode", "auto, train or preflight") from None

    model_section = dict(mprof.get("model") or {})
    patterns = model_section.get("allow_patterns")
    model = ModelSource.parse(params.get("model_source") or model_section.get("source", ""),
                              allow_patterns=patterns)
    critic_text = model_section.get("critic_source")
    critic = ModelSource.parse(critic_text, key="model.critic_source", allow_patterns=patterns) \
        if critic_text else None
    reward_text = model_section.get("reward_source")
    reward = ModelSource.parse(reward_text, key="model.reward_source", allow_patterns=patterns) \
        if reward_text else None
    facts = ModelFacts.from_profile(model_section, model_profile)
    hardware = Hardware.from_profile(cprof, cluster_profile)

    data_section = dict(prof.get("data") or {})
    data = DataSource.parse(params.get("data_source") or data_section.pop("source", "builtin:arithmetic"))
    data_section.pop("source", None)
    if params.get("recipe"):
        data_section["recipe"] = params["recipe"]
    recipe = data_section.get("recipe")
    if recipe is not None and recipe not in list_profiles("recipes"):
        raise ConfigError("recipe", recipe, "no such recipe in configs/recipes", f"one of {list_profiles('recipes')}")

    storage = dict(cprof.get("storage") or {})
    root_text = storage.get("root")
    storage_root = Path(root_text).expanduser().resolve() if root_text else pipeline_home()
    storage_paths: dict[str, str] = {}
    for name in ("data", "models", "checkpoints"):
        value = storage.get(name)
        if value is None:
            continue
        if not Path(str(value)).is_absolute():
            raise ConfigError(f"clusters/{cluster_profile}.storage.{name}", value,
                              "storage paths must be absolute (every node resolves them the same way)",
                              f"{storage_root / name}")
        storage_paths[name] = str(value)
    shared = storage.get("shared")
    shared_roots = tuple(str(Path(str(r))) for r in shared) if shared else (str(storage_root),)

    cluster = dict(cprof.get("cluster") or {})
    if "backend" not in cluster:
        raise ConfigError(f"clusters/{cluster_profile}.cluster.backend", None, "is required", "backend: local")

    runtime = dict(cprof.get("runtime") or {})
    check_job_env(dict(runtime.get("env") or {}), f"clusters/{cluster_profile}.runtime.env")
    placement_text = params.get("placement") or prof.get("placement") or Placement.COLOCATED.value
    try:
        placement = Placement(placement_text)
    except ValueError:
        raise ConfigError("placement", placement_text, "unknown placement", "colocated or separate") from None
    layers = [mprof.get("verl") or {}, cprof.get("verl") or {}, prof.get("verl") or {}]
    check_owned_keys([*layers, overrides])  # a key the pipeline sets is honoured or refused, never replaced
    verl_settings, derived, pools = derive_verl_settings(
        layers, dict(mprof.get("scaling") or {}), facts, hardware, nnodes=nnodes, n_gpus_per_node=n_gpus_per_node,
        overrides=overrides, placement=placement,
    )
    command = prof.get("trainer_command") or list(DEFAULT_TRAINER_COMMAND)
    if not isinstance(command, list) or not command or not all(isinstance(w, str) and w for w in command):
        raise ConfigError("trainer_command", command, "must be a non-empty list of words",
                          "[python, -m, verl.trainer.main_ppo]")
    spec = RunSpec(
        run_name=run_name,
        profile=profile_name,
        model_profile=model_profile,
        cluster_profile=cluster_profile,
        model=model,
        critic_model=critic,
        data=data,
        data_options=data_section,
        cluster=cluster,
        storage_root=storage_root,
        runtime=runtime,
        nnodes=nnodes,
        n_gpus_per_node=n_gpus_per_node,
        total_training_steps=steps,
        mode=mode,
        verl=verl_settings,
        derived=derived,
        trainer_command=tuple(command),
        reward_model=reward,
        model_facts=facts,
        hardware=hardware,
        storage_paths=storage_paths,
        shared_roots=shared_roots,
        nccl_debug=bool(runtime.get("nccl_debug", False)) if nccl_debug is None else nccl_debug,
        placement=placement,
        pools=pools,
        watch=WatchSettings.from_profile(prof.get(WATCH_SECTION), profile_name),
        restarts=RestartPolicy.from_profile(prof.get(RESTARTS_SECTION), profile_name),
        trackers=TrackerSettings.from_profile(prof.get(TRACKERS_SECTION), profile_name),
        on_world_size_change=_world_size_change(prof.get("on_world_size_change"), profile_name),
        export_model=_export_model(prof.get("export", True), profile_name),
        admission=admission_of(cluster, cluster_profile, nnodes * n_gpus_per_node),
    )
    logger_backends(verl_settings.get(LOGGER_KEY))  # an unknown tracker fails here, before any cluster
    check_shape(spec)
    check_storage(spec)
    return spec


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
    "trainer.save_freq": int, "trainer.test_freq": int,
    "actor_rollout_ref.rollout.gpu_memory_utilization": float, "actor_rollout_ref.actor.optim.lr": float,
    "critic.optim.lr": float,
}


def check_types(settings: dict[str, Any]) -> None:
    """A value of the wrong type for a numeric verl key fails here, naming it, before any arithmetic."""
    for key, kind in _NUMERIC_KEYS.items():
        for spelled in (key, f"+{key}", f"++{key}"):
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
    return result.settings, {r.key: r.text() for r in result.rules}, pools


def check_storage(spec: RunSpec) -> None:
    """Checkpoints must be absolute and on storage every node shares (``resume_mode=auto`` reads them back)."""
    ckpt = spec.checkpoint_dir
    if not ckpt.is_absolute():
        raise ConfigError("trainer.default_local_dir", str(ckpt), "must be an absolute path",
                          f"{spec.storage_root / 'checkpoints'}")
    for name, path in (("checkpoints", ckpt), ("data", spec.data_root), ("models", spec.model_cache)):
        if not under_shared(path, spec.shared_roots):
            raise ConfigError(f"clusters/{spec.cluster_profile}.storage.{name}", str(path),
                              f"is not under a shared mount {list(spec.shared_roots)}: other nodes would not see it",
                              f"a path under {spec.shared_roots[0]}")


