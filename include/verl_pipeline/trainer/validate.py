"""Compose verl's own Hydra config from the installed verl package and run verl's own checks.

A validation is done once per run, at most: the provision task validates the run's overrides and
keeps a :class:`ValidationRecord` (the composed config, keyed by the overrides and the verl
installation: :func:`validation_key`) in the run directory and on this machine; a later run of the
same configuration reuses it (:func:`earlier_record`), and the preflight job trusts it for the same key
instead of composing and validating again (:func:`trusted`). Where there is no record for the key,
each of them validates itself.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError

log = logging.getLogger(__name__)


class VerlConfigError(ConfigError):
    """verl rejected the configuration (composition or validation).

    A ConfigError: ``key`` is the verl key the message names (``verl`` when it names none), ``rule``
    verl's own message, ``fix`` what would pass when the pattern is known.
    """


# verl's messages -> (key, fix). The key is taken from the message where verl names it.
_KNOWN: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"real_train_batch_size \((\d+)\) must be divisible by minimal possible batch size \((\d+)\)"),
     "data.train_batch_size", "data.train_batch_size x rollout.n a multiple of the GPU count"),
    (re.compile(r"train_batch_size \((\d+)\) must be >= actor\.ppo_mini_batch_size"),
     "actor_rollout_ref.actor.ppo_mini_batch_size", "a value <= data.train_batch_size"),
    (re.compile(r"\[actor\] You have set both"),
     "actor_rollout_ref.actor.ppo_micro_batch_size", "actor_rollout_ref.actor.ppo_micro_batch_size=null"),
    (re.compile(r"\[critic\] You have set both"),
     "critic.ppo_micro_batch_size", "critic.ppo_micro_batch_size=null"),
    (re.compile(r"Invalid loss_agg_mode: (\S+)"),
     "actor_rollout_ref.actor.loss_agg_mode", "actor_rollout_ref.actor.loss_agg_mode=token-mean"),
    (re.compile(r"validation gen temperature should be greater than 0"),
     "actor_rollout_ref.rollout.temperature", "actor_rollout_ref.rollout.temperature=1.0"),
    (re.compile(r"Could not override '([\w.]+)'"), "", "a key that exists in verl's ppo_trainer.yaml"),
    (re.compile(r"Key '(\w+)' is not in struct.*full_key: ([\w.]+)", re.S), "", "a key that exists in verl's config"),
)


def _explain(message: str) -> tuple[str, str | None]:
    for pattern, key, fix in _KNOWN:
        m = pattern.search(message)
        if m:
            if not key:
                key = m.group(m.lastindex or 1)
            return key, fix
    m = re.search(r"'((?:actor_rollout_ref|critic|data|trainer|algorithm)\.[\w.]+)'", message)
    return (m.group(1), None) if m else ("verl", None)


def _reject(stage: str, message: str, overrides: Sequence[str]) -> VerlConfigError:
    message = " ".join(message.split())
    key, fix = _explain(message)
    value: Any = None
    for o in overrides:
        k, _, v = o.partition("=")
        if k.lstrip("+") == key:
            value = v
    return VerlConfigError(key, value, f"verl {stage}: {message}",
                           fix or "a value verl accepts for the key its message names (see verl's ppo_trainer.yaml)")


@dataclass(frozen=True)
class Validated:
    config: Any  # omegaconf.DictConfig
    use_critic: bool
    use_reference_policy: bool
    n_gpus: int
    seconds: float
    #: verl's checks that could not run here, each with who runs them instead (:func:`_needs_vllm_here`).
    unchecked: tuple[str, ...] = ()


def _vllm_lora_rank(cfg: Any) -> int:
    """The LoRA rank verl's ``validate_config`` checks against vLLM's supported ranks (0: it checks none):
    ``actor_rollout_ref.model.lora.rank``, else ``lora_rank``, unless the adapter is merged, for a vLLM rollout."""
    model = cfg.actor_rollout_ref.model
    lora = model.get("lora", {}) or {}
    rank = int(lora.get("rank", 0) or 0)
    if rank <= 0:
        rank = int(model.get("lora_rank", 0) or 0)
    if lora.get("merge", False) or cfg.actor_rollout_ref.rollout.name != "vllm":
        return 0
    return max(rank, 0)


def _needs_vllm_here(cfg: Any) -> tuple[Any, tuple[str, ...]]:
    """The config verl's checks run on here, and what they leave unchecked.

    verl 0.9.1's ``validate_config`` ends by checking a LoRA run's rank against the ranks vLLM serves
    (``get_vllm_max_lora_rank``), which imports vLLM; the Airflow side does not install it. Without vLLM here
    that one check runs on a copy without the rank (every other check is the same: it is the last one and the
    only one reading the rank); the training job's own ``validate_config`` runs it on the cluster, and the
    preflight job does not trust a record that left it out."""
    import importlib.util

    rank = _vllm_lora_rank(cfg)
    if rank == 0 or importlib.util.find_spec("vllm") is not None:
        return cfg, ()
    import copy

    from omegaconf import open_dict

    checked = copy.deepcopy(cfg)
    with open_dict(checked):
        checked.actor_rollout_ref.model.lora_rank = 0
        if checked.actor_rollout_ref.model.get("lora") is not None:
            checked.actor_rollout_ref.model.lora.rank = 0
    return checked, (f"actor_rollout_ref.model.lora_rank={rank} against the LoRA ranks vLLM serves: verl's check "
                     "imports vLLM, which is not installed here; verl's validate_config checks it on the cluster's "
                     "nodes when the job starts",)


def verl_config_dir() -> Path:
    import verl

    return Path(verl.__file__).parent / "trainer" / "config"


_LOCK = threading.Lock()


@contextlib.contextmanager
def _hydra() -> Iterator[None]:
    """Hydra initialised on verl's config directory; reused when the caller already holds it."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        yield
        return
    with initialize_config_dir(config_dir=str(verl_config_dir()), version_base=None):
        yield


