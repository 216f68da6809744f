"""The evaluation of a run: its request built from the run's files, the job run on a Ray cluster, the record kept.

- :func:`plan_for_run` reads the run directory only (no cluster): the job as submitted (``job.json``:
  its ``data.val_files``, its actor model — the base —, its reward function and ``runtime_env``), the
  exported model (``<run dir>/model``) and the champion (:mod:`verl_pipeline.evaluation.champion`, or the
  run named by ``against``). The job runs with the run's own ``runtime_env``, so a reward file shipped in
  its working_dir is read there, under the relative path the run's settings give it.
- :func:`evaluate` submits the evaluation job (:mod:`verl_pipeline.evaluation.job`) with Ray's Jobs API,
  waits for it until a deadline and returns the record it printed; a job that fails or ends without one
  is a one-line :class:`~verl_pipeline.exceptions.JobError` with the job id and the end of its log.
- :func:`evaluate_run` does both and writes ``evaluation.json`` in the run directory: what
  ``verl-pipeline evaluate`` calls.
"""

from __future__ import annotations

import json
import logging
import shlex
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.constants import JobState
from verl_pipeline.evaluation.champion import Champion, find_champion
from verl_pipeline.evaluation.job import COMMAND, parse_report
from verl_pipeline.evaluation.request import DEFAULT_MAX_NEW_TOKENS, DEFAULT_SAMPLE, EvaluationRequest
from verl_pipeline.exceptions import ConfigError, JobError
from verl_pipeline.jobs.client import RayJobsClient
from verl_pipeline.models.export import read_export
from verl_pipeline.rundir import RunDir
from verl_pipeline.scores import Evaluation, Role
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer import reward
from verl_pipeline.trainer.overrides import spelled
from verl_pipeline.trainer.scaling import ROLLOUT_GPU_SHARE_KEY

log = logging.getLogger(__name__)

#: Seconds the evaluation job has to print its record (a CPU smoke evaluation takes a minute or two).
DEFAULT_TIMEOUT_S = 3600.0
#: Seconds between two looks at the job's state.
POLL_S = 1.0
#: CPUs the job's driver asks Ray for (transformers generates there).
ENTRYPOINT_CPUS = 1.0
#: Lines of the job's log a failure names.
LOG_TAIL_LINES = 5
VAL_FILES_KEY = "data.val_files"
MODEL_KEY = "actor_rollout_ref.model.path"
RESPONSE_LENGTH_KEY = "data.max_response_length"


@dataclass(frozen=True)
class EvaluationPlan:
    """What :func:`evaluate` is given for a run: the request, the run's ``runtime_env``, and notes for the
    user (why there is no champion, a model not exported)."""

    request: EvaluationRequest
    runtime_env: dict[str, Any]
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class EvaluationOutcome:
    """What :func:`evaluate_run` did: the record, where it was written, and the plan's notes."""

    evaluation: Evaluation
    path: Path
    notes: tuple[str, ...] = ()


def _setting(settings: Mapping[str, Any], key: str, where: Path) -> Any:
    found = spelled(settings, key)
    if found is None or found.value in (None, ""):
        raise ConfigError(f"{where}:{key}", None, "is not set in the job the run submitted",
                          "evaluate a run whose submit task rendered its job (job.json)")
    return found.value


def _one_file(value: Any, where: Path) -> str:
    files = [value] if isinstance(value, str) else list(value) if isinstance(value, list | tuple) else []
    if len(files) != 1 or not isinstance(files[0], str):
        raise ConfigError(f"{where}:{VAL_FILES_KEY}", value, "an evaluation scores one parquet file",
                          "pass val_path= (the preprocess task's val_path)")
    return files[0]


