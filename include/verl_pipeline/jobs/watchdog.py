"""What the waiter watches besides the job's status: steps (the hang watchdog) and the nodes.

**Hang.** A training job RUNNING with no new step for too long is hung. A collective waiting
forever on a peer (every node alive, the job RUNNING, no output) is the hang nothing else notices.
The rule, in one place:

- before the job's first step: ``startup_timeout`` (model loading, rollout engine start and the
  first rollout are slow; default 2 h);
- after a step: ``stall_timeout`` — fixed when the profile sets it, else derived from the step
  times seen: ``max(min_stall_timeout, stall_factor * the slowest step)`` (default
  ``max(30 min, 5 * slowest)``), so a run whose steps take 20 min is not cut at 30.

Times are the waiter's monotonic clock: the windows start when a waiter starts watching, so a
restarted triggerer (whose waiter starts afresh) waits at most one more window, never less.

A hang carries the cluster's GPUs as last read from Ray's node summary (a
:class:`~verl_pipeline.jobs.progress.GpuSummary`): GPUs idle at ~0% and GPUs busy at ~100% with no
new step point to different causes, and the hang's message says which.

**Nodes.** :class:`NodeWatch` counts a cluster's live nodes (on a cluster the pipeline owns) and
says when one is lost: fewer alive than provisioned on ``grace_polls`` counts in a row.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

from verl_pipeline.durations import format_duration
from verl_pipeline.jobs.progress import GpuSummary
from verl_pipeline.spec import WatchSettings

#: Polls between two node counts while every node is alive. A loss is then seen at most one poll
#: later than by a count every poll, and confirmed by counts every poll from then on.
NODE_COUNT_EVERY_POLLS = 2
#: Words of a log line that make the waiter count the nodes on this poll: Ray's messages of a node,
#: raylet, actor, worker or owner going away say "died" or "dead" (``NodeDiedError``, "has been
#: marked dead", ``ActorDiedError``, "raylet died" …). A false alarm costs one count.
NODE_TROUBLE_WORDS = ("died", "Died", "dead")
#: Utilisation at or below which a GPU counts as idle, and at or above which it counts as busy.
GPU_IDLE_PCT, GPU_BUSY_PCT = 10.0, 90.0


class GpuActivity(str, Enum):
    """What the cluster's GPUs were doing when the hang was found."""

    #: Every GPU idle: nothing runs on them.
    IDLE = "idle"
    #: Every GPU busy: kernels run, and no step finishes.
    BUSY = "busy"
    #: Some busy, some idle.
    UNEVEN = "uneven"


#: What each kind of GPU activity during a hang points to, for the person who reads the message.
_GPU_CAUSES = {
    GpuActivity.IDLE: "nothing runs on them: the job waits outside the GPUs — on data, on a rollout or reward "
                      "worker, on a Ray call to an actor that died, or on a peer that is gone",
    GpuActivity.BUSY: "kernels run and no step ends: a very long step (e.g. generation of very long responses) or "
                      "a kernel that spins — an NCCL collective waiting for a peer that never joins spins at 100%",
    GpuActivity.UNEVEN: "the busy GPUs are likely spinning in a collective that waits for the idle ones; look at "
                        "what the processes of the idle GPUs are doing (e.g. py-spy dump)",
}


def gpu_activity(gpu: GpuSummary) -> GpuActivity:
    """Idle when every GPU is, busy when every GPU is, else uneven."""
    if gpu.max_pct <= GPU_IDLE_PCT:
        return GpuActivity.IDLE
    if gpu.min_pct >= GPU_BUSY_PCT:
        return GpuActivity.BUSY
    return GpuActivity.UNEVEN


def gpu_evidence(gpu: GpuSummary) -> str:
    """``GPUs idle (0% to 2%, mean 1% on 16 GPUs of 2 nodes): <what that points to>``."""
    activity = gpu_activity(gpu)
    where = f"{gpu.gpus} GPU{'s' * (gpu.gpus != 1)} of {gpu.nodes} node{'s' * (gpu.nodes != 1)}"
    return (f"GPUs {activity.value} ({gpu.min_pct:.0f}% to {gpu.max_pct:.0f}%, mean {gpu.mean_pct:.0f}% on {where}): "
            f"{_GPU_CAUSES[activity]}")


