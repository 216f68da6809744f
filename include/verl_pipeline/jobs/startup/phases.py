"""What a wait keeps of its job's start: when each phase ended, up to the first training step.

A start goes through the phases of :mod:`verl_pipeline.jobs.startup.markers` (worker start, model
load, engine start, graph capture, checkpoint load, validation, first step); a phase ends when the
line that ends it was printed: verl's and vLLM's lines say when (:mod:`verl_pipeline.jobs.startup.log_times`),
and a line that does not (verl's validation metrics) is timed by the log read that brought it (every
other poll: 10 s at the default 5 s polls), as is the first step. A phase is **unknown** when its line
never showed, and so is the length of the phase after it (its start is unknown): the report and the
task log say "unknown", never a guess. A phase the job was rendered not to run (validation before
training with ``trainer.val_before_train=false``, a resume's default) is **skipped** instead: the
phase after it lasts from the end of the one before. A marker that shows after a later phase's is out of order and
ignored; a phase whose line shows several times (one vLLM engine per replica) ends with the last
one before the next phase's. A waiter that takes over mid-start (a restarted triggerer) keeps the
phases the earlier one recorded.

Once the first step came (or the job ended without one) the waiter reads Ray's records of how each actor of
the start came up (:mod:`verl_pipeline.jobs.startup.actors`; again the next polls while they are not whole,
for ``ACTOR_READ_WINDOW_S`` at most): what each phase spent waiting for workers, starting processes, importing and
initialising. The task log says it class by class.

The records lie beside the attempt's metrics file, one set per attempt: ``rundir.startup_file`` (the
phases), ``rundir.first_step_file`` (the first step's arrival, the report's training window) and
``rundir.actor_starts_file`` (the actors).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.logstream import TaskLog
from verl_pipeline.jobs.progress import Progress, record_first_step
from verl_pipeline.jobs.run_files import FileWrite
from verl_pipeline.jobs.startup import actors
from verl_pipeline.jobs.startup.actors import ActorStart
from verl_pipeline.jobs.startup.log_times import printed_at
from verl_pipeline.jobs.startup.markers import MARKERS, PHASES, Phase
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import actor_starts_file, startup_file
from verl_pipeline.trainer.nodes.warmstart import VAL_BEFORE_TRAIN_KEY
from verl_pipeline.trainer.overrides import spelled

#: How long after its first read the waiter reads Ray's records of a start's actors again (once a poll)
#: while they are not whole, before it keeps them as they are: Ray sends them about once a second, so an
#: actor made a moment before the first step is whole a second or two later.
ACTOR_READ_WINDOW_S = 10.0


def skipped_phases(*settings: Mapping[str, Any] | None) -> frozenset[Phase]:
    """The phases a job with these verl settings was rendered not to run: validation before training where
    ``trainer.val_before_train`` is false. The first of ``settings`` that sets it decides (an attempt's decision,
    then the run's settings)."""
    for layer in settings:
        found = spelled(layer or {}, VAL_BEFORE_TRAIN_KEY)
        if found is not None:
            return frozenset({Phase.VALIDATION}) if str(found.value).lower() == "false" else frozenset()
    return frozenset()


@dataclass(frozen=True)
class PhaseTime:
    """One phase of one start: when it ended and how long it took, in seconds (None: unknown)."""

    phase: Phase
    #: Seconds from the submission to the phase's end.
    ended_after_s: float | None
    duration_s: float | None
    #: The job did not run the phase (it was rendered without it).
    skipped: bool = False

    def text(self) -> str:
        """``model load 40 s``, ``validation unknown``, ``first step unknown (done 243 s after submission)``,
        ``validation skipped``."""
        if self.skipped:
            return f"{self.phase.words} skipped"
        if self.duration_s is not None:
            return f"{self.phase.words} {self.duration_s:.0f} s"
        if self.ended_after_s is not None:
            return f"{self.phase.words} unknown (done {self.ended_after_s:.0f} s after submission)"
        return f"{self.phase.words} unknown"


@dataclass
class StartupPhases:
    """When each phase of one start ended (epoch seconds: when its line was printed, else when it arrived)."""

    ended: dict[Phase, float] = field(default_factory=dict)
    #: Phases an earlier waiter of the attempt recorded: kept as they are (a waiter that takes over
    #: reads again up to 30 s of log the earlier one read, and would see their lines later).
    kept: frozenset[Phase] = frozenset()

    def observe(self, text: str, now: float) -> list[Phase]:
        """The phases ``text`` (lines of the job's log that arrived at ``now``) ends: those not seen before,
        in order. Each ends when its line was printed where the line says (:func:`printed_at`), else at ``now``."""
        new = []
        for line in text.splitlines():
            for marker in MARKERS:
                if marker.text not in line:
                    continue
                at = printed_at(line, now)
                if self.end(marker.phase, now if at is None else at):
                    new.append(marker.phase)
        return [p for p in PHASES if p in new]

    def end(self, phase: Phase, at: float) -> bool:
        """``phase`` ended at ``at`` (or later, if it had already ended later: several engines' lines arrive
        in any order): kept unless a later phase already ended (out of order: ignored); True when the phase
        had not ended before."""
        if phase in self.kept or any(self.ended.get(p) is not None for p in PHASES[PHASES.index(phase) + 1:]):
            return False
        first = phase not in self.ended
        self.ended[phase] = at if first else max(self.ended[phase], at)
        return first

    def times(self, started_at: float | None, skipped: frozenset[Phase] = frozenset()) -> list[PhaseTime]:
        """Every phase's end after ``started_at`` (the submission) and length; unknown where its
        line (or, for the length, the line before it) was not seen; a phase in ``skipped`` that did not
        run is skipped, and the next one lasts from the end of the one before it."""
        out = []
        previous = started_at
        for phase in PHASES:
            end = self.ended.get(phase)
            if end is None and phase in skipped:
                out.append(PhaseTime(phase, None, None, skipped=True))
                continue
            out.append(PhaseTime(phase, None if end is None or started_at is None else max(0.0, end - started_at),
                                 None if end is None or previous is None else max(0.0, end - previous)))
            previous = end
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"phases": {p.value: self.ended[p] for p in PHASES if p in self.ended}}

    @classmethod
    def from_dict(cls, data: Any) -> StartupPhases:
        phases = data.get("phases") if isinstance(data, dict) else None
        phases = phases if isinstance(phases, dict) else {}
        return cls({p: float(phases[p.value]) for p in PHASES if isinstance(phases.get(p.value), int | float)})

    @classmethod
    def load(cls, metrics_path: Path) -> StartupPhases:
        """The phases recorded beside ``metrics_path``, kept as they are (none when absent or unreadable)."""
        try:
            recorded = cls.from_dict(json.loads(startup_file(metrics_path).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return cls()
        return cls(recorded.ended, frozenset(recorded.ended))


class StartupWatch:
    """The start-up part of a wait: times each phase from the job's log lines, says so in the task log,
    and records the phases and the first step's arrival beside the attempt's metrics file.

    :param metrics_path: the attempt's metrics file (None: nothing is recorded, the phases still logged).
    :param skipped: the phases the job was rendered without (:func:`skipped_phases`).
    """

    def __init__(self, *, job_id: str, metrics_path: str | None, log: TaskLog,
                 skipped: frozenset[Phase] = frozenset()) -> None:
        self.job_id = job_id
        self.skipped = skipped
        self.metrics_path = Path(metrics_path) if metrics_path else None
        self.log = log
        self.phases = StartupPhases()
        #: The job's submission (epoch seconds; Ray's job start), once a poll read it.
        self.started_at: float | None = None
        #: The start is over (the first step came): nothing more to watch.
        self.done = False
        self._first_step: Progress | None = None
        self._first_step_recorded = self.metrics_path is None
        self._changed = False
        #: Ray's records of the start's actors were read (or could not be): once per attempt.
        self._actors_read = False
        self._actors_first_read_at: float | None = None
        self._actors: list[ActorStart] | None = None

    def resume(self, *, started: bool) -> None:
        """Continue from what an earlier waiter of this attempt saw (blocking file I/O): ``started``, a
        step came already (nothing to watch), else the phases it recorded."""
        self.done = started
        if self.metrics_path is not None and not started:
            self.phases = StartupPhases.load(self.metrics_path)
        if self.metrics_path is not None and started:
            self._actors_read = actor_starts_file(self.metrics_path).exists()

    def observe_lines(self, lines: list[str], now: float) -> None:
        """Lines of the job's log that arrived at ``now``: the phases they end, each said in the task log."""
        if self.done or not lines:
            return
        for phase in self.phases.observe("\n".join(lines), now):
            self._changed = True
            (time,) = [t for t in self.phases.times(self.started_at, self.skipped) if t.phase is phase]
            after = f" {time.ended_after_s:.0f} s after submission" if time.ended_after_s is not None else ""
            self.log.info("Ray job %s start-up: %s done%s (%s)", self.job_id, phase.words, after, time.text())

    def first_step(self, progress: Progress) -> None:
        """A training step was seen (the first this waiter saw, or a later one): the start is over."""
        if not self._first_step_recorded:
            self._first_step_recorded = True  # once per waiter, written or not
            self._first_step = progress
        if self.done:
            return
        self.done = True
        if progress.first_step_seen_at is not None:
            self.phases.end(Phase.FIRST_STEP, progress.first_step_seen_at)
            self._changed = True
        times = self.phases.times(self.started_at, self.skipped)
        total = times[-1].ended_after_s
        self.log.info("Ray job %s start-up: first step %s: %s", self.job_id,
                      f"{total:.0f} s after submission" if total is not None else "seen",
                      " · ".join(t.text() for t in times))

    def actors_due(self, *, ended: bool) -> bool:
        """Read Ray's records of the start's actors now: the first step came, or the job ended without one."""
        return not self._actors_read and (self.done or ended)

    def observe_actors(self, starts: list[ActorStart], *, ended: bool, now: float) -> None:
        """How each actor of the start came up (Ray's records), read at ``now`` (monotonic seconds): said
        class by class, and recorded. Where Ray has not yet recorded all of it (none, or an actor made just
        before the read), the next poll reads again, for ``ACTOR_READ_WINDOW_S`` after the first read and
        never after the job ended: then it is kept as it is."""
        if self._actors_first_read_at is None:
            self._actors_first_read_at = now
        whole = bool(starts) and all(a.settled for a in starts)
        if not whole and not ended and now - self._actors_first_read_at < ACTOR_READ_WINDOW_S:
            return
        self._actors_read = True
        for group in actors.by_class(starts):
            self.log.info("Ray job %s start-up by actor: %s", self.job_id, group.text())
        if starts:
            self._actors = starts

    def actors_unread(self, why: str) -> None:
        """Ray's records of the start's actors could not be read: said once, not tried again (they only explain)."""
        self._actors_read = True
        self.log.info("Ray job %s: no record of how its actors started (%s)", self.job_id, why)

    def writes(self) -> list[FileWrite]:
        """The records that changed since the last writes (each built apart: a write runs later, in a thread)."""
        if self.metrics_path is None:
            return []
        return [w for w in (self._phases_write(self.metrics_path), self._first_step_write(self.metrics_path),
                            self._actors_write(self.metrics_path)) if w is not None]

    def _phases_write(self, metrics: Path) -> FileWrite | None:
        if not self._changed:
            return None
        self._changed = False
        path, record = startup_file(metrics), self.phases.to_dict()
        return FileWrite("record its start-up phases", lambda: write_json_atomic(path, record), self._failed)

    def _first_step_write(self, metrics: Path) -> FileWrite | None:
        first, self._first_step = self._first_step, None
        if first is None:
            return None
        return FileWrite("record when it logged its first step", lambda: record_first_step(metrics, first),
                         lambda error: None)  # the report then says the time is unknown

    def _actors_write(self, metrics: Path) -> FileWrite | None:
        starts, self._actors = self._actors, None
        if starts is None:
            return None
        path, record = actor_starts_file(metrics), actors.to_record(starts)
        return FileWrite("record how its actors started", lambda: write_json_atomic(path, record),
                         lambda error: None)  # the task log said it; the report shows none

    def _failed(self, error: OSError) -> None:
        self.metrics_path = None  # not writable from the triggerer: the task log still says each phase
