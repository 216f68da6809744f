"""Where each Ray actor of a job's start spent its time, from Ray's own records of it.

The start-up phases (:mod:`verl_pipeline.jobs.startup.phases`) say when verl's and vLLM's lines came, not why a
phase took long. Each phase of a verl start is also Ray actors coming up, one after another: the
TaskRunner, the worker group (``WorkerDict``), the rollout servers (``vLLMHttpServer``), the agent loop
workers. A restart starts every one of them again. Ray records, for each actor it creates, when it was
asked for, when the raylet launched its worker process and when that process was ready, when the
actor's class had loaded (``task:deserialize_arguments`` comes right after: the class's module and its
imports are loaded first) and when ``__init__`` returned. So each actor's start splits into:

- **waiting**: from the request to the worker's launch (free resources, the runtime env);
- **process**: the worker process's start, to the moment it can take the actor (0 when the raylet
  gave it a worker that was already running: ``reused``);
- **class load**: loading the actor's class. Where the class is importable (verl's worker classes are:
  its ``WorkerDict`` is built from them) that is importing its module and all that module imports
  (torch, vLLM, verl); a class Ray sends by value (one decorated with ``@ray.remote`` where it is
  defined, or defined in the driver's script) loads at once, and what it imports counts in its init;
- **init**: the actor's ``__init__``.

Ray's state API serves the records: ``/api/v0/tasks`` (type ``ACTOR_CREATION_TASK``, by the job's Ray id)
and ``/api/v0/workers`` (:meth:`~verl_pipeline.jobs.client.RayJobsClient.aactor_starts`). This module is
pure: Ray's records in, one :class:`ActorStart` per actor and one :class:`ClassStarts` per class out,
as the run directory keeps them and the report and the task log show them. A part Ray did not record
(task events turned off, a worker record gone) is unknown, never guessed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

#: The profiling event Ray records once the actor's class is loaded, just before ``__init__`` runs.
CLASS_LOADED_EVENT = "task:deserialize_arguments"
#: Ray's states of a task, in the order an actor's creation goes through them.
ASKED, RUNNING, FINISHED, FAILED = "PENDING_ARGS_AVAIL", "RUNNING", "FINISHED", "FAILED"


@dataclass(frozen=True)
class ActorStart:
    """One actor's start, in seconds (None: Ray did not record it)."""

    cls: str
    #: The node's IP address the actor ran on ("" when unknown).
    node: str
    #: When the actor was asked for, after the job's submission.
    asked_s: float
    #: From the request to the moment it began to load its class: waiting plus the worker process.
    before_s: float | None
    #: The worker process's start (0 for a reused worker); part of ``before_s``.
    process_s: float | None
    #: Loading the actor's class: its module's imports.
    load_s: float | None
    init_s: float | None
    #: When ``__init__`` returned, after the job's submission (None: it did not, or not yet).
    ready_s: float | None
    #: The worker was already running when the actor was asked for.
    reused: bool = False
    failed: bool = False

    @property
    def settled(self) -> bool:
        """Ray's record of it is whole: it failed, or it was ready and both when it began and when it ended
        loading its class are known. Ray sends an actor's state events and its profiling events (the class
        load, the node, the worker) apart, each about once a second, so an actor made just before a read may
        be part-recorded: ready, with its class load and node not yet known (seen in CI, 2026-12-05)."""
        return self.failed or (self.ready_s is not None and self.before_s is not None and self.load_s is not None)

    @property
    def waiting_s(self) -> float | None:
        """From the request to the worker's launch: free resources, the runtime env."""
        if self.before_s is None or self.process_s is None:
            return None
        return max(0.0, self.before_s - self.process_s)