@contextlib.contextmanager
def session() -> Iterator[None]:
    """Keep Hydra initialised for many ``compose``/``validate`` calls (the matrix test, ``render``)."""
    with _LOCK, _hydra():
        yield


def compose(overrides: Sequence[str], config_name: str = "ppo_trainer") -> Any:
    """verl's ``ppo_trainer.yaml`` with ``overrides`` applied, exactly as ``main_ppo`` composes it.

    An override of a key verl's config does not have fails naming the closest keys that exist."""
    from hydra import compose as hydra_compose
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        with _hydra():
            return hydra_compose(config_name=config_name, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException) as e:
        error = _reject("could not compose the configuration", str(e), overrides)
    if re.search(r"Could not override '|is not in struct", error.rule) and error.key != "verl":
        with _hydra():
            known = config_keys(hydra_compose(config_name=config_name, overrides=[]))
        close = closest_keys(error.key, known)
        if close:
            error = VerlConfigError(error.key, error.value, error.rule,
                                    f"verl {_verl_version()} has {' or '.join(close)}; a key its YAML does not list "
                                    f"is appended with +{error.key}=...")
    raise error


def _verl_version() -> str:
    from importlib.metadata import version

    return version("verl")


def config_keys(cfg: Any) -> list[str]:
    """Every leaf key of a composed config, dotted (interpolations are not resolved)."""
    from omegaconf import OmegaConf

    def walk(node: Any, prefix: str) -> Iterator[str]:
        if OmegaConf.is_dict(node):
            for k in node.keys():
                yield from walk(node._get_node(k), f"{prefix}.{k}" if prefix else str(k))
        else:
            yield prefix

    return list(walk(cfg, ""))


def closest_keys(key: str, known: Sequence[str], limit: int = 2) -> list[str]:
    """The keys of ``known`` a mistyped or outdated ``key`` most likely meant: same leaf name first
    (a key moved between versions keeps its name), then the same top-level section, then similarity."""
    import difflib

    key = key.lstrip("+")
    leaf, root = key.rsplit(".", 1)[-1], key.split(".", 1)[0]

    def score(candidate: str) -> tuple[bool, bool, float]:
        return (candidate.rsplit(".", 1)[-1] == leaf, candidate.split(".", 1)[0] == root,
                difflib.SequenceMatcher(None, key, candidate).ratio())

    ranked = sorted(known, key=score, reverse=True)
    if not ranked:
        return []
    best = score(ranked[0])[:2]
    return [k for k in ranked[:limit] if score(k)[:2] == best and (best[0] or score(k)[2] >= 0.6)]


