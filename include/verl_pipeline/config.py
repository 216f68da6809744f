"""The run's typed spec: YAML profiles from ``configs/`` + the DAG run's params, validated.

A run = run profile (``configs/profiles``) → model profile (``configs/models``) + cluster profile
(``configs/clusters``), with the params of the DAG run applied last. Everything is checked here,
before any cluster starts; errors name the key, the value, the rule and a fix.
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.paths import configs_dir, pipeline_home, short_hash, slug
from verl_pipeline.trainer.overrides import flatten

#: Params a DAG run (or the CLI) may set; None means "take the profile's value".
PARAM_KEYS = ("profile", "data_source", "recipe", "model_source", "nnodes", "n_gpus_per_node", "total_training_steps",
              "mode")
DEFAULT_PROFILE = "smoke"

_HF_SOURCE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(@(?P<rev>[\w.\-/]+))?$")


def list_profiles(kind: str = "profiles") -> list[str]:
    """Names of the YAML profiles of one kind (``profiles``, ``models`` or ``clusters``)."""
    folder = configs_dir() / kind
    return sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []


def load_yaml_profile(kind: str, name: str) -> dict[str, Any]:
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise ConfigError(kind.rstrip("s"), name, "is not a profile name", f"use one of {list_profiles(kind)}")
    path = configs_dir() / kind / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(kind.rstrip("s") if kind != "profiles" else "profile", name,
                          f"no such profile in {path.parent}", f"use one of {list_profiles(kind)}")
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


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``builtin:tiny-qwen2``, ``hf://org/name@rev`` or a local directory."""

    kind: str
    ref: str
    revision: str | None = None

    @classmethod
    def parse(cls, text: str, *, key: str = "model_source") -> ModelSource:
        text = str(text).strip()
        if text == "builtin:tiny-qwen2":
            return cls("builtin", "tiny-qwen2")
        if text.startswith("builtin:"):
            raise ConfigError(key, text, "unknown built-in model", "builtin:tiny-qwen2")
        if text.startswith("hf://"):
            m = _HF_SOURCE.match(text)
            if not m:
                raise ConfigError(key, text, "is not a hub reference", "hf://Qwen/Qwen2.5-0.5B-Instruct@main")
            return cls("hf", m["repo"], m["rev"] or "main")
        path = Path(text).expanduser()
        if not path.is_absolute():
            raise ConfigError(key, text, "a local model must be an absolute directory path",
                              "/shared/models/my-model (with config.json), hf://org/name@rev or builtin:tiny-qwen2")
        return cls("path", str(path))

    def __str__(self) -> str:
        if self.kind == "builtin":
            return f"builtin:{self.ref}"
        if self.kind == "hf":
            return f"hf://{self.ref}@{self.revision}"
        return self.ref


@dataclass(frozen=True)
class DataSource:
    """Where the data comes from.

    ``builtin:arithmetic``; an absolute local file, glob or directory (train.* + test.*/val.*) of
    JSONL/JSON/CSV/Parquet (``files``), or a directory saved by ``datasets`` ``save_to_disk``
    (``hf_disk``); an fsspec URL such as ``s3://bucket/data/*.parquet`` (``url``); or a
    HuggingFace dataset ``hf://name?config=main&revision=…&split=…`` (``hf``).
    """

    kind: str
    ref: str

    @classmethod
    def parse(cls, text: str, *, key: str = "data_source") -> DataSource:
        import glob

        text = str(text).strip()
        if text == "builtin:arithmetic":
            return cls("builtin", "arithmetic")
        if text.startswith("builtin:"):
            raise ConfigError(key, text, "unknown built-in data source", "builtin:arithmetic")
        if text.startswith("hf://"):
            if not re.fullmatch(r"hf://[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(\?[\w.\-=&/]*)?", text):
                raise ConfigError(key, text, "is not a dataset reference",
                                  "hf://openai/gsm8k?config=main&revision=<commit>")
            return cls("hf", text)
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", text):
            from verl_pipeline.data.sources import fsspec_filesystem

            fsspec_filesystem(text)  # an unknown protocol or a missing backend fails here, naming the package
            return cls("url", text)
        path = Path(text).expanduser()
        if not path.is_absolute():
            raise ConfigError(key, text, "a local data source must be an absolute path",
                              "/data/gsm8k (with train.jsonl/test.jsonl) or builtin:arithmetic")
        if glob.has_magic(text):
            if not glob.glob(str(path)):
                raise ConfigError(key, text, "the glob matches no file", "a glob that matches your data files")
            return cls("files", str(path))
        if path.is_dir():
            if (path / "dataset_dict.json").is_file() or (path / "state.json").is_file():
                return cls("hf_disk", str(path))
            if not any((path / f"train.{ext}").is_file() for ext in ("jsonl", "json", "csv", "parquet")):
                raise ConfigError(key, text, "the directory has no train.jsonl (or train.json/.csv/.parquet)",
                                  "a directory with train.jsonl (and optionally test.jsonl)")
        elif not path.is_file():
            raise ConfigError(key, text, "no such file or directory", "an existing JSONL file or directory")
        return cls("files", str(path))

    def __str__(self) -> str:
        return "builtin:arithmetic" if self.kind == "builtin" else self.ref


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