@dataclass(frozen=True)
class Hang:
    """A job hung: what the wait's decision reads (carried in the trigger event's ``hang``)."""

    #: The last training step seen; None: no step yet (the startup window ran out).
    last_step: int | None
    #: Seconds without a new step: since the last one, or since watching began before the first.
    waited_s: float
    #: The limit that ran out: the stall limit after a step, ``startup_timeout_s`` before the first.
    limit_s: float
    #: The cluster's GPUs when the hang was found; None: not read (no GPU, or a cluster not watched).
    gpu: GpuSummary | None = None

    @property
    def reason(self) -> str:
        """What happened, as the decision names the failure (and the stop record keeps it)."""
        if self.last_step is None:
            return f"hang: no training step within {format_duration(self.waited_s)} of the start"
        return f"hang: no training step for {format_duration(self.waited_s)}, last step {self.last_step}"

    @property
    def limit(self) -> str:
        """The limit that ran out, named as the run profile's ``watch:`` sets it."""
        if self.last_step is None:
            return f"watch.startup_timeout {format_duration(self.limit_s)}"
        return f"stall limit {format_duration(self.limit_s)}"

    @property
    def detail(self) -> str:
        """The limit that ran out, and what the GPUs were doing."""
        return self.limit + (f"; {gpu_evidence(self.gpu)}" if self.gpu is not None else "")

    @property
    def message(self) -> str:
        return f"{self.reason} ({self.detail})"

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Hang | None:
        """From an event's ``hang`` (None: absent, as in events of triggers of an earlier release)."""
        if not isinstance(data, dict):
            return None
        last = data.get("last_step")
        gpu = data.get("gpu")
        return cls(last_step=None if last is None else int(last), waited_s=float(data["waited_s"]),
                   limit_s=float(data["limit_s"]), gpu=GpuSummary(**gpu) if isinstance(gpu, dict) else None)


class StallWatch:
    """Follows one job's steps on a caller-supplied clock; :meth:`hang` says when it is hung.

    :param started_at: when watching began (the startup window's start).
    :param last_step: the step a previous waiter had seen (a reattach): counts as a step seen now.
    """

    def __init__(self, settings: WatchSettings, started_at: float, last_step: int | None = None) -> None:
        self.settings = settings
        self.started_at = started_at
        self.last_step = last_step
        self.last_step_at: float | None = started_at if last_step is not None else None
        self.slowest_s: float | None = None

    def step(self, step: int, now: float, seconds: float | None = None) -> None:
        """A step newer than any seen arrived at ``now``; ``seconds``: its duration as verl reports it."""
        if self.last_step is not None and step <= self.last_step:
            return
        gap = now - self.last_step_at if self.last_step_at is not None else None
        for value in (seconds, gap):
            if value is not None and value > 0:
                self.slowest_s = max(self.slowest_s or 0.0, value)
        self.last_step, self.last_step_at = step, now

    def hang(self, now: float) -> Hang | None:
        """The hang at ``now``, or None while the job is within its window (the caller adds the GPUs' reading)."""
        if self.last_step_at is None:
            waited = now - self.started_at
            if waited > self.settings.startup_timeout_s:
                return Hang(last_step=None, waited_s=waited, limit_s=self.settings.startup_timeout_s)
            return None
        waited = now - self.last_step_at
        limit = self.settings.stall_limit(self.slowest_s)
        if waited > limit:
            return Hang(last_step=self.last_step, waited_s=waited, limit_s=limit)
        return None


class NodeWatch:
    """Counts a cluster's live nodes at a cadence and says when one is lost.

    While every node is alive the nodes are counted every :data:`NODE_COUNT_EVERY_POLLS` polls (from
    the second: the waiter reads the job's log on the others), or at once when the poll gives a reason
    (the job's log speaks of something that died); once a count comes up short, every poll, and
    ``grace_polls`` short counts in a row mean a node is lost. A loss is therefore reported at most one
    poll later than by counting every poll (``grace_polls + 1`` polls after it at most), and a blip
    shorter than the grace is never reported.

    :param expected: the nodes the cluster was provisioned with.
    :param grace_polls: short counts in a row that mean a node is lost.
    """

    def __init__(self, expected: int, grace_polls: int) -> None:
        self.expected = expected
        self.grace_polls = grace_polls
        self.short_counts = 0
        self._polls_since_count = 0

    def due(self, *, reason: bool = False) -> bool:
        """Whether this poll counts the nodes (call once per poll)."""
        self._polls_since_count += 1
        return reason or self.short_counts > 0 or self._polls_since_count >= NODE_COUNT_EVERY_POLLS

    def counted(self, alive: int) -> bool:
        """``alive`` nodes were counted on this poll; True when a node is lost."""
        self._polls_since_count = 0
        self.short_counts = self.short_counts + 1 if alive < self.expected else 0
        return self.short_counts >= self.grace_polls


def speaks_of_a_death(text: str) -> bool:
    """Whether log ``text`` says that something died or is dead (a reason to count the nodes now)."""
    return any(word in text for word in NODE_TROUBLE_WORDS)