def validate(overrides: Sequence[str]) -> Validated:
    """Compose, then run verl's ``validate_config`` (actor and critic dataclass checks included) and
    build verl's rollout dataclass (its ``__post_init__`` checks parallelism and engine settings).

    Validates for the shape in the overrides (``trainer.nnodes`` x ``trainer.n_gpus_per_node``),
    not for the machine this runs on.
    """
    t0 = time.monotonic()
    cfg = compose(overrides)
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    try:
        # verl warns that GRPO disables the critic and prints progress: expected, and not for our log.
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore", UserWarning)
            use_critic = bool(need_critic(cfg))
            use_ref = bool(need_reference_policy(cfg))
            checked, unchecked = _needs_vllm_here(cfg)
            validate_config(checked, use_reference_policy=use_ref, use_critic=use_critic)
            omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    except (AssertionError, ValueError, TypeError, KeyError, RuntimeError, HydraException,
            OmegaConfBaseException) as e:
        raise _reject("rejected the configuration", str(e), overrides) from None
    n_gpus = int(cfg.trainer.nnodes) * int(cfg.trainer.n_gpus_per_node)
    return Validated(cfg, use_critic, use_ref, n_gpus, round(time.monotonic() - t0, 2), unchecked)


#: The overrides whose values verl's validation never reads, and that differ between the runs of one
#: configuration or between a run's provision and its job: the run's names (its experiment and
#: checkpoint directory), and what the pipeline fills in after provision from the data it prepared
#: (where the parquet files are, whether preprocessing already dropped the overlong prompts, the steps
#: and epochs counted against its training rows: ``trainer/length.py``). verl's
#: composition takes them as given values; ``validate_config``, the actor/critic checks and the
#: rollout dataclass look at batch sizes, parallelism, model and engine settings (a test keeps that
#: true for the installed verl). A validation of the other overrides holds for any values of these.
UNVALIDATED_KEYS = ("trainer.experiment_name", "trainer.default_local_dir", "data.train_files", "data.val_files",
                    "data.filter_overlong_prompts", "trainer.total_training_steps", "trainer.total_epochs")
#: Where this machine keeps the validations verl passed, one file per :func:`validation_key`, under
#: the pipeline's home: a run of a configuration validated before reuses its record.
RECORDS_DIR = "verl-validations"
#: An override's key: what stands before its first ``=`` (after Hydra's ``+``, ``++`` or ``~``).
_KEY = re.compile(r"^[+~]*([^=]+)=")


def override_key(override: str) -> str:
    """The dotted key an override sets (``+a.b=1`` → ``a.b``)."""
    m = _KEY.match(override)
    return m.group(1) if m else override


def _distribution_versions() -> dict[str, str]:
    """The installed version of verl and of every distribution its validation may run code of: verl's
    own requirements, torch, and the Hydra/OmegaConf pair that composes the config."""
    from importlib.metadata import PackageNotFoundError, requires, version

    names = {"verl", "torch", "hydra-core", "omegaconf"}
    for req in requires("verl") or []:
        if "extra ==" not in req:
            names.add(re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0])
    found = {}
    for name in sorted(names):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "absent"
    return found


def _files_digest(root: Path) -> str:
    """A digest of every file under ``root`` (names and contents; compiled caches left out)."""
    h = hashlib.blake2b(digest_size=16)
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            path = Path(folder) / name
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(hashlib.blake2b(path.read_bytes(), digest_size=16).digest())
    return h.hexdigest()


