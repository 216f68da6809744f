"""The run report's content: verl's metric rows and the run's attempts in, a :class:`Report` out (pure).

:func:`merge_rows` makes one row per step from every attempt's metrics (a step an attempt redid
after resuming counts once, as the later attempt logged it); :func:`build_report` summarises them.
Medians, not means, summarise per-step numbers: the first step of every attempt carries its
start-up (engine and model loading), which a mean would spread over the whole run.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from enum import Enum
from typing import Any

from verl_pipeline.jobs.startup.actors import ActorStart
from verl_pipeline.jobs.startup.markers import Phase
from verl_pipeline.jobs.startup.phases import PhaseTime, StartupPhases
from verl_pipeline.promotion import Verdict
from verl_pipeline.report import gpu, scaling_check
from verl_pipeline.report.critic import CriticSummary
from verl_pipeline.report.critic import summarise as summarise_critic
from verl_pipeline.report.learning import LearningVerdict, judge
from verl_pipeline.report.restart_history import RestartSummary
from verl_pipeline.scores import Evaluation
from verl_pipeline.trainer import metrics as m

REPORT_VERSION = 1


class RunOutcome(str, Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


@dataclass(frozen=True)
class StepRow:
    """One line of verl's file logger: the step, the attempt that logged it, its metrics."""

    step: int
    attempt: int
    metrics: dict[str, float]

    @property
    def is_training(self) -> bool:
        """A training step, not a row of validation alone (step 0, or a resumed run's starting step)."""
        return not m.is_validation_only(self.metrics)


@dataclass(frozen=True)
class AttemptInfo:
    """What the run's ``attempts.jsonl`` says of one attempt, plus the steps its metrics show."""

    attempt: int
    submission_id: str
    submitted_at: float
    resumed_from_step: int
    first_step: int | None = None
    last_step: int | None = None
    #: The run segment the attempt trained (2, 3, … after a merge on a changed world size: from merged
    #: weights, without the optimizer state).
    segment: int = 1
    #: When (epoch seconds) the attempt's first training step reached the pipeline's metrics reader
    #: (verl's file logger records no time with a row); None: not seen (no step, or no waiter read it).
    first_step_seen_at: float | None = None
    #: When (epoch seconds) the attempt's metrics file was last written: its last row.
    last_row_at: float | None = None
    #: When each phase of the attempt's start ended, as its waiter saw the lines (``jobs.startup.phases``).
    startup_ended: dict[Phase, float] = field(default_factory=dict)
    #: Phases the attempt's job was rendered not to run (validation before training on a resume).
    startup_skipped: frozenset[Phase] = frozenset()
    #: How each Ray actor of the attempt's start came up, as Ray recorded it (``jobs.startup.actors``);
    #: None: not recorded.
    actors: tuple[ActorStart, ...] | None = None

    @property
    def startup(self) -> list[PhaseTime]:
        """Each phase of the attempt's start: when it ended after the submission and how long it took
        (unknown where the waiter did not see the line that ends it; skipped where the job had none)."""
        ended = dict(self.startup_ended)
        if self.first_step_seen_at is not None:
            ended.setdefault(Phase.FIRST_STEP, self.first_step_seen_at)
        return StartupPhases(ended).times(self.submitted_at, self.startup_skipped)

    @property
    def time_to_first_step_s(self) -> float | None:
        """Seconds from the attempt's submission to its first training step: what starting (or resuming) cost."""
        if self.first_step_seen_at is None:
            return None
        return max(0.0, self.first_step_seen_at - self.submitted_at)

    @property
    def training_window(self) -> gpu.Window | None:
        """From the first training step's arrival to the last row: the attempt trained (start-up excluded)."""
        start, end = self.first_step_seen_at, self.last_row_at
        return (start, end) if start is not None and end is not None and start < end else None


@dataclass(frozen=True)
class Series:
    """A per-step metric summarised: the last value, the best (highest) and its step, the median."""

    final: float
    best: float
    best_step: int
    median: float


