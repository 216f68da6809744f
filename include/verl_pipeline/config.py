"""The run's typed spec: YAML profiles from ``configs/`` + the DAG run's params, validated.

A run = model profile (``configs/models``) + cluster profile (``configs/clusters``) + the run
profile (``configs/profiles``, which names the two) + the params of the DAG run; later layers
override earlier ones. The scaling rules (``trainer/scaling.py``) then derive what depends on the
shape, and every rule verl would only enforce on GPUs is checked here, before any cluster starts;
errors name the key, the value, the rule and a value that would pass.
"""

from __future__ import annotations

import copy
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from verl_pipeline.cluster.admission import Admission, admission_of
from verl_pipeline.constants import DEFAULT_TRAINER_COMMAND, Mode, Placement, WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.watchdog import SECTION as WATCH_SECTION
from verl_pipeline.jobs.watchdog import WatchSettings
from verl_pipeline.paths import configs_dir, pipeline_home, short_hash, slug
from verl_pipeline.rundir import RunDir
from verl_pipeline.trackers import LOGGER_KEY, TrackerSettings, logger_backends
from verl_pipeline.trackers import SECTION as TRACKERS_SECTION
from verl_pipeline.trainer import scaling
from verl_pipeline.trainer.overrides import flatten

#: Params a DAG run (or the CLI) may set; None means "take the profile's value".
PARAM_KEYS = ("profile", "model_profile", "cluster_profile", "data_source", "recipe", "model_source", "nnodes",
              "n_gpus_per_node", "total_training_steps", "mode", "placement", "verl_overrides")
DEFAULT_PROFILE = "smoke"

_HF_SOURCE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(@(?P<rev>[\w.\-/]+))?$")


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


#: A URL fsspec reads (``s3://``, ``gs://``, ``file://``, ...): copied into the shared cache.
_URL_SOURCE = re.compile(r"^(?P<proto>[a-z][a-z0-9+.\-]*)://(?P<rest>.+)$")