@dataclass(frozen=True)
class RunSpec:
    """One run, fully resolved: what to train, where, on what shape, and where outputs go."""

    run_name: str
    profile: str
    model_profile: str
    cluster_profile: str
    model: ModelSource
    critic_model: ModelSource | None
    data: DataSource
    data_options: dict[str, Any]
    cluster: dict[str, Any]
    storage_root: Path
    runtime: dict[str, Any]
    nnodes: int
    n_gpus_per_node: int
    total_training_steps: int
    mode: Mode
    verl: dict[str, Any] = field(default_factory=dict)
    derived: dict[str, str] = field(default_factory=dict)

    # -- where things go --------------------------------------------------------------------------
    @property
    def run_key(self) -> str:
        return f"{slug(self.run_name, 32)}-{short_hash(self.run_name, length=8)}"

    @property
    def cluster_name(self) -> str:
        """Names the run's cluster: unique per run and per storage root (two homes never share one)."""
        return f"{self.run_name}#{short_hash(self.storage_root, length=6)}"

    @property
    def run_dir(self) -> Path:
        """Per-run files: merged config, job summary, metrics."""
        return self.storage_root / "runs" / self.run_key

    @property
    def data_root(self) -> Path:
        return self.storage_root / "data"

    @property
    def model_cache(self) -> Path:
        return self.storage_root / "models"

    @property
    def checkpoint_dir(self) -> Path:
        return self.storage_root / "checkpoints" / self.run_key

    @property
    def metrics_path(self) -> Path:
        return self.run_dir / "metrics.jsonl"

    @property
    def n_gpus(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    def to_dict(self) -> dict[str, Any]:
        return {
            "run_name": self.run_name,
            "profile": self.profile,
            "model_profile": self.model_profile,
            "cluster_profile": self.cluster_profile,
            "model": str(self.model),
            "critic_model": str(self.critic_model) if self.critic_model else None,
            "data": str(self.data),
            "data_options": self.data_options,
            "cluster": self.cluster,
            "storage_root": str(self.storage_root),
            "runtime": self.runtime,
            "nnodes": self.nnodes,
            "n_gpus_per_node": self.n_gpus_per_node,
            "total_training_steps": self.total_training_steps,
            "mode": self.mode.value,
            "verl": self.verl,
            "derived": self.derived,
        }


def build_run_spec(
    params: dict[str, Any] | None,
    *,
    run_name: str,
    model_profile: str | None = None,
    cluster_profile: str | None = None,
) -> RunSpec:
    """Resolve and validate a run from its params (DAG params or CLI flags).

    ``model_profile``/``cluster_profile`` replace the run profile's choices (CLI ``render``).
    """
    params = dict(params or {})
    unknown = sorted(set(params) - set(PARAM_KEYS))
    if unknown:
        raise ConfigError(unknown[0], params[unknown[0]], "is not a parameter of this pipeline",
                          f"use only {list(PARAM_KEYS)}")
    profile_name = params.get("profile") or DEFAULT_PROFILE
    prof = load_yaml_profile("profiles", profile_name)
    model_profile = model_profile or str(prof.get("model_profile", ""))
    cluster_profile = cluster_profile or str(prof.get("cluster_profile", ""))
    mprof = load_yaml_profile("models", model_profile)
    cprof = load_yaml_profile("clusters", cluster_profile)

    trainer = dict(prof.get("trainer") or {})
    nnodes = _int_param(params, "nnodes", trainer.get("nnodes", 1), 1, 1024)
    n_gpus_per_node = _int_param(params, "n_gpus_per_node", trainer.get("n_gpus_per_node", 1), 1, 16)
    steps = _int_param(params, "total_training_steps", trainer.get("total_training_steps", 1), 1, 10_000_000)

    mode_text = params.get("mode") or prof.get("mode") or Mode.AUTO.value
    try:
        mode = Mode(mode_text)
    except ValueError:
        raise ConfigError("mode", mode_text, "unknown mode", "auto, train or preflight") from None

    model_section = dict(mprof.get("model") or {})
    model = ModelSource.parse(params.get("model_source") or model_section.get("source", ""))
    critic_text = model_section.get("critic_source")
    critic = ModelSource.parse(critic_text, key="model.critic_source") if critic_text else None

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

    cluster = dict(cprof.get("cluster") or {})
    if "backend" not in cluster:
        raise ConfigError(f"clusters/{cluster_profile}.cluster.backend", None, "is required", "backend: local")

    verl_settings, derived = derive_verl_settings(mprof, prof, nnodes=nnodes, n_gpus_per_node=n_gpus_per_node)
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
        runtime=dict(cprof.get("runtime") or {}),
        nnodes=nnodes,
        n_gpus_per_node=n_gpus_per_node,
        total_training_steps=steps,
        mode=mode,
        verl=verl_settings,
        derived=derived,
    )
    check_shape(spec)
    return spec


