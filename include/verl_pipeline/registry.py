"""The model registry on the run profile's MLflow server: each run's exported model as a version of one
registered model, and the aliases that say which version is the profile's champion.

:func:`register` logs the exported model (``<run_dir>/model``) as the artifacts ``model/`` of the run's
MLflow run: the run named the run key in the experiment the caller names (``trainer.project_name``, see
:func:`verl_pipeline.trainer.render.tracker_names`), which is the run verl's ``Tracking`` logged the
training to when ``trainer.logger`` has ``mlflow`` (:func:`verl_pipeline.trackers.mlflow_run`), else a new
run there. It creates the registered model when it is missing, then the next version from those artifacts,
tagged with the run key, the training data's content hash, where the export lies and the evaluation's scores
(also the run's metrics), and moves the alias ``challenger`` to it. A second call for the same run key
returns the version the first made.

:func:`promote` moves the alias ``champion`` to a version and tags it with the version it replaced
(``previous_champion``); :func:`champion_version` reads it.

MLflow's client reads a server's login from ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` at
each request (no argument takes it): the calls given a login set them for their own duration and restore
the previous values. How long a call waits for an unreachable server is MLflow's
``MLFLOW_HTTP_REQUEST_TIMEOUT`` and ``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` in the Airflow worker's environment.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError, ModelError, PipelineError, section_of
from verl_pipeline.scores import Evaluation, Metric

log = logging.getLogger(__name__)

#: The key of the run profile's ``trackers.mlflow`` section that turns the registry on.
KEY = "registry"
#: The artifact folder of the MLflow run that holds the model's files, and the version's source.
MODEL_ARTIFACT = "model"
#: The alias of the newest registered version, and of the version promotion chose.
CHALLENGER, CHAMPION = "challenger", "champion"
#: The tag of a promoted version naming the version that was champion before it.
PREVIOUS_CHAMPION_TAG = "previous_champion"
#: Names MLflow accepts everywhere (no ``/`` or ``:``), as a file name would be.
_MODEL_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,255}")
_CREDENTIAL_VARS = ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
_env_lock = threading.Lock()


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


@dataclass(frozen=True)
class ModelVersion:
    """A version of a registered model: its number, aliases, run, artifacts and tags."""

    name: str
    version: int
    aliases: tuple[str, ...]
    run_id: str | None
    source: str
    tags: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, mv: Any) -> ModelVersion:
        """From MLflow's ``ModelVersion`` entity."""
        return cls(str(mv.name), int(mv.version), tuple(sorted(mv.aliases or ())), mv.run_id or None,
                   str(mv.source), dict(mv.tags or {}))


def evaluation_metrics(evaluation: Evaluation | None) -> dict[str, float]:
    """Each scored model's mean reward and pass rate: ``trained_mean_reward``, ``base_pass_rate`` …"""
    if evaluation is None:
        return {}
    return {f"{role.value}_{metric.value}": score.value(metric)
            for role, score in evaluation.models.items() for metric in Metric}


def version_tags(*, run_key: str, model_dir: Path, data_hash: str | None, evaluation: Evaluation | None,
                 links: Mapping[str, str]) -> dict[str, str]:
    """The tags of a run's model version: run key, export folder, training data hash, the evaluation's
    rows, smoke flag and scores, and each link as ``link.<name>``."""
    tags = {"run_key": run_key, "model_dir": str(model_dir)}
    if data_hash:
        tags["data_hash"] = data_hash
    if evaluation is not None:
        tags.update({"smoke": str(evaluation.smoke).lower(), "evaluation_data_hash": evaluation.data_hash,
                     "evaluation_split": evaluation.split})
        tags.update({k: repr(v) for k, v in evaluation_metrics(evaluation).items()})
    tags.update({f"link.{name}": url for name, url in links.items()})
    return tags


