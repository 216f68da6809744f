"""Track and stop exactly the processes the pipeline started (never ``ray stop``, never ``pkill``).

A process is identified by ``(pid, create_time)`` so a recycled PID is never signalled.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass

import psutil

log = logging.getLogger(__name__)


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


def terminate(refs: Iterable[ProcRef], *, grace_s: float = 10.0) -> list[ProcRef]:
    """SIGTERM every live ref, wait up to ``grace_s``, SIGKILL what is left.

    Returns the refs still alive after SIGKILL (normally empty).
    """
    live = {r: p for r in set(refs) if (p := r.process()) is not None}
    if not live:
        return []
    log.info("Stopping %d processes (SIGTERM): %s", len(live), sorted(r.pid for r in live))
    for p in live.values():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _gone, still = psutil.wait_procs(list(live.values()), timeout=grace_s)
    if still:
        log.warning("%d processes ignored SIGTERM for %.0fs; sending SIGKILL: %s", len(still), grace_s,
                    sorted(p.pid for p in still))
        for p in still:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(still, timeout=5)
    deadline = time.monotonic() + 5
    left = alive(live)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = alive(live)
    return left