def _share(value: Any) -> float | None:
    """The rollout's GPU share as a number (an override's text "0.2" included); None when unset."""
    if value is None or isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def reward_of(settings: Mapping[str, Any]) -> reward.RewardFunction | None:
    """The run's reward function as its job names it (the path as the job reads it: relative to its
    working_dir when shipped); None when the run scores with verl's ``default_compute_score``."""
    path = spelled(settings, reward.PATH_KEY) or spelled(settings, reward.LEGACY_PATH_KEY)
    if path is None or not path.value:
        return None
    name = spelled(settings, reward.NAME_KEY) or spelled(settings, reward.LEGACY_NAME_KEY)
    kwargs = spelled(settings, reward.KWARGS_KEY)
    return reward.RewardFunction(str(path.value), str(name.value if name else reward.DEFAULT_NAME),
                                 dict(kwargs.value) if kwargs and isinstance(kwargs.value, Mapping) else {})


def _champion(run: RunDir, against: Path | None) -> Champion:
    if against is not None:
        export = read_export(against)
        if export is None:
            raise ConfigError("against", str(against), "has no exported model (model.json and model/config.json)",
                              "a run directory whose model was exported (its export_model task)")
        return Champion(against, export.model_dir, f"champion: {against} (asked for)")
    if not run.has_spec():
        return Champion(None, None, f"no champion: {run.spec_file} is absent, so the run's profile is not known")
    spec = RunSpec.load(run)
    return find_champion(spec.storage_root, spec.profile, this_run=run.path)


def plan_for_run(run_dir: Path, *, against: Path | None = None, sample: int = DEFAULT_SAMPLE,
                 max_new_tokens: int | None = None, use_gpus: bool = False, val_path: str | None = None,
                 base_model: str | None = None) -> EvaluationPlan:
    """The evaluation of the run in ``run_dir``: its exported model (trained), its base model and the
    champion on its validation rows, with its reward function and its ``runtime_env``.

    ``against``: another run directory whose exported model is the champion (instead of the profile's
    latest run). ``max_new_tokens``: default the run's ``data.max_response_length``. ``use_gpus``: the
    cluster has GPUs (the job asks for one). ``val_path`` / ``base_model``: the preprocess and prefetch
    tasks' paths, when the caller has them (default: the ones the run's job was submitted with).
    Reads files only; a run that submitted no job is a ConfigError."""
    run = RunDir(Path(run_dir))
    job = run.job()
    if job is None:
        raise ConfigError("run_dir", str(run_dir), f"has no {run.job_file.name}: the run submitted no job",
                          "a run directory <storage>/runs/<run key> whose submit task ran")
    settings = dict(job.get("settings") or {})
    val = val_path or _one_file(_setting(settings, VAL_FILES_KEY, run.job_file), run.job_file)
    base = base_model or str(_setting(settings, MODEL_KEY, run.job_file))
    models = {Role.TRAINED: str(run.model_dir), Role.BASE: base}
    notes = [] if (run.model_dir / "config.json").is_file() else [
        f"{run.model_dir} holds no exported model: the trained model's line in errors says so"]
    champion = _champion(run, against)
    notes.append(champion.note)
    run_dirs = {}
    if champion.model_dir is not None and champion.run_dir is not None:
        models[Role.CHAMPION] = champion.model_dir
        run_dirs[Role.CHAMPION] = str(champion.run_dir)
    length = spelled(settings, RESPONSE_LENGTH_KEY)
    share = spelled(settings, ROLLOUT_GPU_SHARE_KEY)  # the evaluation's vLLM takes the rollout's share
    request = EvaluationRequest(
        models=models, data_path=val, reward=reward_of(settings), sample=sample, use_gpus=use_gpus,
        max_new_tokens=max_new_tokens or int(length.value if length else DEFAULT_MAX_NEW_TOKENS), run_dirs=run_dirs,
        gpu_memory_utilization=_share(share.value if share else None))
    return EvaluationPlan(request, dict(job.get("runtime_env") or {}), tuple(notes))


def log_tail(logs: str, lines: int = LOG_TAIL_LINES) -> str:
    """The last ``lines`` non-empty lines of a job's log, on one line."""
    kept = [line.strip() for line in logs.splitlines() if line.strip()][-lines:]
    return " | ".join(kept)[-1500:]


