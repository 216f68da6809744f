"""Training progress from verl's own output: its file logger's JSONL, or its console metric lines.

The numbers are the ones verl reports (``training/global_step``, ``perf/time_per_step``,
``critic/score/mean``, ``perf/throughput``…); the pipeline only formats them, and adds the GPUs'
utilisation as Ray's node summary last reported it (:class:`GpuSummary`)::

    step 120/500 (24%) · 3.1 min/step · ETA 19 h 40 m · critic/score/mean 0.41 · perf/throughput 2310
    · GPU 87% (2 nodes, min 80%)
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.gpu_usage import NodeGpuSample
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import first_step_file
from verl_pipeline.trainer.metrics import (
    SCORE,
    STEP,
    THROUGHPUT_PER_GPU,
    TIME_PER_STEP,
    TIMING_STEP,
    is_validation_only,
)

#: Metrics shown after the step and the ETA, when verl reports them.
SHOWN_METRICS = (SCORE, THROUGHPUT_PER_GPU)
#: Seconds per step is the mean of verl's ``perf/time_per_step`` over this many recent steps.
RECENT_STEPS = 10

# verl's console logger: ``(TaskRunnerV1 pid=N) step:3 - training/global_step:3 - perf/throughput:1317.6 - …``
_CONSOLE = re.compile(r"(?:^|[\s)])step:(\d+)((?: - [^\s:]+:[^\s]+)+)\s*$")
_PAIR = re.compile(r" - ([^\s:]+):([^\s]+)")
# verl 0.9.1 prints numpy scalars by their repr: ``reward/mean@1:np.float64(0.0)``, ``num_turns/min:np.int64(2)``.
_NUMPY_SCALAR = re.compile(r"^np\.\w+\((.*)\)$")


def _number(text: str) -> float | None:
    scalar = _NUMPY_SCALAR.match(text)
    try:
        value = float(scalar.group(1) if scalar else text)
    except ValueError:
        return None
    return value if value == value else None  # drop NaN


def parse_console_line(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` from one of verl's console metric lines, else None."""
    if "step:" not in line:
        return None
    m = _CONSOLE.search(line)
    if m is None:
        return None
    metrics = {k: v for k, raw in _PAIR.findall(m.group(2)) if (v := _number(raw)) is not None}
    return int(m.group(1)), metrics