def _ms(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and value > 0 else None


def _span(start: float | None, end: float | None) -> float | None:
    return None if start is None or end is None else max(0.0, end - start) / 1000


def _worker_ms(worker: Mapping[str, Any] | None) -> tuple[float | None, float | None]:
    """The worker's launch and ready times (epoch ms), None where Ray has none."""
    if not worker:
        return None, None
    return _ms(worker.get("worker_launch_time_ms")), _ms(worker.get("start_time_ms"))


def actor_start(task: Mapping[str, Any], workers: Mapping[str, Mapping[str, Any]], submitted_ms: float) -> ActorStart:
    """One actor's start from Ray's record of its creation task (``detail=1``) and the workers by id."""
    events = {e.get("state"): _ms(e.get("created_ms")) for e in task.get("events") or [] if isinstance(e, dict)}
    asked = events.get(ASKED) or _ms(task.get("creation_time_ms")) or submitted_ms
    running = events.get(RUNNING) or _ms(task.get("start_time_ms"))
    ended = events.get(FINISHED) or (_ms(task.get("end_time_ms")) if task.get("state") == FINISHED else None)
    found = task.get("profiling_data")
    profiling: Mapping[str, Any] = found if isinstance(found, dict) else {}
    loaded = [e for e in profiling.get("events") or []
              if isinstance(e, dict) and e.get("event_name") == CLASS_LOADED_EVENT]
    load_end = _ms(loaded[0].get("start_time")) if loaded else None
    init_start = _ms(loaded[0].get("end_time")) if loaded else None
    launch, ready = _worker_ms(workers.get(str(profiling.get("component_id") or task.get("worker_id") or "")))
    reused = launch is not None and launch < asked
    process = 0.0 if reused else _span(launch, ready)
    return ActorStart(
        cls=str(task.get("func_or_class_name") or task.get("name") or "?").removesuffix(".__init__"),
        node=str(profiling.get("node_ip_address") or ""),
        asked_s=max(0.0, asked - submitted_ms) / 1000,
        before_s=_span(asked, running), process_s=process, load_s=_span(running, load_end),
        init_s=_span(init_start, ended), ready_s=_span(submitted_ms, ended),
        reused=reused, failed=task.get("state") == FAILED,
    )


def from_ray(tasks: Iterable[Mapping[str, Any]], workers: Iterable[Mapping[str, Any]],
             submitted_ms: float) -> list[ActorStart]:
    """Every actor a job created, in the order it asked for them, from Ray's records (its state API)."""
    by_id = {str(w["worker_id"]): w for w in workers if isinstance(w, Mapping) and w.get("worker_id")}
    starts = [actor_start(t, by_id, submitted_ms) for t in tasks if isinstance(t, Mapping)]
    return sorted(starts, key=lambda a: a.asked_s)


@dataclass(frozen=True)
class ClassStarts:
    """The actors of one class in one start (``WorkerDict`` x 8): the slowest gates what comes next."""

    name: str
    actors: tuple[ActorStart, ...]

    @property
    def first_asked_s(self) -> float:
        return min(a.asked_s for a in self.actors)

    @property
    def last_ready_s(self) -> float | None:
        """When the last of them was ready (None: one never was)."""
        ready = [a.ready_s for a in self.actors]
        return None if any(r is None for r in ready) else max(r for r in ready if r is not None)

    def spread(self, part: str) -> tuple[float, float] | None:
        """The median and the largest of one part (``waiting_s``, ``process_s``, ``load_s``, ``init_s``)
        over the actors that have it; None when none does."""
        known = [v for v in (getattr(a, part) for a in self.actors) if v is not None]
        return (statistics.median(known), max(known)) if known else None

    def cell(self, part: str) -> str:
        """``25 s``, or ``25 s (slowest 31 s)`` for several actors; ``unknown`` where Ray recorded none."""
        spread = self.spread(part)
        if spread is None:
            return "unknown"
        median, top = (f"{v:.0f}" for v in spread)
        return f"{median} s" + (f" (slowest {top} s)" if top != median else "")

    def text(self) -> str:
        """One line for the task log."""
        ready = self.last_ready_s
        failed = sum(a.failed for a in self.actors)
        return (f"{self.name} x {len(self.actors)}: asked {self.first_asked_s:.0f} s after submission, "
                + (f"ready at {ready:.0f} s" if ready is not None else f"not ready ({failed} failed)" if failed
                   else "not all ready")
                + f" (waiting {self.cell('waiting_s')} · process {self.cell('process_s')} · class load "
                f"{self.cell('load_s')} · __init__ {self.cell('init_s')})")


def by_class(starts: Iterable[ActorStart]) -> list[ClassStarts]:
    """The actors grouped by class, in the order each class was first asked for."""
    groups: dict[str, list[ActorStart]] = {}
    for a in sorted(starts, key=lambda a: a.asked_s):
        groups.setdefault(a.cls, []).append(a)
    return [ClassStarts(name, tuple(actors)) for name, actors in groups.items()]


def to_record(starts: Iterable[ActorStart]) -> dict[str, Any]:
    return {"actors": [asdict(a) for a in starts]}


def load(path: Path) -> list[ActorStart] | None:
    """The actor starts recorded at ``path`` (None when absent or unreadable: nothing was recorded)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return [ActorStart(**a) for a in data["actors"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
