"""The model registry on the run profile's MLflow server: the run profile's setting that names the registered
model each run's exported model becomes a version of.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from verl_pipeline.exceptions import ConfigError, section_of

#: The key of the run profile's ``trackers.mlflow`` section that turns the registry on.
KEY = "registry"
#: Names MLflow accepts everywhere (no ``/`` or ``:``), as a file name would be.
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,255}")


@dataclass(frozen=True)
class RegistrySettings:
    """``trackers: {mlflow: {registry: {model_name: ...}}}``: register every run's exported model as a
    version of ``model_name`` (the profile's name when not given) on the MLflow connection's server."""

    model_name: str

    @classmethod
    def from_profile(cls, section: Any, *, where: str, profile: str) -> RegistrySettings | None:
        """The setting at ``where`` (``profiles/<profile>.trackers.mlflow.registry``); None when absent."""
        entry = section_of(section, where, ("model_name",), what="registry setting",
                           example="registry: {model_name: gsm8k-qwen}")
        if entry is None:
            return None
        name = entry.get("model_name", profile)
        if not isinstance(name, str) or not _MODEL_NAME.fullmatch(name):
            raise ConfigError(f"{where}.model_name", name, "is not a registered model name: letters, digits, "
                              "'_', '.' and '-', at most 256", "model_name: gsm8k-qwen")
        return cls(name)

    def to_dict(self) -> dict[str, Any]:
        return {"model_name": self.model_name}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RegistrySettings:
        return cls(str(data["model_name"]))


__all__ = ["KEY", "RegistrySettings"]