def parse_jsonl_row(line: str) -> tuple[int, dict[str, float]] | None:
    """``(step, metrics)`` from one line of verl's file logger (``{"step": N, "data": {…}}``), else None."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return None  # a line cut by a kill, or still being written
    if not isinstance(row, dict) or not isinstance(row.get("data"), dict):
        return None
    data = row["data"]
    metrics = {str(k): float(v) for k, v in data.items() if isinstance(v, int | float) and v == v}
    step = metrics.get(STEP, row.get("step"))
    if not isinstance(step, int | float):
        return None
    return int(step), metrics


def _duration(seconds: float) -> str:
    minutes = int(seconds / 60 + 0.5)  # half up: 4.5 min is 5 m
    if minutes < 60:
        return f"{minutes} m"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes} m"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def _per_step(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.3g} s/step"
    if seconds < 5400:
        return f"{seconds / 60:.3g} min/step"
    return f"{seconds / 3600:.3g} h/step"


@dataclass(frozen=True)
class Progress:
    """The last step verl reported, and how fast steps go (``None`` until known)."""

    step: int
    total: int
    seconds_per_step: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    #: When (epoch seconds) the reader first saw a training step of this job: verl's file logger
    #: records no time with a row, so its arrival is the closest the pipeline gets.
    first_step_seen_at: float | None = None

    @property
    def reached_total(self) -> bool:
        """The job logged its last step (``trainer.total_training_steps``)."""
        return 0 < self.total <= self.step

    @property
    def eta_seconds(self) -> float | None:
        if self.seconds_per_step is None or self.total <= 0:
            return None
        return max(0, self.total - self.step) * self.seconds_per_step

    def line(self) -> str:
        parts = [f"step {self.step}/{self.total} ({100 * self.step // self.total}%)" if self.total > 0
                 else f"step {self.step}"]
        if self.seconds_per_step is not None:
            parts.append(_per_step(self.seconds_per_step))
        eta = self.eta_seconds
        if eta is not None:
            parts.append(f"ETA {_duration(eta)}")
        parts += [f"{k} {self.metrics[k]:.4g}" for k in SHOWN_METRICS if k in self.metrics]
        return " · ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["eta_seconds"] = self.eta_seconds
        out["line"] = self.line()
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Progress | None:
        if not data:
            return None
        return cls(step=int(data["step"]), total=int(data["total"]),
                   seconds_per_step=data.get("seconds_per_step"), metrics=dict(data.get("metrics") or {}),
                   first_step_seen_at=data.get("first_step_seen_at"))


class ProgressTracker:
    """Follows the steps verl reports; fed from either source, each step counts once.

    A row of validation alone (verl's step 0, or a resumed run's starting step) is no step.

    :param total: ``trainer.total_training_steps``.
    :param last: the progress a previous waiter reached (carried through a deferral).
    :param clock: the wall clock (epoch seconds) that dates the first step's arrival.
    """

    def __init__(self, total: int, last: Progress | None = None, *, clock: Callable[[], float] = time.time) -> None:
        self.total = total
        self.last = last
        self.clock = clock
        self._recent: list[float] = []
        #: The slowest step verl reported (``perf/time_per_step``) since this tracker started.
        self.slowest_s: float | None = None
        if last is not None and last.seconds_per_step is not None:
            self._recent.append(last.seconds_per_step)

    def observe(self, step: int, metrics: dict[str, float]) -> bool:
        """Record one step's metrics; True when it is a training step newer than any seen."""
        # verl's training steps count from 1: a step-0 row is validation, even when none of its values parsed.
        if step < 1 or is_validation_only(metrics) or (self.last is not None and step <= self.last.step):
            return False
        per_step = metrics.get(TIME_PER_STEP, metrics.get(TIMING_STEP))
        if per_step is not None and per_step > 0:
            self._recent = [*self._recent, per_step][-RECENT_STEPS:]
            self.slowest_s = max(self.slowest_s or 0.0, per_step)
        mean = sum(self._recent) / len(self._recent) if self._recent else None
        shown = {k: metrics[k] for k in SHOWN_METRICS if k in metrics}
        # Only this reader's own first step is dated: a carried progress without a date stays without.
        seen_at = self.clock() if self.last is None else self.last.first_step_seen_at
        self.last = Progress(step=step, total=self.total, seconds_per_step=mean, metrics=shown,
                             first_step_seen_at=seen_at)
        return True

    def observe_console(self, line: str) -> bool:
        parsed = parse_console_line(line)
        return parsed is not None and self.observe(*parsed)

    def observe_jsonl(self, line: str) -> bool:
        parsed = parse_jsonl_row(line)
        return parsed is not None and self.observe(*parsed)


@dataclass(frozen=True)
class GpuSummary:
    """One reading of the cluster's GPUs (Ray's node summary), over every GPU that reported a utilisation."""

    mean_pct: float
    min_pct: float
    max_pct: float
    gpus: int
    nodes: int

    @classmethod
    def of(cls, samples: Iterable[NodeGpuSample]) -> GpuSummary | None:
        """From one reading of the nodes; None when no GPU reported a utilisation."""
        values: list[float] = []
        nodes = 0
        for sample in samples:
            read = [g.utilization_pct for g in sample.gpus if g.utilization_pct is not None]
            nodes += bool(read)
            values += read
        if not values:
            return None
        return cls(mean_pct=sum(values) / len(values), min_pct=min(values), max_pct=max(values), gpus=len(values),
                   nodes=nodes)

    def line(self) -> str:
        """``GPU 87% (2 nodes, min 80%)``: the mean, the nodes the GPUs are on, the least busy GPU."""
        return f"GPU {self.mean_pct:.0f}% ({self.nodes} node{'s' * (self.nodes != 1)}, min {self.min_pct:.0f}%)"


def metrics_file_due(*, ended: bool, console_step: int | None, file_step: int | None, log_complete: bool) -> bool:
    """Whether a poll reads verl's metrics file, given what the job's log showed.

    verl's console logger prints each step's metrics (the same numbers) to the log the waiter reads
    anyway, so once the log shows steps, the file is read only when the log showed a step the file
    has not given yet (its exact row, or a step the log's console line came without). Every poll
    reads it while the log shows no step (none yet, or a trainer without the console logger), when
    the last log read was not complete (failed, or bytes skipped: a step's line may be among them),
    and for the job's last look.

    :param console_step: the newest step of the log's console lines (None: none seen).
    :param file_step: the newest step of the file's rows (None: none read).
    """
    if ended or console_step is None or not log_complete:
        return True
    return file_step is None or console_step > file_step


#: The most of verl's metrics file read in one go (a reader far behind catches up over several reads).
METRICS_READ_BYTES = 1024 * 1024