#: Roles a run's models play, in the order the DAG prefetches them.
MODEL_ROLES = ("actor", "critic", "reward")


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: ``builtin:tiny-qwen2``, ``hf://org/name@rev``, a local directory or an fsspec URL.

    ``allow_patterns`` (hub and fsspec sources) replaces the default file patterns; it does not take
    part in equality, so the same model with different patterns is still one model.
    """

    kind: str
    ref: str
    revision: str | None = None
    allow_patterns: tuple[str, ...] | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, text: str, *, key: str = "model_source",
              allow_patterns: list[str] | tuple[str, ...] | None = None) -> ModelSource:
        text = str(text).strip()
        patterns = _patterns(allow_patterns, key)
        if text == "builtin:tiny-qwen2":
            return cls("builtin", "tiny-qwen2")
        if text.startswith("builtin:"):
            raise ConfigError(key, text, "unknown built-in model", "builtin:tiny-qwen2")
        if text.startswith("hf://"):
            m = _HF_SOURCE.match(text)
            if not m:
                raise ConfigError(key, text, "is not a hub reference", "hf://Qwen/Qwen2.5-0.5B-Instruct@main")
            return cls("hf", m["repo"], m["rev"] or "main", patterns)
        url = _URL_SOURCE.match(text)
        if url:
            proto = url["proto"]
            if proto == "file":
                return cls.parse(url["rest"], key=key)
            import fsspec

            if proto not in fsspec.available_protocols():
                raise ConfigError(key, text, f"unknown URL scheme {proto!r}",
                                  "hf://org/name@rev, an absolute directory, or an fsspec URL such as "
                                  "s3://bucket/models/name (with the fsspec backend installed)")
            return cls("fsspec", text.rstrip("/"), None, patterns)
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


def _patterns(value: object, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str) or not isinstance(value, list | tuple) or not value \
            or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(f"{key} allow_patterns", value, "must be a non-empty list of glob patterns",
                          "allow_patterns: ['*.json', '*.safetensors', 'tokenizer*']")
    return tuple(value)


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
    #: derived (or explicitly kept) verl key -> the rule behind its value
    derived: dict[str, str] = field(default_factory=dict)
    trainer_command: tuple[str, ...] = DEFAULT_TRAINER_COMMAND
    reward_model: ModelSource | None = None

    def model_sources(self) -> dict[str, ModelSource]:
        """The run's models by role (``actor`` always; ``critic``/``reward`` when the model profile sets them)."""
        out = {"actor": self.model}
        if self.critic_model is not None:
            out["critic"] = self.critic_model
        if self.reward_model is not None:
            out["reward"] = self.reward_model
        return out
    model_facts: scaling.ModelFacts | None = None
    hardware: scaling.Hardware | None = None
    #: Explicit storage locations from the cluster profile (data, models, checkpoints).
    storage_paths: dict[str, str] = field(default_factory=dict)
    #: Mount points every Ray node and the Airflow workers see at the same path.
    shared_roots: tuple[str, ...] = ()
    nccl_debug: bool = False
    placement: Placement = Placement.COLOCATED
    #: ``placement: separate``: how the cluster's GPUs are split between training and rollout.
    pools: scaling.PoolSplit | None = None
    #: The hang watchdog of the wait step (the run profile's ``watch:`` section).
    watch: WatchSettings = field(default_factory=WatchSettings)
    #: The Airflow connection of each tracker in ``trainer.logger`` (the run profile's ``trackers:`` section).
    trackers: TrackerSettings = field(default_factory=TrackerSettings)
    #: What a retry does on a cluster of another world size (the run profile's ``on_world_size_change``).
    on_world_size_change: WorldSizeChange = WorldSizeChange.FAIL
    #: Merge and publish the trained model after a successful training run (the run profile's ``export``).
    export_model: bool = True
    #: A shared cluster's Airflow pool and the slots this run takes (the cluster profile's ``pool``).
    admission: Admission | None = None

    # -- the training pool (the whole cluster unless rollout has its own) ---------------------------
    @property
    def train_nnodes(self) -> int:
        return self.pools.train_nnodes if self.pools else self.nnodes

    @property
    def train_gpus_per_node(self) -> int:
        return self.pools.train_gpus_per_node if self.pools else self.n_gpus_per_node

    @property
    def train_gpus(self) -> int:
        return self.train_nnodes * self.train_gpus_per_node

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
        """Per-run files: merged config, job summary, attempts and their metrics, the report."""
        return self.storage_root / "runs" / self.run_key

    @property
    def data_root(self) -> Path:
        return Path(self.storage_paths["data"]) if "data" in self.storage_paths else self.storage_root / "data"

    @property
    def model_cache(self) -> Path:
        return Path(self.storage_paths["models"]) if "models" in self.storage_paths else self.storage_root / "models"

    @property
    def checkpoint_dir(self) -> Path:
        base = self.storage_paths.get("checkpoints")
        return (Path(base) if base else self.storage_root / "checkpoints") / self.run_key

    def metrics_path(self, attempt: int) -> Path:
        """verl's file-logger output of the run's attempt ``attempt`` (one file per attempt)."""
        return RunDir(self.run_dir).metrics_file(attempt)

    @property
    def report_dir(self) -> Path:
        """The run report: ``report.json``, its plots and ``report.html``."""
        return RunDir(self.run_dir).report_dir

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
            "reward_model": str(self.reward_model) if self.reward_model else None,
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
            "trainer_command": list(self.trainer_command),
            "model_facts": asdict(self.model_facts) if self.model_facts else None,
            "hardware": asdict(self.hardware) if self.hardware else None,
            "storage_paths": self.storage_paths,
            "shared_roots": list(self.shared_roots),
            "nccl_debug": self.nccl_debug,
            "placement": self.placement.value,
            "pools": asdict(self.pools) if self.pools else None,
            "watch": self.watch.to_dict(),
            "trackers": self.trackers.to_dict(),
            "on_world_size_change": self.on_world_size_change.value,
            "export_model": self.export_model,
            "admission": self.admission.to_dict() if self.admission else None,
            # The sources exactly (kind, patterns): the strings above are for people and reports.
            "sources": {role: _source_dict(s) for role, s in
                        (("model", self.model), ("critic_model", self.critic_model),
                         ("reward_model", self.reward_model), ("data", self.data)) if s is not None},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        """The spec :meth:`to_dict` wrote (the run's frozen ``run_spec.json``): nothing is read from
        ``configs/`` and nothing is validated again — it was, once, when the run was provisioned."""
        sources = d["sources"]

        def model(role: str) -> ModelSource | None:
            s = sources.get(role)
            return None if s is None else ModelSource(s["kind"], s["ref"], s.get("revision"),
                                                      tuple(s["allow_patterns"]) if s.get("allow_patterns") else None)

        actor = model("model")
        if actor is None:
            raise ConfigError("run_spec.json sources.model", None, "the frozen spec names no model",
                              "start a new run (the spec of this one is damaged)")
        hardware = dict(d["hardware"]) if d.get("hardware") else None
        if hardware is not None:
            hardware["ib_hcas"] = tuple(hardware.get("ib_hcas") or ())
        return cls(
            run_name=d["run_name"], profile=d["profile"], model_profile=d["model_profile"],
            cluster_profile=d["cluster_profile"], model=actor, critic_model=model("critic_model"),
            data=DataSource(sources["data"]["kind"], sources["data"]["ref"]), data_options=dict(d["data_options"]),
            cluster=dict(d["cluster"]), storage_root=Path(d["storage_root"]), runtime=dict(d["runtime"]),
            nnodes=int(d["nnodes"]), n_gpus_per_node=int(d["n_gpus_per_node"]),
            total_training_steps=int(d["total_training_steps"]), mode=Mode(d["mode"]), verl=dict(d["verl"]),
            derived=dict(d["derived"]), trainer_command=tuple(d["trainer_command"]),
            reward_model=model("reward_model"),
            model_facts=scaling.ModelFacts(**d["model_facts"]) if d.get("model_facts") else None,
            hardware=scaling.Hardware(**hardware) if hardware is not None else None,
            storage_paths=dict(d["storage_paths"]), shared_roots=tuple(d["shared_roots"]),
            nccl_debug=bool(d["nccl_debug"]), placement=Placement(d["placement"]),
            pools=scaling.PoolSplit(**d["pools"]) if d.get("pools") else None,
            watch=WatchSettings.from_dict(d["watch"]),
            trackers=TrackerSettings({name: entry["conn_id"] for name, entry in d["trackers"].items()}),
            on_world_size_change=WorldSizeChange(d["on_world_size_change"]), export_model=bool(d["export_model"]),
            admission=Admission(**d["admission"]) if d.get("admission") else None,
        )

    @classmethod
    def load(cls, run_dir: RunDir) -> RunSpec:
        """The run's frozen spec, as provision saved it (``steps.freeze``)."""
        try:
            return cls.from_dict(run_dir.spec_dict())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(str(run_dir.spec_file), type(e).__name__, f"the run's frozen spec cannot be read: {e}",
                              "start a new run") from e


