"""What the evaluation job is asked to do: which models, which rows, which reward function, how to generate.

An :class:`EvaluationRequest` travels as JSON on the job's command line
(``python -m verl_pipeline.evaluation.job --request JSON``)::

    {"models": {"trained": "/runs/r1/model", "base": "/models/builtin/tiny-qwen2-v2"},
     "data_path": "/data/generic-v2-1a2b/val.parquet",
     "reward": {"path": "reward.py", "name": "compute_score", "kwargs": {}},
     "max_new_tokens": 8, "sample": 16, "seed": 0, "engine": null, "use_gpus": false,
     "split": "val", "run_dirs": {"champion": "/runs/r0"}, "gpu_memory_utilization": 0.5}

``reward`` null is verl's ``default_compute_score``; a relative reward path is read from the job's
working directory (the run's ``runtime_env`` working_dir, where its reward file was shipped). ``engine``
null is vLLM on a node with a GPU and vLLM, else transformers; ``sample`` is how many rows (the first
ones) a transformers evaluation scores. ``use_gpus`` asks Ray for a GPU for the job.
``gpu_memory_utilization`` is the share of the GPU's memory vLLM's engine takes (null: vLLM's default);
the run's plan passes the share its rollout had, which is what the run's profile found fits beside the
rest of the cluster's work.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.scores import Engine, Role
from verl_pipeline.trainer.reward import DEFAULT_NAME, RewardFunction

#: Rows a transformers (CPU) evaluation scores: the first ones of the split.
DEFAULT_SAMPLE = 16
#: verl's default ``data.max_response_length``: new tokens per response when the run names none.
DEFAULT_MAX_NEW_TOKENS = 512
#: The split an evaluation scores: the run's validation rows (``data.val_files``).
DEFAULT_SPLIT = "val"
_ROLES = [r.value for r in Role]
_ENGINES = "vllm, transformers or null (vLLM where the node has a GPU and vLLM, else transformers)"


def _positive(key: str, value: Any, example: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(key, value, "must be a whole number of at least 1", example)
    return value


def _text(key: str, value: Any, example: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(key, value, "must be a non-empty path", example)
    return value


def _roles(key: str, value: Any, example: str) -> dict[Role, str]:
    if not isinstance(value, Mapping):
        raise ConfigError(key, value, "must be a mapping of role to path", example)
    out = {}
    for role, path in value.items():
        try:
            out[Role(role)] = _text(f"{key}.{Role(role).value}", path, example)
        except ValueError:
            raise ConfigError(f"{key}.{role}", path, "is not a role of an evaluation", f"one of {_ROLES}") from None
    return out


def _engine(value: Any) -> Engine | None:
    try:
        return None if value is None else Engine(value)
    except ValueError:
        raise ConfigError("engine", value, "is not an evaluation engine", _ENGINES) from None


def _reward(value: Any) -> RewardFunction | None:
    if value is None or isinstance(value, RewardFunction):
        return value
    if not isinstance(value, Mapping) or not isinstance(value.get("kwargs", {}), Mapping):
        raise ConfigError("reward", value, "must be {path, name, kwargs} or null (verl's default_compute_score)",
                          "{'path': 'reward.py', 'name': 'compute_score', 'kwargs': {}}")
    path = _text("reward.path", value.get("path"), "reward.py (in the job's working_dir) or /abs/reward.py")
    return RewardFunction(path, str(value.get("name") or DEFAULT_NAME), dict(value.get("kwargs") or {}))


@dataclass(frozen=True)
class EvaluationRequest:
    """The evaluation job's request (see the module doc for its JSON). Checked when built: a bad field is
    one :class:`~verl_pipeline.exceptions.ConfigError` naming it."""

    #: The HuggingFace model directory of each role scored.
    models: dict[Role, str]
    #: The rows: verl's RLHF parquet (``prompt``, ``data_source``, ``reward_model.ground_truth``, ``extra_info``).
    data_path: str
    #: The run's reward function; None: verl's ``default_compute_score``.
    reward: RewardFunction | None = None
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    sample: int = DEFAULT_SAMPLE
    seed: int = 0
    #: None: vLLM on a node with a GPU and vLLM, else transformers.
    engine: Engine | None = None
    #: Ask Ray for one GPU for the job (the cluster has GPUs).
    use_gpus: bool = False
    split: str = DEFAULT_SPLIT
    #: The run directory a role's model came from (the champion's).
    run_dirs: dict[Role, str] = field(default_factory=dict)
    #: vLLM's share of the GPU's memory; None: vLLM's default.
    gpu_memory_utilization: float | None = None

    def __post_init__(self) -> None:
        example = "{'trained': '/runs/<run>/model', 'base': '/models/<base model>'}"
        models = _roles("models", self.models, example)
        if not models:
            raise ConfigError("models", self.models, "names no model to evaluate", example)
        object.__setattr__(self, "models", models)
        run_dirs = _roles("run_dirs", self.run_dirs, "{'champion': '/runs/<champion run>'}")
        stray = sorted(r.value for r in run_dirs if r not in models)
        if stray:
            raise ConfigError(f"run_dirs.{stray[0]}", run_dirs[Role(stray[0])], "names a role that is not evaluated",
                              f"one of {sorted(r.value for r in models)}")
        object.__setattr__(self, "run_dirs", run_dirs)
        _text("data_path", self.data_path, "/data/<recipe>-<key>/val.parquet")
        object.__setattr__(self, "reward", _reward(self.reward))
        object.__setattr__(self, "engine", _engine(self.engine))
        _positive("max_new_tokens", self.max_new_tokens, "max_new_tokens: 512")
        _positive("sample", self.sample, "sample: 16")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError("seed", self.seed, "must be a whole number", "seed: 0")
        share = self.gpu_memory_utilization
        if share is not None and (isinstance(share, bool) or not isinstance(share, int | float)
                                  or not 0 < share <= 1):
            raise ConfigError("gpu_memory_utilization", share, "must be a share of the GPU's memory above 0, at most 1",
                              "gpu_memory_utilization: 0.5, or null for vLLM's default")
        if not isinstance(self.use_gpus, bool):
            raise ConfigError("use_gpus", self.use_gpus, "must be true or false", "use_gpus: true on a GPU cluster")

    def to_dict(self) -> dict[str, Any]:
        reward = None if self.reward is None else {"path": self.reward.path, "name": self.reward.name,
                                                     "kwargs": dict(self.reward.kwargs)}
        return {"models": {r.value: p for r, p in self.models.items()}, "data_path": self.data_path,
                "reward": reward, "max_new_tokens": self.max_new_tokens, "sample": self.sample, "seed": self.seed,
                "engine": None if self.engine is None else self.engine.value, "use_gpus": self.use_gpus,
                "split": self.split, "run_dirs": {r.value: p for r, p in self.run_dirs.items()},
                "gpu_memory_utilization": self.gpu_memory_utilization}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EvaluationRequest:
        """The request :meth:`to_dict` wrote; a key it does not know, or a missing one, is a ConfigError."""
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"request.{unknown[0]}", data[unknown[0]], "is not a field of an evaluation request",
                              f"one of {sorted(known)}")
        for key in ("models", "data_path"):
            if key not in data:
                raise ConfigError(f"request.{key}", None, "is missing", "see verl_pipeline.evaluation.request")
        return cls(**dict(data))


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "DEFAULT_SAMPLE", "DEFAULT_SPLIT", "EvaluationRequest"]
