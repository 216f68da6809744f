"""The run's spec: what a run is, once resolved — its sources, shape, cluster, storage and settings.

The types only (``profiles.build_run_spec`` builds one from ``configs/`` and the params, once, at
provision; ``RunSpec.load`` reads the frozen one back). Each type validates what it reads and raises
:class:`~verl_pipeline.exceptions.ConfigError` naming the key, the value and the fix.
"""

from __future__ import annotations

import re
import types
import typing
from dataclasses import MISSING, asdict, dataclass, field, fields, is_dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline.admission import Admission
from verl_pipeline.constants import BUILTIN_DATA, DEFAULT_TRAINER_COMMAND, Mode, Placement, SetBy, WorldSizeChange
from verl_pipeline.durations import duration_setting, format_duration
from verl_pipeline.exceptions import ConfigError, section_of
from verl_pipeline.paths import fsspec_filesystem, short_hash, slug
from verl_pipeline.promotion import PromotionRule
from verl_pipeline.restarts import RestartPolicy
from verl_pipeline.rundir import RunDir
from verl_pipeline.scores import EvaluationSettings
from verl_pipeline.trackers import TrackerSettings

_HF_SOURCE = re.compile(r"^hf://(?P<repo>[A-Za-z0-9][\w.\-]*/[\w.\-]+)(@(?P<rev>[\w.\-/]+))?$")

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

    ``builtin:<name>`` (a generated set of ``constants.BUILTIN_DATA``); an absolute local file, glob
    or directory (train.* + test.*/val.*) of JSONL/JSON/CSV/Parquet (``files``), or a directory saved
    by ``datasets`` ``save_to_disk`` (``hf_disk``); an fsspec URL such as ``s3://bucket/data/*.parquet``
    (``url``); or a HuggingFace dataset ``hf://name?config=main&revision=…&split=…`` (``hf``).
    """

    kind: str
    ref: str

    @classmethod
    def parse(cls, text: str, *, key: str = "data_source") -> DataSource:
        import glob

        text = str(text).strip()
        if text.startswith("builtin:"):
            if text.removeprefix("builtin:") not in BUILTIN_DATA:
                raise ConfigError(key, text, "unknown built-in data source",
                                  " or ".join(f"builtin:{name}" for name in BUILTIN_DATA))
            return cls("builtin", text.removeprefix("builtin:"))
        if text.startswith("hf://"):
            if not re.fullmatch(r"hf://[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?(\?[\w.\-=&/]*)?", text):
                raise ConfigError(key, text, "is not a dataset reference",
                                  "hf://openai/gsm8k?config=main&revision=<commit>")
            return cls("hf", text)
        if re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*://", text):
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
        return f"builtin:{self.ref}" if self.kind == "builtin" else self.ref


#: Bytes per parameter of the rollout engine's weights (bf16).
ROLLOUT_BYTES_PER_PARAM = 2


@dataclass(frozen=True)
class ModelFacts:
    """What the scaling rules need to know about a model: its profile's facts, checked against and completed from
    its own ``config.json`` where that is on this machine (``trainer/modelfacts.py``); weights are not read."""

    params_b: float
    hidden_size: int
    num_layers: int
    num_attention_heads: int

    #: True when params_b was estimated from the shape rather than given.
    estimated: bool = False
    #: The vocabulary (config.json's ``vocab_size``): the logits' width, which sizes the dynamic-batch token
    #: budgets (``trainer/nodes/fastpath.py``); None when the profile does not give it.
    vocab_size: int | None = None
    #: config.json's ``num_key_value_heads`` (grouped-query attention): the KV cache's size per token, which
    #: sizes vLLM's ``max_num_seqs`` (``trainer/scaling.py``); None: as many as the attention heads.
    num_key_value_heads: int | None = None
    #: config.json's ``intermediate_size`` (the MLP's width): sizes a LoRA adapter (``trainer/lora.py``); None:
    #: 4 x hidden_size assumed.
    intermediate_size: int | None = None
    #: The model's own ``config.json`` the facts were checked against and completed from
    #: (``trainer/modelfacts.py``); None: the profile's facts alone (the model was not on this machine).
    config_file: str | None = None

    @classmethod
    def from_profile(cls, section: dict[str, Any], profile: str) -> ModelFacts:
        """Read the size facts; ``params_b`` may be left out and is then estimated from the shape, and
        ``vocab_size``, ``num_key_value_heads`` and ``intermediate_size`` may be left out (the rules then say
        what they assume)."""
        values: dict[str, Any] = {}
        for name, kind, example in (("hidden_size", int, "3584"), ("num_layers", int, "28"),
                                    ("num_attention_heads", int, "28"), ("params_b", float, "7.6"),
                                    ("vocab_size", int, "152064"), ("num_key_value_heads", int, "4"),
                                    ("intermediate_size", int, "18944")):
            raw = section.get(name)
            key = f"models/{profile}.model.{name}"
            if raw is None:
                if name in ("params_b", "vocab_size", "num_key_value_heads", "intermediate_size"):
                    continue
                raise ConfigError(key, None, "is required: the scaling rules size parallelism and offload from it "
                                  "(a model on this machine gives it in its config.json)", f"{name}: {example}")
            try:
                value = kind(raw)
            except (TypeError, ValueError):
                raise ConfigError(key, raw, f"must be a number ({kind.__name__})", f"{name}: {example}") from None
            if value <= 0:
                raise ConfigError(key, raw, "must be positive", f"{name}: {example}")
            values[name] = value
        if "params_b" not in values:
            values["params_b"] = estimate_params_b(values["hidden_size"], values["num_layers"])
            values["estimated"] = True
        return cls(**values)

    @property
    def weights_gb(self) -> float:
        return self.params_b * ROLLOUT_BYTES_PER_PARAM


def estimate_params_b(hidden_size: int, num_layers: int) -> float:
    """Transformer blocks only: 12 x layers x hidden^2 (attention 4h^2 + a 4h MLP 8h^2), in billions.

    A lower bound (no embeddings, wider MLPs count more): profiles should give ``params_b``.
    """
    return 12 * num_layers * hidden_size**2 / 1e9


@dataclass(frozen=True)
class Hardware:
    """A cluster profile's ``hardware`` and ``network`` sections."""

    gpu_memory_gb: float
    cpus_per_node: int | None
    infiniband: bool = False
    ib_hcas: tuple[str, ...] = ()
    nccl_proto: str | None = None

    @classmethod
    def from_profile(cls, cprof: dict[str, Any], profile: str) -> Hardware:
        hw = dict(cprof.get("hardware") or {})
        net = dict(cprof.get("network") or {})
        mem = hw.get("gpu_memory_gb")
        if mem is None or isinstance(mem, bool) or not isinstance(mem, int | float) or mem <= 0:
            raise ConfigError(f"clusters/{profile}.hardware.gpu_memory_gb", mem,
                              "is required and must be a positive number (GB per GPU)", "gpu_memory_gb: 80")
        cpus = hw.get("cpus_per_node")
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1):
            raise ConfigError(f"clusters/{profile}.hardware.cpus_per_node", cpus, "must be a positive integer",
                              "cpus_per_node: 96")
        ib = bool(net.get("infiniband", False))
        hcas = tuple(str(h) for h in (net.get("ib_hcas") or []))
        if ib and not hcas:
            raise ConfigError(f"clusters/{profile}.network.ib_hcas", [], "InfiniBand needs the HCAs NCCL may use",
                              "ib_hcas: [mlx5_0, mlx5_1]")
        return cls(float(mem), cpus, ib, hcas, net.get("nccl_proto"))