class ProgressWatch:
    """The progress part of a wait: follows verl's steps from its console lines (in the log the wait
    reads anyway) and its metrics file, and says when a progress line is due.

    The file is read when the log shows a step the file has not given yet, and on every read while
    the log shows none (:func:`metrics_file_due`); its numbers are verl's exact ones. A line is due
    when a new step arrived and ``interval`` seconds passed since the last one, for the step that
    reaches the total, and for the last step of a job that ended.

    :param total: ``trainer.total_training_steps`` (0: unknown).
    :param metrics_path: verl's metrics JSONL of the attempt, when the triggerer can read it.
    :param progress: the last progress a previous waiter reached (:meth:`Progress.to_dict`).
    :param metrics_offset: bytes of ``metrics_path`` already read.
    :param interval: seconds between two progress lines.
    """

    def __init__(self, *, total: int, metrics_path: str | None, progress: dict[str, Any] | None,
                 metrics_offset: int, interval: float) -> None:
        self.total = total
        self.metrics_path = metrics_path
        self.interval = interval
        self.resume(progress, metrics_offset)
        # What the log and the file showed, for the file's reads.
        self._console_step: int | None = None
        self._file_step: int | None = None

    def resume(self, progress: dict[str, Any] | None, metrics_offset: int) -> None:
        """Continue from ``progress`` and ``metrics_offset`` (a cursor an earlier waiter saved)."""
        self.tracker = ProgressTracker(self.total, Progress.from_dict(progress))
        #: The last progress, as every event carries it.
        self.progress = progress
        self.metrics_offset_bytes = metrics_offset
        last = self.tracker.last
        self._reported_step = last.step if last else -1
        self._reported_at = float("-inf")

    def observe_lines(self, lines: list[str]) -> None:
        """verl's console metric lines among ``lines`` (the log's): each new step to the tracker."""
        for line in lines:
            if "step:" in line and (parsed := parse_console_line(line)) is not None:
                self._console_step = max(self._console_step or 0, parsed[0])
                self.tracker.observe(*parsed)

    def metrics_file_due(self, *, ended: bool, log_complete: bool) -> bool:
        return bool(self.metrics_path) and metrics_file_due(
            ended=ended, console_step=self._console_step, file_step=self._file_step, log_complete=log_complete)

    def read_metrics(self) -> list[str]:
        """New whole lines of verl's metrics JSONL (blocking file I/O: run in a thread)."""
        assert self.metrics_path is not None
        try:
            with open(self.metrics_path, "rb") as f:
                size = f.seek(0, 2)
                if size < self.metrics_offset_bytes:  # truncated: verl started the file again
                    self.metrics_offset_bytes = 0
                f.seek(self.metrics_offset_bytes)
                data = f.read(METRICS_READ_BYTES)
        except OSError:
            return []  # not written yet, or not on storage the triggerer mounts: console lines serve
        end = data.rfind(b"\n") + 1
        self.metrics_offset_bytes += end
        return data[:end].decode("utf-8", errors="replace").splitlines()

    def observe_rows(self, lines: list[str]) -> None:
        """Rows of verl's metrics file: each new step to the tracker."""
        for line in lines:
            parsed = parse_jsonl_row(line)
            if parsed is not None:
                self._file_step = max(self._file_step or 0, parsed[0])
                self.tracker.observe(*parsed)

    def unreported(self) -> Progress | None:
        """The last step seen, when no progress line has reported it yet (it becomes the progress events carry)."""
        last = self.tracker.last
        if last is None or last.step == self._reported_step:
            return None
        self.progress = last.to_dict()
        return last

    def line_due(self, last: Progress, now: float, *, final: bool = False) -> bool:
        """Whether ``last`` (from :meth:`unreported`) gets a progress line at ``now`` (monotonic); if so,
        it counts as reported. ``final``: the job ended, and this is its last step."""
        if final or last.reached_total or now - self._reported_at >= self.interval:
            self._reported_step, self._reported_at = last.step, now
            return True
        return False


def record_first_step(metrics_path: Path, progress: Progress) -> bool:
    """Keep when ``progress``'s job first logged a step, beside its metrics file; the first record
    stays (a reattached waiter saw the step later). True when written."""
    path = first_step_file(metrics_path)
    if progress.first_step_seen_at is None or path.exists():
        return False
    write_json_atomic(path, {"first_step_seen_at": progress.first_step_seen_at})
    return True


def first_step_seen_at(metrics_path: Path) -> float | None:
    """When the attempt whose metrics file this is first logged a step, as its waiter saw it (None: unknown)."""
    try:
        data = json.loads(first_step_file(metrics_path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    value = data.get("first_step_seen_at") if isinstance(data, dict) else None
    return float(value) if isinstance(value, int | float) else None
