"""Track and stop exactly the processes the pipeline started (never ``ray stop``, never ``pkill``).

A process is identified by ``(pid, create_time)`` so a recycled PID is never signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)

#: How often a stop looks whether its processes have exited.
_POLL_S = 0.05
#: How long a SIGKILLed process has to be seen gone (the kernel tears down a large process in a moment).
_REAP_S = 5.0
#: How long a stage's processes have to act on SIGTERM even when an earlier stage used up the shared grace
#: period (a process that exits on SIGTERM needs a moment to be scheduled, and must not be SIGKILLed for
#: another stage's delay).
_STAGE_FLOOR_S = 1.0


@dataclass(frozen=True)
class ProcRef:
    pid: int
    create_time: float

    def to_list(self) -> list[float]:
        return [self.pid, self.create_time]

    @classmethod
    def from_list(cls, item: list[float] | tuple[float, float]) -> ProcRef:
        return cls(int(item[0]), float(item[1]))

    def process(self) -> psutil.Process | None:
        """The live process this ref names, or None when it exited (or the PID was reused)."""
        try:
            p = psutil.Process(self.pid)
            if abs(p.create_time() - self.create_time) > 0.01:
                return None
            if p.status() == psutil.STATUS_ZOMBIE:
                return None
            return p
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None


def ref_of(p: psutil.Process) -> ProcRef:
    return ProcRef(p.pid, p.create_time())


def tree(root_pid: int) -> list[ProcRef]:
    """``root_pid`` and all its live descendants."""
    try:
        root = psutil.Process(root_pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []
    out = []
    for p in procs:
        try:
            out.append(ref_of(p))
        except psutil.NoSuchProcess:
            continue
    return out


def in_process_group(pgid: int) -> list[ProcRef]:
    """Live processes whose process group is ``pgid`` (re-parented ones included)."""
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid:
                out.append(ref_of(p))
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            continue
    return out


def with_cmdline(fragment: str) -> list[ProcRef]:
    """Live processes whose command line contains ``fragment`` (e.g. a private temp dir)."""
    out = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        try:
            cmd = " ".join(p.info.get("cmdline") or [])
            if fragment in cmd and p.pid != os.getpid():
                out.append(ref_of(p))
        except psutil.NoSuchProcess:
            continue
    return out


def with_environ(key: str, value: str) -> list[ProcRef]:
    """Live processes whose environment has ``key=value``.

    Ray passes its environment down to everything it starts (raylet, workers, job drivers), and a
    job driver runs in a process group of its own that outlives a killed node: a marker variable
    set on ``ray start`` is what still ties it to its cluster.
    """
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(key) == value:
                out.append(ref_of(p))
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
    return out


def alive(refs: Iterable[ProcRef]) -> list[ProcRef]:
    return [r for r in refs if r.process() is not None]


def cmdlines(refs: Iterable[ProcRef]) -> dict[ProcRef, list[str]]:
    """The command line of each live ref (gone ones are left out)."""
    out = {}
    for ref in refs:
        p = ref.process()
        if p is None:
            continue
        try:
            out[ref] = p.cmdline()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


@dataclass(frozen=True)
class Stage:
    """Processes stopped together, once every earlier stage is gone."""

    name: str
    refs: tuple[ProcRef, ...]
    #: SIGKILL at once instead of SIGTERM: for a process known to ignore SIGTERM (or to spend the grace
    #: period on work that no longer matters), whose children earlier stages have already stopped.
    kill: bool = False


@dataclass(frozen=True)
class StopReport:
    """What :func:`stop_in_stages` did."""

    #: Processes that were alive when their stage began.
    stopped: int
    #: PIDs that were sent SIGKILL because they outlived the grace period (a SIGKILL stage's are not counted).
    killed_after_grace: tuple[int, ...]
    #: Still alive after SIGKILL (normally empty).
    left: tuple[ProcRef, ...]


def stop_in_stages(stages: Sequence[Stage], *, grace_s: float) -> StopReport:
    """Stop each stage's live processes, one stage after the other: SIGTERM and wait until they are gone
    (SIGKILL for a ``kill`` stage), SIGKILL whatever is left when the grace period runs out.

    One grace period for all stages together: a process that ignores SIGTERM delays the stop by at
    most ``grace_s`` in all, not once per stage; a stage that starts after it ran out still gives its
    processes ``_STAGE_FLOOR_S`` to exit.
    """
    deadline = time.monotonic() + grace_s
    stopped = 0
    late: list[int] = []
    left: list[ProcRef] = []
    for stage in stages:
        live = {r: p for r in dict.fromkeys(stage.refs) if (p := r.process()) is not None}
        if not live:
            continue
        stopped += len(live)
        log.info("Stopping %s (%s): %s", stage.name, "SIGKILL" if stage.kill else "SIGTERM",
                 sorted(r.pid for r in live))
        if not stage.kill:
            _signal(live, signal.SIGTERM)
            still = _wait_gone(live, max(deadline, time.monotonic() + _STAGE_FLOOR_S))
            if still:
                log.warning("%d of %s ignored SIGTERM for the %.0fs grace period; sending SIGKILL: %s", len(still),
                            stage.name, grace_s, sorted(r.pid for r in still))
                late += [r.pid for r in still]
        else:
            still = list(live)
        if still:
            _signal({r: live[r] for r in still}, signal.SIGKILL)
            left += _wait_gone(live, time.monotonic() + _REAP_S)
    return StopReport(stopped, tuple(late), tuple(left))


def _signal(live: dict[ProcRef, psutil.Process], sig: signal.Signals) -> None:
    for p in live.values():
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass


def _wait_gone(live: dict[ProcRef, psutil.Process], deadline: float) -> list[ProcRef]:
    """Wait until every process of ``live`` has exited (a zombie counts as exited; the ones that are
    this process's children are reaped), or ``deadline``; returns the refs still alive."""
    left = list(live)
    reaped: set[ProcRef] = set()
    while True:
        left = alive(left)
        for ref in live.keys() - set(left) - reaped:
            reaped.add(ref)
            try:
                live[ref].wait(timeout=0)  # reaps an exited child of ours (a zombie until then)
            except (psutil.TimeoutExpired, psutil.NoSuchProcess, ChildProcessError):
                pass
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(_POLL_S)
