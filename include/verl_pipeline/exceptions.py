"""The project's exception types: one base, so callers can catch everything the pipeline raises."""

from __future__ import annotations


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
