"""The project's exception types: one base, so callers can catch everything the pipeline raises; and
:func:`section_of`, the refusal every run-profile section reader starts with."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class PipelineError(Exception):
    """Base error of the pipeline. Its message is meant for the user: what failed and how to fix it."""


class ConfigError(PipelineError):
    """A profile, parameter or option is invalid. Raised before any cluster starts."""

    def __init__(self, key: str, value: object, rule: str, fix: str | None = None) -> None:
        self.key = key
        self.value = value
        self.rule = rule
        self.fix = fix
        msg = f"{key}={value!r}: {rule}"
        if fix:
            msg += f" (fix: {fix})"
        super().__init__(msg)


def section_of(value: object, where: str, keys: Sequence[str], *, what: str, example: str) -> dict[str, Any] | None:
    """A profile section (``where``: ``profiles/<name>.<section>``) as a mapping of ``keys``; None when it is
    absent. Anything but a mapping, or a key outside ``keys``, is a :class:`ConfigError` (``what``: what one
    of its keys is, e.g. "watch setting"; ``example``: a section to copy)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ConfigError(where, value, "must be a mapping", example)
    unknown = sorted(set(value) - set(keys))
    if unknown:
        raise ConfigError(f"{where}.{unknown[0]}", value[unknown[0]], f"is not a {what}", f"one of {list(keys)}")
    return value


class EnvironmentCheckError(PipelineError):
    """The cluster's nodes lack what the job needs (packages, GPUs, paths, CPUs), found before it is
    submitted. The user's to fix: each problem names the node, the package or path and the fix."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"the cluster cannot run this verl training job ({len(self.problems)} problem(s); "
                         "nothing was submitted): " + "; ".join(self.problems))


class ClusterError(PipelineError):
    """A Ray cluster could not be provisioned, reached or torn down."""


class DataError(PipelineError):
    """Input data could not be read or converted to verl's parquet schema."""


class ModelError(PipelineError):
    """A model could not be fetched or verified."""


class JobError(PipelineError):
    """A Ray job could not be submitted, or it ended without succeeding."""