def _wait(client: RayJobsClient, job_id: str, *, timeout_s: float, poll_s: float) -> Evaluation:
    deadline = time.monotonic() + timeout_s
    while True:
        info = client.get_job(job_id)
        if info is not None and info.status.is_terminal():
            logs = client.logs(job_id)
            found = parse_report(logs) if info.status is JobState.SUCCEEDED else None
            if found is not None:
                return found
            raise JobError(f"the evaluation job {job_id} ended {info.status.value} without a record: "
                           f"{log_tail(logs) or info.message or 'its log is empty'}")
        if time.monotonic() >= deadline:
            client.stop(job_id)
            raise JobError(f"the evaluation job {job_id} printed no record within {timeout_s:g}s and was stopped "
                           "(fix: a longer timeout, or fewer rows with sample)")
        time.sleep(poll_s)


def evaluate(client: RayJobsClient, request: EvaluationRequest, *, runtime_env: dict[str, Any], id_prefix: str,
             timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = POLL_S) -> Evaluation:
    """Run the evaluation job for ``request`` on ``client``'s cluster with ``runtime_env`` and return its record.

    The job is ``<id_prefix>-eval-<8 hex>`` with metadata ``purpose: evaluation``; it asks Ray for
    :data:`ENTRYPOINT_CPUS` CPUs, and one GPU when ``request.use_gpus``. JobError when it cannot be
    submitted, fails, ends without a record, or prints none within ``timeout_s`` (it is then stopped)."""
    job_id = f"{id_prefix}-eval-{uuid.uuid4().hex[:8]}"
    entrypoint = shlex.join([*COMMAND, "--request", json.dumps(request.to_dict(), sort_keys=True)])
    client.submit(entrypoint=entrypoint, submission_id=job_id, runtime_env=runtime_env,
                  metadata={"purpose": "evaluation"}, entrypoint_num_cpus=ENTRYPOINT_CPUS,
                  entrypoint_num_gpus=1 if request.use_gpus else None)
    log.info("Evaluation job %s submitted to %s: %s on %s", job_id, client.dashboard_url,
             sorted(r.value for r in request.models), request.data_path)
    return _wait(client, job_id, timeout_s=timeout_s, poll_s=poll_s)


def cluster_has_gpus(client: RayJobsClient) -> bool:
    """Whether an alive node of the cluster offers Ray a GPU."""
    return any(n.alive and float(n.resources.get("GPU", 0)) > 0 for n in client.nodes())


def evaluate_run(client: RayJobsClient, run_dir: Path, *, id_prefix: str, against: Path | None = None,
                 sample: int = DEFAULT_SAMPLE, max_new_tokens: int | None = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, val_path: str | None = None,
                 base_model: str | None = None) -> EvaluationOutcome:
    """Evaluate the run in ``run_dir`` on ``client``'s cluster (:func:`plan_for_run`, then :func:`evaluate`)
    and write the record to its ``evaluation.json``."""
    plan = plan_for_run(run_dir, against=against, sample=sample, max_new_tokens=max_new_tokens,
                        use_gpus=cluster_has_gpus(client), val_path=val_path, base_model=base_model)
    for note in plan.notes:
        log.info("Evaluation of %s: %s", run_dir, note)
    evaluation = evaluate(client, plan.request, runtime_env=plan.runtime_env, id_prefix=id_prefix, timeout_s=timeout_s)
    run = RunDir(Path(run_dir))
    run.save_evaluation(evaluation.to_dict())
    return EvaluationOutcome(evaluation, run.evaluation_file, plan.notes)


__all__ = ["DEFAULT_TIMEOUT_S", "EvaluationOutcome", "EvaluationPlan", "cluster_has_gpus", "evaluate", "evaluate_run",
           "log_tail", "plan_for_run", "reward_of"]
