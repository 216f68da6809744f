"""Build a run's report from its run directory: the one path the report task and the CLI call.

Reads ``run_spec.json``, ``job.json``, ``attempts.jsonl``, every attempt's metrics file
(:meth:`verl_pipeline.rundir.RunDir.metrics_files`), ``preflight.json``, the GPU readings
(``RunDir.gpu_usage_file``), the restart decisions (``restarts.jsonl``) and each attempt's start-up
records (``rundir.startup_file``, ``rundir.actor_starts_file``); writes
``report/report.json``, the plots and ``report/report.html``, each atomically.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.startup import actors
from verl_pipeline.jobs.startup.actors import ActorStart
from verl_pipeline.paths import atomic_path, write_json_atomic
from verl_pipeline.promotion import Verdict
from verl_pipeline.report import gpu, scaling_check
from verl_pipeline.report.build import (
    AttemptInfo,
    Report,
    RunFacts,
    RunOutcome,
    StepRow,
    build_report,
    merge_rows,
    training_windows,
)
from verl_pipeline.report.restart_history import RestartSummary, summarise
from verl_pipeline.rundir import RunDir, actor_starts_file
from verl_pipeline.scores import read_evaluation

log = logging.getLogger(__name__)

REPORT_JSON = "report.json"
REPORT_HTML = "report.html"


@dataclass(frozen=True)
class ReportFiles:
    report_dir: Path
    json: Path
    html: Path
    report: Report

    def to_dict(self) -> dict[str, Any]:
        """The report task's XCom: where the report is, and its headline."""
        r = self.report
        return {"report_dir": str(self.report_dir), "html": str(self.html), "json": str(self.json),
                "status": r.status.value, "mode": r.run.mode, "steps_done": r.steps_done,
                "total_steps": r.run.total_steps, "flags": [f.kind.value for f in r.flags],
                "plots": sorted([*r.plots, *r.gpu_plots.values()]),
                "learned": r.learning.learned if r.learning else None,
                "learning": r.learning.words if r.learning else None}


def report_dir(run_dir: Path) -> Path:
    return RunDir(run_dir).report_dir


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("Run report: cannot read %s: %s", path, e)
        return None
    return data if isinstance(data, dict) else None


def read_rows(run_dir: Path) -> list[StepRow]:
    """Every metric row of every attempt (lines cut by a kill are skipped), at its run step: an attempt
    of a new segment (a merge on a changed world size) logs verl's steps from 1."""
    from verl_pipeline.jobs.progress import parse_jsonl_row

    offsets = {a.attempt: a.segment_start_step for a in RunDir(run_dir).attempts()}
    rows = []
    for attempt, path in RunDir(run_dir).metrics_files().items():
        for line in path.read_text(errors="replace").splitlines():
            parsed = parse_jsonl_row(line)
            if parsed is not None:
                rows.append(StepRow(offsets.get(attempt, 0) + parsed[0], attempt, parsed[1]))
    return rows


def _ended_at(run_dir: Path) -> float | None:
    """When the run last wrote what the report reads: its last metrics line, or its preflight summary."""
    paths = [*RunDir(run_dir).metrics_files().values(), RunDir(run_dir).preflight_file]
    times = [p.stat().st_mtime for p in paths if p.is_file()]
    return max(times) if times else None


def _mtime(path: Path) -> float | None:
    try:
        return path.stat().st_mtime
    except OSError:
        return None


def _verdict(run_dir: Path) -> Verdict | None:
    record = RunDir(run_dir).promotion()
    try:
        return Verdict.from_dict(record) if record else None
    except (KeyError, TypeError, ValueError) as e:
        log.warning("Run %s: %s is unreadable (%s); the report shows no promotion", run_dir.name,
                    RunDir(run_dir).promotion_file, e)
        return None


def _restarts(run_dir: Path, spec: dict[str, Any]) -> RestartSummary:
    """The run's restart decisions and its budget (the frozen spec's, else the defaults)."""
    from verl_pipeline.restarts import RestartPolicy

    policy = RestartPolicy.from_dict(spec.get("restarts"))
    return summarise(RunDir(run_dir).restart_records(), policy.no_progress_limit)