def _source_dict(source: ModelSource | DataSource) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": source.kind, "ref": source.ref}
    if isinstance(source, ModelSource):
        out["revision"] = source.revision
        out["allow_patterns"] = list(source.allow_patterns) if source.allow_patterns else None
    return out


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
    facts = scaling.ModelFacts.from_profile(model_section, model_profile)
    hardware = scaling.Hardware.from_profile(cprof, cluster_profile)

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
    from verl_pipeline.cluster.auth import check_job_env

    check_job_env(dict(runtime.get("env") or {}), f"clusters/{cluster_profile}.runtime.env")
    placement_text = params.get("placement") or prof.get("placement") or Placement.COLOCATED.value
    try:
        placement = Placement(placement_text)
    except ValueError:
        raise ConfigError("placement", placement_text, "unknown placement", "colocated or separate") from None
    layers = [mprof.get("verl") or {}, cprof.get("verl") or {}, prof.get("verl") or {}]
    from verl_pipeline.trainer.owned import check_owned_keys

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
    from verl_pipeline.trainer.overrides import parse_overrides

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
    facts: scaling.ModelFacts,
    hardware: scaling.Hardware,
    *,
    nnodes: int,
    n_gpus_per_node: int,
    overrides: dict[str, Any] | None = None,
    placement: Placement = Placement.COLOCATED,
) -> tuple[dict[str, Any], dict[str, str], scaling.PoolSplit | None]:
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


