"""A run's directory: every file the pipeline keeps for one run, named here and nowhere else.

``<storage>/runs/<run_key>/`` holds the run's frozen spec (``run_spec.json``, written once at
provision and read back by every later task, retry and CLI command), verl's validation of the run
(done once, at provision, and trusted by the preflight job), the job as submitted
(``job.json``), what the probe found and what was decided for each attempt's nodes
(``environment.json``, ``decisions.jsonl``), the cluster it runs on (``cluster.json``), the record
of submitted attempts, of the jobs the pipeline stopped and of its restart decisions, the waiter's
cursor, verl's metrics per attempt, the report and the exported model. It is the record that
outlives a re-provisioned cluster (whose Ray job table is gone), so "the run's latest job" is read from here.

verl's checkpoint tracker (``latest_checkpointed_iteration.txt``) lives with the checkpoints, which
may be on other storage; :func:`tracker_step` is its one reader.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.paths import write_json_atomic

#: The folder of the run's own files shipped with its job (the job's ``runtime_env`` working_dir).
JOB_FILES_DIR = "job_files"
#: verl's checkpoint tracker in ``trainer.default_local_dir``: the step ``resume_mode=auto`` resumes from.
TRACKER_FILE = "latest_checkpointed_iteration.txt"
#: verl's file logger output of attempt N is ``metrics-a<N>.jsonl``: one file per attempt, because
#: verl's FileLogger truncates its file when a trainer starts (a resumed attempt would erase the last).
_METRICS_PREFIX, _METRICS_SUFFIX = "metrics-a", ".jsonl"
#: What a record becomes once what it names is gone (a torn-down cluster): ``<name>.stopped.json``.
_STOPPED_SUFFIX = ".stopped.json"


def first_step_file(metrics_path: Path) -> Path:
    """Beside an attempt's metrics file (``metrics-a1.jsonl`` → ``metrics-a1.first-step.json``): when its
    first training step reached the pipeline's reader (the waiter), for the run report."""
    return metrics_path.with_suffix(".first-step.json")


def startup_file(metrics_path: Path) -> Path:
    """Beside an attempt's metrics file (``metrics-a1.jsonl`` → ``metrics-a1.startup.json``): when each
    phase of its start ended: when the lines that end them were printed, or arrived (``jobs.startup.phases``)."""
    return metrics_path.with_suffix(".startup.json")


def actor_starts_file(metrics_path: Path) -> Path:
    """Beside an attempt's metrics file (``metrics-a1.jsonl`` → ``metrics-a1.actors.json``): how each Ray
    actor of its start came up, as Ray recorded it (``jobs.startup.actors``)."""
    return metrics_path.with_suffix(".actors.json")


def retire(record: Path) -> Path | None:
    """Rename ``<name>.json`` to ``<name>.stopped.json`` (kept for the post-mortem); None when absent."""
    if not record.exists():
        return None
    target = record.with_name(record.name.removesuffix(".json") + _STOPPED_SUFFIX)
    os.replace(record, target)
    return target