@contextmanager
def _client(tracking_uri: str, username: str | None, password: str | None, doing: str) -> Iterator[Any]:
    """An ``MlflowClient`` of ``tracking_uri`` logged in as ``username`` for the calls inside; any failure of
    theirs is one PipelineError saying what could not be done."""
    import requests
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    given = dict(zip(_CREDENTIAL_VARS, (username, password), strict=True))
    with _env_lock:
        before = {k: os.environ.get(k) for k in _CREDENTIAL_VARS}
        for k, v in given.items():
            if v:
                os.environ[k] = v
        try:
            yield MlflowClient(tracking_uri=tracking_uri, registry_uri=tracking_uri)
        except (MlflowException, requests.RequestException, OSError) as e:
            reason = _reason(e)
            raise PipelineError(f"trackers.mlflow: the MLflow server {tracking_uri} could not {doing}: {reason} "
                                "(fix: start the server, or correct the host, port and login of the MLflow "
                                "connection)") from e
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _reason(e: Exception) -> str:
    """The failure in a few words: the socket error of a server that cannot be reached, else MLflow's message."""
    text = " ".join(str(e).split())
    socket_error = re.search(r"\[Errno -?\d+\] [^'\")]+", text)
    if socket_error:
        return f"cannot connect ({socket_error.group(0).strip()})"
    return text if len(text) <= 240 else text[:240].rsplit(" ", 1)[0] + " …"


def _not_found(e: Exception) -> bool:
    return getattr(e, "error_code", None) == "RESOURCE_DOES_NOT_EXIST"


def _aliases(client: Any, name: str) -> dict[str, int] | None:
    """The registered model's aliases (alias → version); None when there is no such model."""
    from mlflow.exceptions import MlflowException

    try:
        model = client.get_registered_model(name)
    except MlflowException as e:
        if _not_found(e):
            return None
        raise
    return {alias: int(version) for alias, version in (model.aliases or {}).items()}


def _ensure_model(client: Any, name: str) -> dict[str, int]:
    """The registered model's aliases, the model created first when missing (or by a concurrent run)."""
    from mlflow.exceptions import MlflowException

    aliases = _aliases(client, name)
    if aliases is not None:
        return aliases
    try:
        client.create_registered_model(name, description="Models trained by verl_pipeline runs")
        log.info("Registered model %s created", name)
    except MlflowException as e:
        if getattr(e, "error_code", None) != "RESOURCE_ALREADY_EXISTS":
            raise
    return {}