@dataclass(frozen=True)
class PoolSplit:
    """``placement: separate``: the cluster's GPUs split into a training pool and a rollout pool."""

    train_nnodes: int
    train_gpus_per_node: int
    rollout_nnodes: int
    rollout_gpus_per_node: int
    reason: str

    @property
    def train_gpus(self) -> int:
        return self.train_nnodes * self.train_gpus_per_node


#: The run profile's section (``watch:``) and its keys.
SECTION = "watch"
_KEYS = ("stall_timeout", "startup_timeout", "min_stall_timeout", "stall_factor")


@dataclass(frozen=True)
class WatchSettings:
    #: Seconds without a new step after which a job is hung; None: derived from step times.
    stall_timeout_s: float | None = None
    startup_timeout_s: float = 2 * 3600.0
    min_stall_timeout_s: float = 30 * 60.0
    stall_factor: float = 5.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> WatchSettings:
        return cls(**(data or {}))

    @classmethod
    def from_profile(cls, section: Any, profile: str) -> WatchSettings:
        """Settings from a run profile's ``watch:`` section (durations as strings, the factor a number)."""
        where = f"profiles/{profile}.{SECTION}"
        section = section_of(section, where, _KEYS, what="watch setting", example="watch: {stall_timeout: 45m}")
        if section is None:
            return cls()
        out: dict[str, Any] = {}
        for key in ("stall_timeout", "startup_timeout", "min_stall_timeout"):
            value = section.get(key)
            if value is None or (key == "stall_timeout" and value == "auto"):
                continue
            out[f"{key}_s"] = duration_setting(f"{where}.{key}", value, positive=True,
                                               also=" or auto" if key == "stall_timeout" else "")
        factor = section.get("stall_factor")
        if factor is not None:
            if isinstance(factor, bool) or not isinstance(factor, int | float) or factor < 1:
                raise ConfigError(f"{where}.stall_factor", factor, "must be a number of at least 1",
                                  "stall_factor: 5")
            out["stall_factor"] = float(factor)
        return cls(**out)

    def stall_limit(self, slowest_step_s: float | None) -> float:
        """Seconds without a new step that count as a hang, given the slowest step seen."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return max(self.min_stall_timeout_s, self.stall_factor * (slowest_step_s or 0.0))

    def describe(self) -> str:
        stall = (format_duration(self.stall_timeout_s) if self.stall_timeout_s is not None
                 else f"max({format_duration(self.min_stall_timeout_s)}, {self.stall_factor:g} x the slowest step)")
        return f"no step for {stall}, or none within {format_duration(self.startup_timeout_s)} of the start"


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
    #: Who set ``total_training_steps``, and who set ``trainer.total_epochs`` (in ``verl``; None: nobody): which
    #: of the two wins, once the training rows are known (``trainer/length.py``).
    steps_set_by: SetBy = SetBy.PROFILE
    epochs_set_by: SetBy | None = None
    verl: dict[str, Any] = field(default_factory=dict)
    #: derived (or explicitly kept) verl key -> the rule behind its value
    derived: dict[str, str] = field(default_factory=dict)
    trainer_command: tuple[str, ...] = DEFAULT_TRAINER_COMMAND
    reward_model: ModelSource | None = None
    model_facts: ModelFacts | None = None
    hardware: Hardware | None = None
    #: Explicit storage locations from the cluster profile (data, models, checkpoints).
    storage_paths: dict[str, str] = field(default_factory=dict)
    #: Mount points every Ray node and the Airflow workers see at the same path.
    shared_roots: tuple[str, ...] = ()
    nccl_debug: bool = False
    placement: Placement = Placement.COLOCATED
    #: ``placement: separate``: how the cluster's GPUs are split between training and rollout.
    pools: PoolSplit | None = None
    #: The hang watchdog of the wait step (the run profile's ``watch:`` section).
    watch: WatchSettings = field(default_factory=WatchSettings)
    #: What the run affords in restarts after infrastructure failures (the run profile's ``restarts:``).
    restarts: RestartPolicy = field(default_factory=RestartPolicy)
    #: How the trained, base and champion models are scored after the export (the run profile's ``evaluation:``).
    evaluation: EvaluationSettings = field(default_factory=EvaluationSettings)
    #: When a retraining run becomes the profile's champion (the run profile's ``promotion:``).
    promotion: PromotionRule = field(default_factory=PromotionRule)
    #: The Airflow connection of each tracker in ``trainer.logger`` (the run profile's ``trackers:`` section).
    trackers: TrackerSettings = field(default_factory=TrackerSettings)
    #: What a retry does on a cluster of another world size (the run profile's ``on_world_size_change``).
    on_world_size_change: WorldSizeChange = WorldSizeChange.FAIL
    #: Merge and publish the trained model after a successful training run (the run profile's ``export``).
    export_model: bool = True
    #: A shared cluster's Airflow pool and the slots this run takes (the cluster profile's ``pool``).
    admission: Admission | None = None
    #: More files shipped with the job beside those its verl settings name (the run profile's ``job_files``:
    #: a tool's module, say), absolute (``trainer/jobfiles.py``).
    job_files: tuple[str, ...] = ()
    #: Validate before training on a resume attempt too (the run profile's ``validate_on_resume``); by
    #: default only the attempt that starts at step 0 does (``trainer/nodes/warmstart.py``).
    validate_on_resume: bool = False

    def model_sources(self) -> dict[str, ModelSource]:
        """The run's models by role (``actor`` always; ``critic``/``reward`` when the model profile sets them)."""
        out = {"actor": self.model}
        if self.critic_model is not None:
            out["critic"] = self.critic_model
        if self.reward_model is not None:
            out["reward"] = self.reward_model
        return out

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
    def cache_root(self) -> Path:
        """The workers' compile, autotune and kernel caches, one folder per versions-and-GPU key
        (``trainer/nodes/warmstart.py``), shared by every run on this storage."""
        return Path(self.storage_paths["caches"]) if "caches" in self.storage_paths else self.storage_root / "caches"

    @property
    def warm_caches(self) -> bool:
        """Whether the workers keep their caches in :attr:`cache_root` (cluster profile: ``runtime.warm_caches``)."""
        return bool(self.runtime.get("warm_caches", True))

    @property
    def cluster_facts_file(self) -> Path:
        """What the latest probe found on this cluster profile's GPU nodes (any run's), for ``render``."""
        return self.storage_root / "clusters" / f"{self.cluster_profile}.json"

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
        """The spec as ``run_spec.json`` holds it: every field (sources as text, for people and reports), and
        under ``sources`` each source exactly (kind, revision, patterns), which :meth:`from_dict` reads."""
        out = {f.name: _encode(getattr(self, f.name)) for f in fields(self)}
        out[_SOURCES] = {f.name: _source_dict(value) for f in fields(self)
                         if isinstance(value := getattr(self, f.name), ModelSource | DataSource)}
        return out

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunSpec:
        """The spec :meth:`to_dict` wrote (the run's frozen ``run_spec.json``): nothing is read from
        ``configs/`` and nothing is validated again — it was, once, when the run was provisioned.

        Read field by field from the dataclass: a field a file of an earlier release lacks takes its
        default (a field without one fails: KeyError)."""
        hints = _hints(cls)
        values: dict[str, Any] = {}
        for f in fields(cls):
            tp = hints[f.name]
            data = d[_SOURCES] if _is_source(tp) else d
            if f.name in data:
                values[f.name] = _decode(tp, data[f.name])
            elif data is not d and _optional(tp) is not None:
                values[f.name] = None  # ``sources`` lists only the sources a run has
            elif f.default is MISSING and f.default_factory is MISSING:
                raise KeyError(f.name)
        return cls(**values)

    @classmethod
    def load(cls, run_dir: RunDir) -> RunSpec:
        """The run's frozen spec, as provision saved it (``steps.freeze``)."""
        try:
            return cls.from_dict(run_dir.spec_dict())
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(str(run_dir.spec_file), type(e).__name__, f"the run's frozen spec cannot be read: {e}",
                              "start a new run") from e