def tracker_step(checkpoint_dir: Path) -> int | None:
    """The step verl's tracker names; None when it is absent or unreadable (e.g. empty after a kill)."""
    try:
        return int((checkpoint_dir / TRACKER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def now() -> float:
    return round(time.time(), 3)


@dataclass(frozen=True)
class Attempt:
    """One submitted Ray job of the run (a line of ``attempts.jsonl``)."""

    submission_id: str
    attempt: int
    submitted_at: float
    dashboard_url: str
    #: Last checkpointed step when this attempt was submitted (0: none, starts from scratch).
    resume_from_step: int
    metrics_path: str | None
    #: The run segment this attempt trains (1, or 2, 3, … after a merge on a changed world size; see
    #: :mod:`verl_pipeline.jobs.checkpoints`) and the run step it starts from: verl's step ``s`` logged
    #: by this attempt is run step ``segment_start_step + s``.
    segment: int = 1
    segment_start_step: int = 0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class RunDir:
    """The files of one run, one property each, and the facts read from them."""

    path: Path

    # -- the files ----------------------------------------------------------------------------------
    @property
    def spec_file(self) -> Path:
        """The run's frozen spec (``RunSpec.to_dict``), written once at provision."""
        return self.path / "run_spec.json"

    @property
    def job_file(self) -> Path:
        """The rendered job of the latest submission (entrypoint, runtime_env, verl settings, mode)."""
        return self.path / "job.json"

    @property
    def cluster_file(self) -> Path:
        """The run's current cluster handle; ``cluster.stopped.json`` once torn down."""
        return self.path / "cluster.json"

    @property
    def attempts_file(self) -> Path:
        return self.path / "attempts.jsonl"

    @property
    def stops_file(self) -> Path:
        """Jobs the pipeline stopped itself (a hang, a lost node), with why: their retry resumes them."""
        return self.path / "stops.jsonl"

    @property
    def restarts_file(self) -> Path:
        """The restart decisions after infrastructure failures, one JSON line each: the attempt that
        failed, its progress, the budget left, the delay, ``restart`` or ``exhausted``
        (``jobs.restart_budget.RestartBudget.record``)."""
        return self.path / "restarts.jsonl"

    @property
    def cursor_file(self) -> Path:
        """How far the wait task got with the job's log and metrics (see ``jobs.logstream.WaitCursor``)."""
        return self.path / "wait-cursor.json"

    @property
    def environment_file(self) -> Path:
        """The latest node probe's report."""
        return self.path / "environment.json"

    @property
    def probe_file(self) -> Path:
        """The run's latest probe as it ran: what it asked and the nodes' raw answers; a restart on the same
        nodes may reuse it (``jobs.reprobe``)."""
        return self.path / "probe.json"

    @property
    def decisions_file(self) -> Path:
        """What was decided for each submitted attempt's nodes (``trainer.nodes.decisions``): one JSON line per
        attempt, with what the probe found and what the job therefore used."""
        return self.path / "decisions.jsonl"

    @property
    def manifest_file(self) -> Path:
        return self.path / "manifest.json"

    @property
    def job_files_dir(self) -> Path:
        """The run's own files shipped with its job: the job's ``runtime_env`` working_dir (``trainer/jobfiles.py``)."""
        return self.path / JOB_FILES_DIR

    @property
    def preflight_file(self) -> Path:
        """The preflight job's summary (it writes it itself, on the shared storage)."""
        return self.path / "preflight.json"

    @property
    def validation_file(self) -> Path:
        """The provision task's verl validation (``trainer.validate.ValidationRecord``): what the preflight
        job trusts instead of composing and validating the same overrides again."""
        return self.path / "verl-validation.json"

    @property
    def secrets_dir(self) -> Path:
        """Private folder (0700) of the tracker credentials files (0600), one per attempt."""
        return self.path / "secrets"

    @property
    def report_dir(self) -> Path:
        """The run report: ``report.json``, its plots and ``report.html``."""
        return self.path / "report"

    @property
    def model_dir(self) -> Path:
        """The exported model (HuggingFace safetensors)."""
        return self.path / "model"

    @property
    def model_manifest_file(self) -> Path:
        """What was exported (step, checkpoint, final reward, data hash), beside :attr:`model_dir`."""
        return self.path / "model.json"

    @property
    def evaluation_file(self) -> Path:
        """The trained, base and champion models' scores on the evaluation rows (``scores.Evaluation``)."""
        return self.path / "evaluation.json"

    @property
    def promotion_file(self) -> Path:
        """The promotion rule's verdict on this run (``promotion.Verdict``), written by the publish task."""
        return self.path / "promotion.json"

    @property
    def checkpoints_link(self) -> Path:
        """A relative link to the run's checkpoint directory."""
        return self.path / "checkpoints"

    @property
    def slurm_dir(self) -> Path:
        """The Slurm backend's batch script, state and logs of this run's allocation."""
        return self.path / "slurm"

    @property
    def gpu_usage_file(self) -> Path:
        """Each node's GPU utilisation and memory over the run, as the waiter sampled them from Ray's
        node summary (``jobs.gpu_usage``): one JSON line per node per sample."""
        return self.path / "gpu-usage.jsonl"

    def metrics_file(self, attempt: int) -> Path:
        """Where verl's file logger writes the metrics of ``attempt`` (``$VERL_FILE_LOGGER_PATH``)."""
        return self.path / f"{_METRICS_PREFIX}{attempt}{_METRICS_SUFFIX}"

    def metrics_files(self) -> dict[int, Path]:
        """Every attempt's metrics file present, by attempt number (ascending)."""
        found = {}
        for path in self.path.glob(f"{_METRICS_PREFIX}*{_METRICS_SUFFIX}"):
            number = path.name[len(_METRICS_PREFIX):-len(_METRICS_SUFFIX)]
            if number.isdigit():
                found[int(number)] = path
        return dict(sorted(found.items()))

    # -- the frozen spec, the job, the cluster ------------------------------------------------------
    def has_spec(self) -> bool:
        return self.spec_file.is_file()

    def spec_dict(self) -> dict[str, Any]:
        """The frozen spec as saved (``RunSpec.load`` turns it back into a spec)."""
        data: dict[str, Any] = json.loads(self.spec_file.read_text())
        return data

    def save_spec(self, spec: dict[str, Any]) -> None:
        write_json_atomic(self.spec_file, spec)

    def job(self) -> dict[str, Any] | None:
        """The job as last submitted (``RenderedJob.to_dict``), None before the first submission."""
        return _read_json(self.job_file)

    def save_job(self, job: dict[str, Any]) -> None:
        write_json_atomic(self.job_file, job)

    def validation(self) -> dict[str, Any] | None:
        """The provision task's verl validation record, None when it recorded none."""
        return _read_json(self.validation_file)

    def save_validation(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.validation_file, record)

    def evaluation(self) -> dict[str, Any] | None:
        """The run's evaluation record, None before the evaluation wrote one."""
        return _read_json(self.evaluation_file)

    def save_evaluation(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.evaluation_file, record)

    def promotion(self) -> dict[str, Any] | None:
        """The promotion verdict of this run, None before its publish task decided."""
        return _read_json(self.promotion_file)

    def save_promotion(self, record: dict[str, Any]) -> None:
        write_json_atomic(self.promotion_file, record)

    def cluster(self) -> dict[str, Any] | None:
        """The run's current cluster handle (a dict), None when none is recorded or it was torn down."""
        return _read_json(self.cluster_file)

    def save_cluster(self, handle: dict[str, Any]) -> None:
        write_json_atomic(self.cluster_file, handle)

    def retire_cluster(self) -> None:
        retire(self.cluster_file)

    # -- attempts and stops -------------------------------------------------------------------------
    def attempts(self) -> list[Attempt]:
        if not self.attempts_file.is_file():
            return []
        return [Attempt(**json.loads(line)) for line in self.attempts_file.read_text(encoding="utf-8").splitlines()
                if line.strip()]

    def attempt_of(self, submission_id: str) -> Attempt | None:
        return next((a for a in self.attempts() if a.submission_id == submission_id), None)

    def record_attempt(self, attempt: Attempt) -> None:
        _append_line(self.attempts_file, attempt.to_dict())

    def latest_job_id(self, fallback: str | None = None) -> str | None:
        """The run's latest job: its last recorded attempt (a retry's, or the wait task's on a shared
        cluster), else ``fallback`` (what the submit task returned)."""
        attempts = self.attempts()
        return attempts[-1].submission_id if attempts else fallback

    def record_decision(self, record: dict[str, Any]) -> None:
        """Append one attempt's decision (``trainer.decisions.Decision.to_dict`` with its attempt)."""
        _append_line(self.decisions_file, record)

    def kept_probe(self) -> dict[str, Any] | None:
        """The run's latest probe (:attr:`probe_file`), if any."""
        return _read_json(self.probe_file)

    def keep_probe(self, request: dict[str, Any], report: dict[str, Any]) -> None:
        write_json_atomic(self.probe_file, {"request": request, "report": report, "at": now()})

    def decisions(self) -> list[dict[str, Any]]:
        """Every attempt's decision, oldest first (a line cut by a crash is skipped)."""
        return _read_lines(self.decisions_file)

    def record_stop(self, submission_id: str, reason: str) -> None:
        """Note that the pipeline stopped ``submission_id`` because of an infrastructure problem."""
        _append_line(self.stops_file, {"submission_id": submission_id, "reason": reason, "at": now()})

    def stop_reason(self, submission_id: str) -> str | None:
        """Why the pipeline stopped ``submission_id``, if it did."""
        if not self.stops_file.is_file():
            return None
        reasons = [row["reason"] for line in self.stops_file.read_text(encoding="utf-8").splitlines() if line.strip()
                   for row in [json.loads(line)] if row.get("submission_id") == submission_id]
        return reasons[-1] if reasons else None

    def record_restart(self, row: dict[str, Any]) -> None:
        """Append one restart decision (see :attr:`restarts_file`)."""
        _append_line(self.restarts_file, row)

    def restart_records(self) -> list[dict[str, Any]]:
        """Every restart decision recorded, oldest first (a line cut by a kill is skipped)."""
        return _read_lines(self.restarts_file)


def _append_line(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line to a run file, readable as written (UTF-8, not escaped), flushed at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(row, default=str, ensure_ascii=False) + "\n")
        f.flush()


def _read_lines(path: Path) -> list[dict[str, Any]]:
    """Every JSON object line of a run file, oldest first; a line cut by a crash or a kill is skipped."""
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


__all__ = ["TRACKER_FILE", "Attempt", "RunDir", "actor_starts_file", "first_step_file", "now", "retire", "startup_file",
           "tracker_step"]