def _quoted(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def _version_of_run(client: Any, name: str, run_key: str) -> Any | None:
    """The version a registration of ``run_key`` already made."""
    found = client.search_model_versions(f"name = {_quoted(name)} and tags.run_key = {_quoted(run_key)}",
                                         max_results=1)
    return found[0] if found else None


def _run_for(client: Any, experiment: str, run_key: str) -> tuple[Any, bool]:
    """The newest MLflow run named ``run_key`` in ``experiment``, else a new one (and the experiment);
    True when it was created here."""
    found = client.get_experiment_by_name(experiment)
    experiment_id = found.experiment_id if found is not None else client.create_experiment(experiment)
    runs = client.search_runs([experiment_id], filter_string=f"attributes.run_name = {_quoted(run_key)}",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if runs:
        return runs[0], False
    return client.create_run(experiment_id, run_name=run_key, tags={"run_key": run_key}), True


def _log_model(client: Any, *, experiment: str, run_key: str, model_dir: Path,
               metrics: dict[str, float]) -> tuple[str, str]:
    """Log ``model_dir`` (and ``metrics``) to the run's MLflow run: its id and the model's artifact URI."""
    import time

    from mlflow.entities import Metric as MlflowMetric

    run, created = _run_for(client, experiment, run_key)
    run_id = run.info.run_id
    log.info("Logging %s to MLflow run %s (experiment %s)", model_dir, run_id, experiment)
    client.log_artifacts(run_id, str(model_dir), artifact_path=MODEL_ARTIFACT)
    if metrics:
        stamp = int(time.time() * 1000)
        client.log_batch(run_id, metrics=[MlflowMetric(k, v, stamp, 0) for k, v in metrics.items()])
    if created:
        client.set_terminated(run_id)
    return run_id, f"{run.info.artifact_uri.rstrip('/')}/{MODEL_ARTIFACT}"


def _challenge(client: Any, name: str, version: int, aliases: dict[str, int]) -> None:
    """``challenger`` on ``version``, unless a newer version holds it already (aliases never move back)."""
    if aliases.get(CHALLENGER, 0) <= version:
        client.set_registered_model_alias(name, CHALLENGER, str(version))


def register(tracking_uri: str, *, name: str, model_dir: Path, run_key: str, experiment: str,
             evaluation: Evaluation | None = None, data_hash: str | None = None,
             links: Mapping[str, str] | None = None, username: str | None = None,
             password: str | None = None) -> ModelVersion:
    """Register the exported model ``model_dir`` of run ``run_key`` as a new version of ``name`` and give it
    the alias ``challenger`` (see the module doc); the version an earlier call for ``run_key`` made is returned
    instead of a new one.

    ``experiment``: the MLflow experiment of the run (``trainer.project_name``); ``data_hash``: the training
    data's content hash (the export manifest's); ``links``: pages of the run (report, Airflow run) by name.
    ModelError when ``model_dir`` holds no exported model; PipelineError when the server refuses or is unreachable.
    """
    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise ModelError(f"{model_dir} holds no exported model (no config.json): run {run_key} cannot be "
                         "registered (fix: export the run's model first)")
    tags = version_tags(run_key=run_key, model_dir=model_dir, data_hash=data_hash, evaluation=evaluation,
                        links=links or {})
    with _client(tracking_uri, username, password, f"register the model of run {run_key} as {name!r}") as client:
        aliases = _ensure_model(client, name)
        mv = _version_of_run(client, name, run_key)
        if mv is None:
            run_id, source = _log_model(client, experiment=experiment, run_key=run_key, model_dir=model_dir,
                                        metrics=evaluation_metrics(evaluation))
            mv = client.create_model_version(name, source, run_id=run_id, tags=tags)
            log.info("Model %s version %s registered from run %s (%s)", name, mv.version, run_key, source)
        else:
            log.info("Run %s is already registered as %s version %s: kept", run_key, name, mv.version)
        _challenge(client, name, int(mv.version), aliases)
        return ModelVersion.of(client.get_model_version(name, str(mv.version)))


def promote(tracking_uri: str, *, name: str, version: int, username: str | None = None,
            password: str | None = None) -> ModelVersion:
    """Move the alias ``champion`` of ``name`` to ``version``, which records the version that held it in its
    tag ``previous_champion`` (none on a first promotion; a version already champion is left as it is)."""
    with _client(tracking_uri, username, password, f"promote {name!r} version {version}") as client:
        previous = (_aliases(client, name) or {}).get(CHAMPION)
        if previous != version:
            if previous is not None:
                client.set_model_version_tag(name, str(version), PREVIOUS_CHAMPION_TAG, str(previous))
            client.set_registered_model_alias(name, CHAMPION, str(version))
            log.info("Model %s: champion is version %s (was %s)", name, version, previous or "none")
        return ModelVersion.of(client.get_model_version(name, str(version)))


def champion_version(tracking_uri: str, *, name: str, username: str | None = None,
                     password: str | None = None) -> ModelVersion | None:
    """The version of ``name`` with the alias ``champion``; None when the model has none or does not exist."""
    with _client(tracking_uri, username, password, f"read the champion of {name!r}") as client:
        version = (_aliases(client, name) or {}).get(CHAMPION)
        return None if version is None else ModelVersion.of(client.get_model_version(name, str(version)))


__all__ = ["CHALLENGER", "CHAMPION", "KEY", "MODEL_ARTIFACT", "PREVIOUS_CHAMPION_TAG", "ModelVersion",
           "RegistrySettings", "champion_version", "evaluation_metrics", "promote", "register", "version_tags"]