@dataclass(frozen=True)
class RunFacts:
    """What the run was asked to do (its ``run_spec.json``)."""

    run_key: str
    run_name: str
    profile: str
    mode: str | None
    nnodes: int
    n_gpus_per_node: int
    total_steps: int
    gpu_memory_gb: float | None = None

    @property
    def n_gpus(self) -> int:
        return self.nnodes * self.n_gpus_per_node

    @classmethod
    def from_spec_dict(cls, run_key: str, spec: dict[str, Any], *, mode: str | None = None,
                       total_steps: int | None = None) -> RunFacts:
        """``total_steps``: what the rendered job trains (its ``trainer.total_training_steps``), else the spec's."""
        hardware = spec.get("hardware") or {}
        return cls(run_key=run_key, run_name=str(spec.get("run_name", run_key)), profile=str(spec.get("profile", "")),
                   mode=mode or spec.get("mode"), nnodes=int(spec.get("nnodes") or 0),
                   n_gpus_per_node=int(spec.get("n_gpus_per_node") or 0),
                   total_steps=int(total_steps or spec.get("total_training_steps") or 0),
                   gpu_memory_gb=hardware.get("gpu_memory_gb"))


@dataclass(frozen=True)
class Check:
    """One check of a preflight run."""

    name: str
    ok: bool
    detail: str


@dataclass
class Report:
    """Everything ``report.json`` holds (and ``report.html`` shows)."""

    run: RunFacts
    status: RunOutcome
    steps_done: int
    attempts: list[AttemptInfo]
    generated_at: float
    score: Series | None = None
    validation: dict[str, Series] = field(default_factory=dict)
    response_length: Series | None = None
    #: Tokens/s per GPU (verl's ``perf/throughput``), median over steps.
    throughput_per_gpu: float | None = None
    #: Tokens/s of the whole run (``perf/total_num_tokens / perf/time_per_step``), median over steps.
    throughput_total: float | None = None
    time_per_step_s: float | None = None
    #: Median seconds per step of the step (``step``) and of each of its own ``timing_s/<phase>``.
    timing_s: dict[str, float] = field(default_factory=dict)
    #: Each of the step's own phases as a share of all steps' time (together at most 1).
    phase_share: dict[str, float] = field(default_factory=dict)
    #: Median seconds of what verl times apart from the step (``testing``: validation), over the
    #: steps that ran it.
    timing_outside_step_s: dict[str, float] = field(default_factory=dict)
    mfu_actor: float | None = None
    #: The highest peak GPU memory any role (actor, critic) reported over the steps, in GB.
    peak_memory_allocated_gb: float | None = None
    peak_memory_reserved_gb: float | None = None
    #: The actor's gradient norm (``actor/grad_norm``), median and highest over the steps.
    grad_norm_median: float | None = None
    grad_norm_max: float | None = None
    #: Whether the run learned (train and validation reward, KL, entropy), in numbers and in words.
    learning: LearningVerdict | None = None
    #: The critic's learning and cost (PPO with GAE); None: the run had no critic (GRPO).
    critic: CriticSummary | None = None
    #: Each physical GPU's utilisation and memory (the run's gpu-usage file); empty: no GPU readings.
    gpus: list[gpu.GpuUsage] = field(default_factory=list)
    #: The plot of each host's GPUs, by the host's address (file names in the report directory).
    gpu_plots: dict[str, str] = field(default_factory=dict)
    wall_time_s: float | None = None
    gpu_hours: float | None = None
    checks: list[Check] = field(default_factory=list)
    scaling_point: scaling_check.ScalingPoint | None = None
    comparisons: list[scaling_check.Comparison] = field(default_factory=list)
    flags: list[scaling_check.Flag] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    plots: dict[str, str] = field(default_factory=dict)
    #: The restart budget and the restart decisions (the run's ``restarts.jsonl``); None: not known.
    restarts: RestartSummary | None = None
    #: The trained, base and champion models' scores on the evaluation rows (``evaluation.json``).
    evaluation: Evaluation | None = None
    #: Why the run was or was not promoted (``promotion.json``); None: no promotion was decided.
    promotion: Verdict | None = None

    @property
    def steps_redone(self) -> int:
        """Steps logged again by a later attempt (its checkpoint was older than the last step logged)."""
        redone, reached = 0, 0
        for a in self.attempts:
            if a.first_step is not None and a.last_step is not None:
                redone += max(0, min(reached, a.last_step) - a.resumed_from_step)
                reached = max(reached, a.last_step)
        return redone

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        for attempt, a in zip(out["attempts"], self.attempts, strict=True):
            attempt["time_to_first_step_s"] = a.time_to_first_step_s
            attempt["startup_ended"] = {p.value: t for p, t in a.startup_ended.items()}
            attempt["startup_skipped"] = sorted(p.value for p in a.startup_skipped)
            attempt["startup"] = [{"phase": t.phase.value, "ended_after_s": t.ended_after_s,
                                   "duration_s": t.duration_s, "skipped": t.skipped} for t in a.startup]
        out["flags"] = [f.to_dict() for f in self.flags]
        if self.learning is not None:
            out["learning"]["reasons"] = [r.value for r in self.learning.reasons]
        out["restarts"] = self.restarts.to_dict() if self.restarts else None
        out["evaluation"] = self.evaluation.to_dict() if self.evaluation else None
        out["promotion"] = self.promotion.to_dict() if self.promotion else None
        for row, g in zip(out["gpus"], self.gpus, strict=True):
            row.update(label=g.label, peak_memory_pct=g.peak_memory_pct)
        # Flat facts first, so a later run (the scaling check) or a UI reads them without nesting.
        out.update(version=REPORT_VERSION, profile=self.run.profile, mode=self.run.mode, run_key=self.run.run_key,
                   total_steps=self.run.total_steps, n_gpus=self.run.n_gpus, steps_redone=self.steps_redone)
        return out