#: ``run_spec.json``'s section with every source exactly (the fields themselves hold their text).
_SOURCES = "sources"


def _hints(cls: Any) -> dict[str, Any]:
    """A dataclass's field annotations, resolved (the module writes them as text)."""
    return typing.get_type_hints(cls)


def _optional(tp: Any) -> Any:
    """``X`` of ``X | None``; else None."""
    args = typing.get_args(tp) if typing.get_origin(tp) in (typing.Union, types.UnionType) else ()
    rest = [a for a in args if a is not type(None)]
    return rest[0] if len(rest) == 1 and len(args) == 2 else None


def _is_source(tp: Any) -> bool:
    return (_optional(tp) or tp) in (ModelSource, DataSource)


def _encode(value: Any) -> Any:
    """A field's value as JSON: sources and enums as their text, paths as strings, tuples as lists,
    a dataclass by its own ``to_dict`` or field by field."""
    if isinstance(value, ModelSource | DataSource):
        return str(value)
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, tuple | list):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        return {k: _encode(v) for k, v in value.items()}
    if is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        return to_dict() if to_dict else {f.name: _encode(getattr(value, f.name)) for f in fields(value)}
    return value


def _decode(tp: Any, raw: Any) -> Any:
    """What :func:`_encode` wrote, read back as type ``tp`` (a field's annotation)."""
    inner = _optional(tp)
    if inner is not None:
        return None if raw is None else _decode(inner, raw)
    if tp is ModelSource:
        patterns = raw.get("allow_patterns")
        return ModelSource(raw["kind"], raw["ref"], raw.get("revision"), tuple(patterns) if patterns else None)
    if tp is DataSource:
        return DataSource(raw["kind"], raw["ref"])
    origin = typing.get_origin(tp)
    if origin is tuple:
        return tuple(_decode(typing.get_args(tp)[0], v) for v in raw)
    if origin is dict or tp is Any:
        return raw if tp is Any else dict(raw)
    if isinstance(tp, type) and is_dataclass(tp):
        from_dict = getattr(tp, "from_dict", None)
        if from_dict is not None:
            return from_dict(raw)
        hints = _hints(tp)
        return tp(**{f.name: _decode(hints[f.name], raw[f.name]) for f in fields(tp) if f.name in raw})
    return tp(raw)  # an Enum, Path, str, int, float or bool


def _source_dict(source: ModelSource | DataSource) -> dict[str, Any]:
    out: dict[str, Any] = {"kind": source.kind, "ref": source.ref}
    if isinstance(source, ModelSource):
        out["revision"] = source.revision
        out["allow_patterns"] = list(source.allow_patterns) if source.allow_patterns else None
    return out


def under_shared(path: str | Path, roots: tuple[str, ...]) -> bool:
    p = Path(path)
    return any(p == Path(r) or Path(r) in p.parents for r in roots)


def require_shared(key: str, path: str | Path, roots: tuple[str, ...], why: str) -> None:
    """A one-line ConfigError naming ``key`` when ``path`` is not under one of the shared mounts ``roots``
    (``why``: what would go wrong on the other nodes)."""
    if not under_shared(path, roots):
        raise ConfigError(key, str(path), f"is not under a shared mount {list(roots)}: {why}",
                          f"a path under {roots[0] if roots else 'the cluster storage'}")