def derive_verl_settings(
    mprof: dict[str, Any], prof: dict[str, Any], *, nnodes: int, n_gpus_per_node: int
) -> tuple[dict[str, Any], dict[str, str]]:
    """The model profile's verl settings, with per-node batch bases scaled to ``nnodes``.

    Returns the flat settings and, for every derived key, the rule that produced it.
    """
    settings = flatten(_deep_merge(mprof.get("verl") or {}, prof.get("verl") or {}))
    derived: dict[str, str] = {}
    scaling = dict(mprof.get("scaling") or {})
    per_node = {
        "data.train_batch_size": scaling.get("train_batch_size_per_node"),
        "actor_rollout_ref.actor.ppo_mini_batch_size": scaling.get("ppo_mini_batch_size_per_node"),
        "critic.ppo_mini_batch_size": scaling.get("ppo_mini_batch_size_per_node"),
    }
    for key, base in per_node.items():
        if base is None or key in (prof.get("verl_fixed") or []):
            continue
        if key.startswith("critic.") and not _uses_critic(settings):
            continue
        settings[key] = int(base) * nnodes
        derived[key] = f"{base} per node x {nnodes} node(s) = {settings[key]}"
    return settings, derived


def _uses_critic(settings: dict[str, Any]) -> bool:
    enabled = settings.get("critic.enable")
    if enabled is not None:
        return bool(enabled)
    return settings.get("algorithm.adv_estimator", "gae") == "gae"


def check_shape(spec: RunSpec) -> None:
    """The batch/parallelism rules verl enforces only once GPUs are up, checked for the target shape."""
    s = spec.verl
    gpus = spec.n_gpus
    tbs = int(s.get("data.train_batch_size", 0) or 0)
    n = int(s.get("actor_rollout_ref.rollout.n", 1) or 1)
    if tbs <= 0:
        raise ConfigError("data.train_batch_size", tbs, "must be set to a positive number in the model profile",
                          "scaling.train_batch_size_per_node: 16")
    if (tbs * n) % gpus:
        good = max(gpus, ((tbs * n + gpus - 1) // gpus) * gpus // n)
        raise ConfigError(
            "data.train_batch_size", tbs,
            f"train_batch_size x rollout.n ({tbs} x {n}) must be divisible by nnodes x n_gpus_per_node ({gpus})",
            f"data.train_batch_size={good}" if (good * n) % gpus == 0 else f"a multiple of {gpus}",
        )
    mini = s.get("actor_rollout_ref.actor.ppo_mini_batch_size")
    if mini is not None and int(mini) > tbs:
        raise ConfigError("actor_rollout_ref.actor.ppo_mini_batch_size", mini,
                          f"must not exceed data.train_batch_size ({tbs})", f"{tbs}")
    tp = int(s.get("actor_rollout_ref.rollout.tensor_model_parallel_size", 1) or 1)
    if tp < 1 or spec.n_gpus_per_node % tp:
        divisors = [d for d in range(1, spec.n_gpus_per_node + 1) if spec.n_gpus_per_node % d == 0]
        raise ConfigError(
            "actor_rollout_ref.rollout.tensor_model_parallel_size", tp,
            f"must divide n_gpus_per_node ({spec.n_gpus_per_node})", f"one of {divisors}",
        )