def merge_rows(rows: list[StepRow]) -> list[StepRow]:
    """One row per step, ascending; where attempts overlap (a resume redid steps) the later attempt's.

    A step's training row wins over a row of validation alone at that step (a resumed attempt
    validates at the step it resumed from), whose metrics it gains where it has none of its own.
    """
    by_step: dict[int, StepRow] = {}
    for row in sorted(rows, key=lambda r: (r.attempt, r.step)):
        had = by_step.get(row.step)
        if had is not None and had.is_training and not row.is_training:
            by_step[row.step] = StepRow(had.step, had.attempt, {**row.metrics, **had.metrics})
        else:
            by_step[row.step] = row
    return [by_step[s] for s in sorted(by_step)]


def training_rows(rows: list[StepRow]) -> list[StepRow]:
    """The training steps among ``rows``: what step counts, seconds per step and throughput are of."""
    return [r for r in rows if r.is_training]


def series(rows: list[StepRow], name: str) -> Series | None:
    """``name`` over the steps that report it (None when none does)."""
    points = [(r.step, r.metrics[name]) for r in rows if name in r.metrics]
    if not points:
        return None
    best_step, best = max(points, key=lambda p: (p[1], -p[0]))
    return Series(final=points[-1][1], best=best, best_step=best_step, median=statistics.median(v for _, v in points))


def median_of(rows: list[StepRow], name: str) -> float | None:
    values = [r.metrics[name] for r in rows if name in r.metrics]
    return statistics.median(values) if values else None


def max_of(rows: list[StepRow], names: tuple[str, ...]) -> float | None:
    """The highest value of any of ``names`` over the rows (None when no row reports one)."""
    values = [r.metrics[name] for r in rows for name in names if name in r.metrics]
    return max(values) if values else None


def timing_names(rows: list[StepRow], *, in_step: bool) -> list[str]:
    """The ``timing_s/<phase>`` names verl reported, of the step's own phases (and ``step``) or of the rest."""
    names = sorted({k for r in rows for k in r.metrics if k.startswith(m.TIMING_PREFIX)})
    return [k for k in names if (k[len(m.TIMING_PREFIX):] not in m.TIMING_OUTSIDE_STEP) == in_step]


def timing_breakdown(rows: list[StepRow], *, in_step: bool = True) -> dict[str, float]:
    """Median seconds of each ``timing_s/<phase>`` verl reported, by phase: the step and its own
    phases, or (``in_step=False``) what verl times apart from the step."""
    return {k[len(m.TIMING_PREFIX):]: v for k in timing_names(rows, in_step=in_step)
            if (v := median_of(rows, k)) is not None}


def phase_shares(rows: list[StepRow]) -> dict[str, float]:
    """Each of the step's own phases as a share of all steps' time (a ratio of sums: the phases of
    one step add up to at most its time, so the shares add up to at most 1, as medians would not)."""
    timed = [r for r in rows if r.metrics.get(m.TIMING_STEP)]
    total = sum(r.metrics[m.TIMING_STEP] for r in timed)
    if not total:
        return {}
    return {k[len(m.TIMING_PREFIX):]: sum(r.metrics.get(k, 0.0) for r in timed) / total
            for k in timing_names(timed, in_step=True) if k != m.TIMING_STEP}


