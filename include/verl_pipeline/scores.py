"""What an evaluation measured of each model: ``evaluation.json`` of a run directory.

The evaluation job (:mod:`verl_pipeline.evaluation`) scores the trained model, the base model and the
profile's current champion on the same rows with the run's own reward function, greedy and with the same
settings, and writes one :class:`Evaluation`. The promotion rule (:mod:`verl_pipeline.promotion`) decides
with it, the report shows it, a model registry gets it as metrics.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

from verl_pipeline.exceptions import ConfigError, section_of
from verl_pipeline.rundir import RunDir

#: The run profile's section of how the models are evaluated, and its keys.
SECTION = "evaluation"
#: The held-out rows' setting, as the probe and ``render``'s ``# needs:`` lines name it.
HELD_OUT_KEY = f"{SECTION}.data"
_KEYS = ("enabled", "sample", "max_new_tokens", "data")
#: Rows a smoke evaluation (transformers on CPUs) scores unless the profile says otherwise.
SMOKE_SAMPLE = 16
#: The version of the ``evaluation.json`` layout.
EVALUATION_VERSION = 1
#: How many example responses each model keeps.
EXAMPLES = 3


class Role(str, Enum):
    """Which model an evaluation scored."""

    TRAINED = "trained"
    BASE = "base"
    CHAMPION = "champion"


class Metric(str, Enum):
    """What a promotion rule compares (a :class:`ModelScore` field)."""

    MEAN_REWARD = "mean_reward"
    PASS_RATE = "pass_rate"


class Engine(str, Enum):
    """What generated the responses: vLLM on GPUs, or transformers on CPUs (a smoke evaluation)."""

    VLLM = "vllm"
    TRANSFORMERS = "transformers"


@dataclass(frozen=True)
class EvaluationSettings:
    """The run profile's ``evaluation:`` section::

        evaluation:
          enabled: true        # score the trained, base and champion models after the export
          sample: 16           # rows a smoke evaluation (transformers, no GPU) scores; vLLM scores all
          max_new_tokens: null # null: the run's data.max_response_length
          data: null           # null: the run's validation split; or a held-out parquet in verl's row
                               # schema on storage every node sees, never trained on nor used to pick a model
    """

    enabled: bool = True
    sample: int = SMOKE_SAMPLE
    max_new_tokens: int | None = None
    #: The held-out rows' parquet (absolute); None: the run's validation split.
    data: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> EvaluationSettings:
        return cls(**(data or {}))

    @classmethod
    def from_profile(cls, section: Any, profile: str) -> EvaluationSettings:
        where = f"profiles/{profile}.{SECTION}"
        section = section_of(section, where, _KEYS, what="evaluation setting",
                             example="evaluation: {enabled: true, sample: 16}")
        if section is None:
            return cls()
        enabled = section.get("enabled", True)
        if not isinstance(enabled, bool):
            raise ConfigError(f"{where}.enabled", enabled, "must be true or false",
                              "enabled: true (score the models before promotion) or false")
        counts: dict[str, Any] = {key: _count(section[key], f"{where}.{key}", none=key != "sample")
                                  for key in ("sample", "max_new_tokens") if key in section}
        return cls(enabled=enabled, data=_held_out(section.get("data"), f"{where}.data"), **counts)


def _held_out(value: Any, key: str) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or not value.startswith("/") or not value.endswith(".parquet"):
        raise ConfigError(key, value, "must be the absolute path of a parquet file, or null (the run's validation "
                          "split)", "data: /shared/eval/held-out.parquet (verl's row schema, on storage every node "
                          "sees)")
    return value


def _count(value: Any, key: str, *, none: bool) -> int | None:
    if value is None and none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "must be a whole number of at least 1" + (", or null" if none else ""),
                          f"{key.rsplit('.', 1)[1]}: 16")
    return value


@dataclass(frozen=True)
class Example:
    prompt: str
    response: str
    ground_truth: str
    score: float


@dataclass(frozen=True)
class ModelScore:
    """One model's scores over the evaluation rows: mean reward, the share of rows scoring at least 1
    (``pass_rate``), the mean response length in tokens, the rows scored and a few examples."""

    path: str
    mean_reward: float
    pass_rate: float
    mean_response_length: float
    n: int
    examples: tuple[Example, ...] = ()
    #: The run directory the model came from (the champion's), when it came from one.
    run_dir: str | None = None

    def value(self, metric: Metric) -> float:
        return float(getattr(self, Metric(metric).value))

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["examples"] = [asdict(e) for e in self.examples]
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelScore:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["examples"] = tuple(Example(**e) for e in data.get("examples") or ())
        return cls(**fields)


@dataclass(frozen=True)
class Evaluation:
    """Every model's scores on one set of rows (``data_hash``: the content of the rows scored), with the
    generation settings used (greedy unless the run profile says otherwise)."""

    data_path: str
    data_hash: str
    split: str
    engine: Engine
    sampling: dict[str, Any]
    models: dict[Role, ModelScore]
    wall_s: float = 0.0
    version: int = EVALUATION_VERSION
    #: Rows scored out of the split's rows when the evaluation sampled (a smoke evaluation on CPUs).
    rows_total: int | None = None
    errors: dict[str, str] = field(default_factory=dict)

    @property
    def smoke(self) -> bool:
        """A smoke evaluation: generated with transformers on CPUs, on a sample of the rows."""
        return self.engine is Engine.TRANSFORMERS

    def score(self, role: Role) -> ModelScore | None:
        return self.models.get(role)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "data_path": self.data_path, "data_hash": self.data_hash,
                "split": self.split, "engine": self.engine.value, "smoke": self.smoke, "sampling": dict(self.sampling),
                "rows_total": self.rows_total, "wall_s": self.wall_s, "errors": dict(self.errors),
                "models": {role.value: s.to_dict() for role, s in self.models.items()}}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Evaluation:
        return cls(data_path=data["data_path"], data_hash=data["data_hash"], split=data["split"],
                   engine=Engine(data["engine"]), sampling=dict(data.get("sampling") or {}),
                   models={Role(k): ModelScore.from_dict(v) for k, v in (data.get("models") or {}).items()},
                   wall_s=float(data.get("wall_s") or 0.0), version=int(data.get("version", EVALUATION_VERSION)),
                   rows_total=data.get("rows_total"), errors=dict(data.get("errors") or {}))


#: The key of ``evaluation.json`` when the evaluation failed: the one-line reason, instead of the scores.
FAILED_KEY = "failed"


def read_evaluation(run_dir: RunDir) -> tuple[Evaluation | None, str | None]:
    """The run's evaluation, or None and why there is none (not run, failed, unreadable)."""
    record = run_dir.evaluation()
    if record is None:
        return None, f"no {run_dir.evaluation_file.name}: the evaluation did not run"
    if record.get(FAILED_KEY):
        return None, str(record[FAILED_KEY])
    try:
        return Evaluation.from_dict(record), None
    except (KeyError, TypeError, ValueError) as e:
        return None, f"{run_dir.evaluation_file} is unreadable: {type(e).__name__}: {e}"


__all__ = [
    "EVALUATION_VERSION",
    "EXAMPLES",
    "FAILED_KEY",
    "HELD_OUT_KEY",
    "SECTION",
    "SMOKE_SAMPLE",
    "Engine",
    "Evaluation",
    "EvaluationSettings",
    "Example",
    "Metric",
    "ModelScore",
    "Role",
    "read_evaluation",
]