def validation_key(overrides: Sequence[str]) -> str:
    """What a validation of ``overrides`` depends on, as one digest: the overrides (but the
    :data:`UNVALIDATED_KEYS` ones), verl's installed files, the versions of the distributions
    its checks run, and this module (what "validated" means here)."""
    import importlib.util

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise VerlConfigError("verl", None, "verl is not installed in this environment", "pip install verl")
    facts = {
        "overrides": [o for o in overrides if override_key(o) not in UNVALIDATED_KEYS],
        "verl_files": _files_digest(Path(next(iter(spec.submodule_search_locations)))),
        "distributions": _distribution_versions(),
        "validator": hashlib.blake2b(Path(__file__).read_bytes(), digest_size=16).hexdigest(),
    }
    return hashlib.blake2b(json.dumps(facts, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass(frozen=True)
class ValidationRecord:
    """A validation verl passed: for which overrides (:func:`validation_key`), what verl concluded, and
    the config it composed (YAML, interpolations kept) for whoever trusts it instead of composing."""

    key: str
    verl_version: str
    overrides: list[str]
    n_gpus: int
    use_critic: bool
    use_reference_policy: bool
    #: How long composing and validating took.
    seconds: float
    validated_at: float
    config_yaml: str
    #: verl's checks that did not run where this validation ran, and who runs them (:attr:`Validated.unchecked`).
    unchecked: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["unchecked"] = list(self.unchecked)
        return out

    @classmethod
    def of(cls, v: Validated, overrides: Sequence[str], key: str) -> ValidationRecord:
        from omegaconf import OmegaConf

        return cls(key=key, verl_version=_verl_version(), overrides=list(overrides), n_gpus=v.n_gpus,
                   use_critic=v.use_critic, use_reference_policy=v.use_reference_policy, seconds=v.seconds,
                   validated_at=round(time.time(), 3), config_yaml=OmegaConf.to_yaml(v.config),
                   unchecked=tuple(v.unchecked))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationRecord:
        values = {k: data[k] for k in cls.__dataclass_fields__ if k != "unchecked"}
        return cls(**values, unchecked=tuple(data.get("unchecked") or ()))


def _record_path(key: str) -> Path:
    from verl_pipeline.paths import pipeline_home

    return pipeline_home() / RECORDS_DIR / f"{key}.json"


def earlier_record(key: str) -> tuple[ValidationRecord | None, Path]:
    """The validation this machine recorded for ``key`` (None when it has none) and where it is kept."""
    path = _record_path(key)
    try:
        data = json.loads(path.read_text())
        record = ValidationRecord.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None, path
    return (record if record.key == key else None), path


def keep(record: ValidationRecord) -> Path:
    """Keep ``record`` on this machine for later runs of the same configuration; returns where."""
    from verl_pipeline.paths import write_json_atomic

    path = _record_path(record.key)
    write_json_atomic(path, record.to_dict())
    return path


def trusted(record: Mapping[str, Any] | None, overrides: Sequence[str]) -> tuple[Validated | None, str]:
    """The validation ``record`` stands for when it was made for ``overrides`` (same
    :func:`validation_key`): verl's conclusions and the config it composed, with the
    :data:`UNVALIDATED_KEYS` overrides of ``overrides`` applied. Else None; the string says why."""
    if not record:
        return None, "no validation was recorded for this run"
    key = validation_key(overrides)
    if record.get("key") != key:
        return None, (f"the recorded validation (key {record.get('key')}) was made for other overrides or another "
                      f"verl installation than this job's (key {key})")
    if record.get("unchecked"):
        return None, f"the recorded validation left unchecked: {'; '.join(record['unchecked'])}"
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    filled = [o for o in overrides if override_key(o) in UNVALIDATED_KEYS]
    try:
        cfg = OmegaConf.create(record["config_yaml"])
        for parsed in OverridesParser.create().parse_overrides(filled):
            OmegaConf.update(cfg, parsed.key_or_group, parsed.value(), merge=True)
    except (HydraException, OmegaConfBaseException, KeyError) as e:
        return None, f"the recorded config could not take this job's {', '.join(filled)}: {e}"
    OmegaConf.set_struct(cfg, True)  # as Hydra hands it over: a key verl's YAML lacks is an error
    return Validated(cfg, bool(record["use_critic"]), bool(record["use_reference_policy"]), int(record["n_gpus"]),
                     0.0), f"verl {record['verl_version']} validated these overrides at provision"