def total_throughput(rows: list[StepRow], n_gpus: int) -> float | None:
    """Tokens/s of the whole run per step (median): verl's token count over its step time, else per GPU x GPUs."""
    values = []
    for r in rows:
        tokens, seconds = r.metrics.get(m.TOTAL_TOKENS), r.metrics.get(m.TIME_PER_STEP)
        if tokens is not None and seconds:
            values.append(tokens / seconds)
        elif m.THROUGHPUT_PER_GPU in r.metrics and n_gpus:
            values.append(r.metrics[m.THROUGHPUT_PER_GPU] * n_gpus)
    return statistics.median(values) if values else None


def with_steps(attempts: list[AttemptInfo], rows: list[StepRow]) -> list[AttemptInfo]:
    """Each attempt with the first and last step its own metrics file logged (before merging)."""
    out = []
    for a in attempts:
        steps = [r.step for r in training_rows(rows) if r.attempt == a.attempt]
        out.append(replace(a, first_step=min(steps) if steps else None, last_step=max(steps) if steps else None))
    return out


def preflight_checks(summary: dict[str, Any]) -> list[Check]:
    """The checks a preflight job ran (its ``preflight.json``), each with its key numbers or its error."""
    out = []
    for name, check in (summary.get("checks") or {}).items():
        detail = str(check["error"]) if check.get("error") else _detail(name, check)
        out.append(Check(name, bool(check.get("ok")), detail))
    return out


def _detail(name: str, check: dict[str, Any]) -> str:
    if name == "verl_config":
        return (f"verl accepted the configuration for {check.get('n_gpus')} GPU(s): train_batch_size "
                f"{check.get('train_batch_size')}, rollout.n {check.get('rollout_n')}")
    if name == "data":
        splits = [f"{s}: {c.get('rows')} rows" + (f", prompt tokens ≤ {c['prompt_tokens']['max']}"
                                                   if "max" in (c.get("prompt_tokens") or {}) else "")
                  for s, c in check.items() if isinstance(c, dict) and "rows" in c]
        return "; ".join(splits)
    if name == "reward":
        return "; ".join(f"{s}: {c.get('scored')} ground truths scored, {c.get('not_one')} not 1.0"
                         for s, c in check.items() if isinstance(c, dict) and "scored" in c)
    if name == "generation":
        return f"{len(check.get('samples') or [])} prompt(s) generated on CPU"
    return ""


def training_windows(attempts: list[AttemptInfo]) -> list[gpu.Window]:
    """The spans in which the run trained: each attempt's, where its first step's arrival is known."""
    return [w for a in attempts if (w := a.training_window) is not None]


def _notes(facts: RunFacts, status: RunOutcome, rows: list[StepRow], attempts: list[AttemptInfo],
           checks: list[Check]) -> list[str]:
    notes = []
    if facts.mode == "preflight":
        notes.append("No training steps: this was a preflight run (the cluster has no GPUs); "
                     f"{sum(c.ok for c in checks)} of {len(checks)} checks passed.")
    elif not attempts:
        notes.append("No training steps: no job was submitted (the run ended before its submit).")
    elif not rows:
        notes.append("No training steps: verl logged no step (the job ended before its first step).")
    if status is RunOutcome.FAILED and rows and rows[-1].step < facts.total_steps:
        notes.append(f"The run failed at step {rows[-1].step} of {facts.total_steps}.")
    return notes