def infer_status(run_dir: Path, facts: RunFacts, rows: list[StepRow], preflight: dict[str, Any] | None) -> RunOutcome:
    """How the run ended when no one says (a CLI rebuild): its last report's word, else its files'."""
    earlier = _read_json(report_dir(run_dir) / REPORT_JSON) or _read_json(RunDir(run_dir).manifest_file) or {}
    if earlier.get("status") in {s.value for s in RunOutcome}:
        return RunOutcome(earlier["status"])
    if facts.mode == "preflight":
        return RunOutcome.SUCCEEDED if preflight and preflight.get("ok") else RunOutcome.FAILED
    reached = max((r.step for r in rows), default=0)
    return RunOutcome.SUCCEEDED if facts.total_steps and reached >= facts.total_steps else RunOutcome.FAILED


def _actors(metrics_path: Path) -> tuple[ActorStart, ...] | None:
    starts = actors.load(actor_starts_file(metrics_path))
    return None if starts is None else tuple(starts)


def write_report(run_dir: Path, *, status: RunOutcome | None = None, spec: dict[str, Any] | None = None,
                 plots: bool = True) -> ReportFiles:
    """(Re)build the report of the run in ``run_dir``; ``spec``: the run's spec (else its run_spec.json)."""
    spec = spec or _read_json(RunDir(run_dir).spec_file) or {}
    job = RunDir(run_dir).job() or {}
    facts = RunFacts.from_spec_dict(run_dir.name, spec, mode=job.get("mode"),
                                    total_steps=(job.get("settings") or {}).get("trainer.total_training_steps"))
    rows = read_rows(run_dir)
    preflight = _read_json(RunDir(run_dir).preflight_file)
    status = status or infer_status(run_dir, facts, rows, preflight)
    from verl_pipeline.jobs.gpu_usage import read_samples
    from verl_pipeline.jobs.progress import first_step_seen_at
    from verl_pipeline.jobs.startup.phases import StartupPhases, skipped_phases

    decided = {d.get("attempt"): d for d in RunDir(run_dir).decisions()}
    attempts = [AttemptInfo(a.attempt, a.submission_id, a.submitted_at, a.resume_from_step, segment=a.segment,
                            first_step_seen_at=first_step_seen_at(RunDir(run_dir).metrics_file(a.attempt)),
                            last_row_at=_mtime(RunDir(run_dir).metrics_file(a.attempt)),
                            startup_ended=StartupPhases.load(RunDir(run_dir).metrics_file(a.attempt)).ended,
                            startup_skipped=skipped_phases((decided.get(a.attempt) or {}).get("settings"),
                                                           spec.get("verl")),
                            actors=_actors(RunDir(run_dir).metrics_file(a.attempt)))
                for a in RunDir(run_dir).attempts()]
    gpu_series = gpu.collect(read_samples(RunDir(run_dir).gpu_usage_file))
    storage_root = Path(spec["storage_root"]) if spec.get("storage_root") else run_dir.parent.parent
    in_run = str((report_dir(run_dir) / REPORT_JSON).relative_to(run_dir))
    earlier = scaling_check.earlier_points(storage_root, facts.profile, report_file=in_run,
                                           exclude_run_key=facts.run_key)
    report = build_report(facts, status=status, attempts=attempts, rows=rows, generated_at=round(time.time(), 3),
                          ended_at=_ended_at(run_dir), preflight=preflight if facts.mode == "preflight" else None,
                          earlier=earlier, gpu_series=gpu_series, restarts=_restarts(run_dir, spec),
                          settings=job.get("settings") or None, evaluation=read_evaluation(RunDir(run_dir))[0],
                          promotion=_verdict(run_dir))
    out = report_dir(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    if plots:
        from verl_pipeline.report.plots import draw, draw_gpu

        report.plots = draw(merge_rows(rows), report.attempts, out)
        report.gpu_plots = draw_gpu(gpu_series, training_windows(report.attempts), report.attempts, out)
    from verl_pipeline.report.html import render_html

    with atomic_path(out / REPORT_HTML) as tmp:
        tmp.write_text(render_html(report), encoding="utf-8")
    write_json_atomic(out / REPORT_JSON, report.to_dict())
    log.info("Run report of %s (%s %s run, %d/%d steps, flags %s): %s %s", facts.run_key, status.value, facts.mode,
             report.steps_done, facts.total_steps, [f.kind.value for f in report.flags] or "none",
             report.learning.words if report.learning else "", out / REPORT_HTML)
    return ReportFiles(out, out / REPORT_JSON, out / REPORT_HTML, report)