def check_shape(spec: RunSpec) -> None:
    """The batch/parallelism/memory rules verl enforces only once GPUs are up (or never), for the target shape."""
    s = spec.verl
    g, gpus = spec.train_gpus_per_node, spec.train_gpus  # the GPUs that train (all, unless rollout has a pool)
    tbs = int(s.get("data.train_batch_size", 0) or 0)
    n = int(s.get("actor_rollout_ref.rollout.n", 1) or 1)
    step = scaling.batch_step(g, n)
    if tbs <= 0:
        raise ConfigError("data.train_batch_size", tbs, "must be a positive number of prompts",
                          f"data.train_batch_size={step * spec.train_nnodes}")
    if n < 1:
        raise ConfigError("actor_rollout_ref.rollout.n", n, "must be >= 1", "actor_rollout_ref.rollout.n=1")
    if (tbs * n) % gpus:
        good = _round_up(tbs, max(1, gpus // math.gcd(gpus, n)))
        raise ConfigError(
            "data.train_batch_size", tbs,
            f"train_batch_size x rollout.n ({tbs} x {n}) must be divisible by nnodes x n_gpus_per_node ({gpus})",
            f"data.train_batch_size={good}",
        )
    estimator = str(s.get("algorithm.adv_estimator", "gae"))
    if estimator in ("grpo", "rloo", "grpo_passk") and n < 2:
        raise ConfigError("actor_rollout_ref.rollout.n", n,
                          f"{estimator} normalises rewards within a group of responses per prompt: needs n >= 2",
                          "actor_rollout_ref.rollout.n=5")
    if estimator == "gae" and s.get("critic.enable") is False:
        raise ConfigError("critic.enable", False, "gae advantages need a critic", "critic.enable=true "
                          "(or algorithm.adv_estimator=grpo with rollout.n >= 2)")
    roles = ["actor_rollout_ref.actor"] + (["critic"] if scaling.uses_critic(s) else [])
    for prefix in roles:
        mini_key = f"{prefix}.ppo_mini_batch_size"
        mini = int(s.get(mini_key, s.get("actor_rollout_ref.actor.ppo_mini_batch_size", tbs)) or 0)
        if mini < 1 or mini > tbs:
            raise ConfigError(mini_key, mini, f"must be between 1 and data.train_batch_size ({tbs})",
                              f"{mini_key}={tbs}")
        if (mini * n) % gpus:
            good = _round_up(mini, max(1, gpus // math.gcd(gpus, n)))
            raise ConfigError(mini_key, mini,
                              f"ppo_mini_batch_size x rollout.n ({mini} x {n}) must split evenly over {gpus} GPU(s) "
                              "(verl divides it per GPU when the workers start)",
                              f"{mini_key}={min(good, tbs) if (min(good, tbs) * n) % gpus == 0 else good}")
        per_gpu = mini * n // gpus
        micro_key = f"{prefix}.ppo_micro_batch_size_per_gpu"
        micro = s.get(micro_key)
        if micro is not None and not s.get(f"{prefix}.use_dynamic_bsz"):
            micro = int(micro)
            if micro < 1 or per_gpu % micro:
                good = max(d for d in range(1, min(per_gpu, max(micro, 1)) + 1) if per_gpu % d == 0)
                raise ConfigError(micro_key, micro,
                                  f"must divide the per-GPU mini-batch ({mini} x rollout.n {n} / {gpus} GPU(s) = "
                                  f"{per_gpu} samples)", f"{micro_key}={good}")
    tp_key = "actor_rollout_ref.rollout.tensor_model_parallel_size"
    tp = int(s.get(tp_key, 1) or 1)
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    if tp < 1 or g % tp:
        raise ConfigError(tp_key, tp, f"must divide n_gpus_per_node ({g})", f"one of {divisors}")
    facts, hw = spec.model_facts, spec.hardware
    if facts is not None:
        if facts.num_attention_heads % tp:
            ok = [d for d in divisors if facts.num_attention_heads % d == 0]
            raise ConfigError(tp_key, tp, f"must divide the model's num_attention_heads ({facts.num_attention_heads})",
                              f"one of {ok}")
        util_now = float(s.get("actor_rollout_ref.rollout.gpu_memory_utilization", 0.9) or 0.9)
        limit = scaling.ROLLOUT_WEIGHT_LIMIT * util_now * hw.gpu_memory_gb if hw else 0.0
        if hw is not None and facts.weights_gb / tp > limit:
            best, _why = scaling.rollout_tp(facts, hw, g)
            raise ConfigError(tp_key, tp,
                              f"bf16 weights {facts.weights_gb:.1f} GB / tp {tp} do not fit: vLLM's share of a "
                              f"{hw.gpu_memory_gb:g} GB GPU ({util_now}) must keep half for the KV cache "
                              f"(limit {limit:.1f} GB)", f"{tp_key}={best}" if best else
                              f"n_gpus_per_node >= {scaling.min_gpus_per_node(facts, hw)}")
    util_key = "actor_rollout_ref.rollout.gpu_memory_utilization"
    util = s.get(util_key)
    if util is not None and not 0.1 <= float(util) <= 0.95:
        util_ok = scaling.memory_utilization(hw.gpu_memory_gb)[0] if hw else 0.85
        raise ConfigError(util_key, util, "must be between 0.1 and 0.95 (vLLM needs headroom for CUDA graphs)",
                          f"{util_key}={util_ok}")
    if hw is not None and hw.cpus_per_node is not None and spec.mode is not Mode.PREFLIGHT:
        per_node = scaling.CPUS_PER_GPU_BUNDLE * spec.n_gpus_per_node  # both pools' GPUs hold a bundle
        if hw.cpus_per_node < per_node:
            raise ConfigError(f"clusters/{spec.cluster_profile}.hardware.cpus_per_node", hw.cpus_per_node,
                              f"verl reserves {scaling.CPUS_PER_GPU_BUNDLE} CPUs per GPU: {spec.n_gpus_per_node} "
                              "GPU(s) per node need "
                              f"{per_node}", f"n_gpus_per_node <= {max(1, hw.cpus_per_node // 3)} or more CPUs")
        need, why = scaling.required_cpus(spec.n_gpus, s)
        if hw.cpus_per_node * spec.nnodes < need:
            raise ConfigError(f"clusters/{spec.cluster_profile}.hardware.cpus_per_node", hw.cpus_per_node,
                              f"{spec.nnodes} node(s) give {hw.cpus_per_node * spec.nnodes} CPUs; verl needs {why}",
                              f"cpus_per_node >= {-(-need // spec.nnodes)}")


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


def under_shared(path: str | Path, roots: tuple[str, ...]) -> bool:
    p = Path(path)
    return any(p == Path(r) or Path(r) in p.parents for r in roots)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