def build_report(facts: RunFacts, *, status: RunOutcome, attempts: list[AttemptInfo], rows: list[StepRow],
                 generated_at: float, ended_at: float | None = None, preflight: dict[str, Any] | None = None,
                 earlier: list[scaling_check.ScalingPoint] | None = None,
                 gpu_series: list[gpu.GpuSeries] | None = None, restarts: RestartSummary | None = None,
                 settings: Mapping[str, Any] | None = None, evaluation: Evaluation | None = None,
                 promotion: Verdict | None = None) -> Report:
    """The report of one run (pure: every input is passed in).

    ``rows``: every attempt's metric rows (unmerged); ``ended_at``: when the run's last file was
    written (wall time runs from the first submit to it); ``earlier``: the profile's earlier
    successful runs for the scaling check; ``gpu_series``: the run's GPU readings, per physical GPU
    (:func:`~verl_pipeline.report.gpu.collect`; none: no GPUs were read, as on a CPU cluster);
    ``restarts``: its restart budget and decisions; ``settings``: the job's verl settings (its
    ``job.json``), for the remedies that depend on them; ``evaluation`` and ``promotion``: the models'
    scores after the export and the promotion rule's verdict, when the run has them.
    """
    attempts = with_steps(attempts, rows)
    merged = merge_rows(rows)
    # Validation is of every row (step 0 is the baseline); everything else is of the training steps.
    steps = training_rows(merged)
    checks = preflight_checks(preflight) if preflight else []
    report = Report(run=facts, status=status, steps_done=steps[-1].step if steps else 0, attempts=attempts,
                    generated_at=generated_at, checks=checks, notes=_notes(facts, status, steps, attempts, checks),
                    restarts=restarts, evaluation=evaluation, promotion=promotion)
    report.score = series(steps, m.SCORE)
    report.validation = {k: s for k in sorted({k for r in merged for k in r.metrics if k.startswith(m.VAL_CORE_PREFIX)})
                         if (s := series(merged, k)) is not None}
    report.response_length = series(steps, m.RESPONSE_LENGTH)
    report.throughput_per_gpu = median_of(steps, m.THROUGHPUT_PER_GPU)
    report.throughput_total = total_throughput(steps, facts.n_gpus)
    report.time_per_step_s = median_of(steps, m.TIME_PER_STEP)
    report.timing_s = timing_breakdown(steps)
    report.phase_share = phase_shares(steps)
    report.timing_outside_step_s = timing_breakdown(steps, in_step=False)
    report.mfu_actor = median_of(steps, m.MFU_ACTOR)
    report.peak_memory_allocated_gb = max_of(steps, m.MAX_MEMORY_ALLOCATED)
    report.peak_memory_reserved_gb = max_of(steps, m.MAX_MEMORY_RESERVED)
    report.grad_norm_median = median_of(steps, m.GRAD_NORM)
    report.grad_norm_max = max_of(steps, (m.GRAD_NORM,))
    report.learning = judge(merged)
    report.critic = summarise_critic(steps)
    report.gpus = gpu.summarise(gpu_series or [], training_windows(attempts))
    if attempts and ended_at is not None:
        report.wall_time_s = max(0.0, ended_at - min(a.submitted_at for a in attempts))
        # GPUs are held from the first submit to the last step; a preflight cluster has none.
        if facts.mode == "train":
            report.gpu_hours = report.wall_time_s * facts.n_gpus / 3600
    _scaling_and_flags(report, earlier or [], steps, settings)
    return report


def _scaling_and_flags(report: Report, earlier: list[scaling_check.ScalingPoint], steps: list[StepRow],
                       settings: Mapping[str, Any] | None) -> None:
    facts = report.run
    if facts.mode == "train" and report.throughput_per_gpu:
        # Stored for every training run; later runs compare only with the successful ones.
        report.scaling_point = scaling_check.ScalingPoint(facts.run_key, facts.nnodes, facts.n_gpus,
                                                    report.throughput_per_gpu)
        report.comparisons = scaling_check.compare(report.scaling_point, earlier)
    report.flags = scaling_check.flags(
        timing_s=report.timing_s, peak_memory_gb=report.peak_memory_allocated_gb, gpu_memory_gb=facts.gpu_memory_gb,
        comparisons=report.comparisons, gpus=report.gpus,
        saves=[(r.metrics[m.TIMING_STEP], r.metrics.get(m.TIMING_SAVE_CHECKPOINT, 0.0)) for r in steps
               if r.metrics.get(m.TIMING_STEP)],
        grad_norms=[r.metrics[m.GRAD_NORM] for r in steps if m.GRAD_NORM in r.metrics],
        advantage_ranges=[(r.metrics[m.ADVANTAGES_MIN], r.metrics[m.ADVANTAGES_MAX]) for r in steps
                          if m.ADVANTAGES_MIN in r.metrics and m.ADVANTAGES_MAX in r.metrics],
        settings=settings)
