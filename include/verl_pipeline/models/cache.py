"""The shared model cache: writability, free space, per-model file locks and download progress in the log."""

from __future__ import annotations

import errno
import logging
import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from verl_pipeline.exceptions import ModelError
from verl_pipeline.paths import free_bytes

log = logging.getLogger(__name__)

#: How often a waiting or downloading task says so in its log.
LOG_EVERY_S = 10.0


def ensure_writable(root: Path) -> None:
    """Create ``root`` and prove a file can be written there; a clear ModelError otherwise."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=root)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ModelError(
            f"model cache root {root} is not writable ({e.strerror or e}): fix its permissions for user "
            f"{_user()}, or set storage.root in the cluster profile to shared storage this worker can write"
        ) from None


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def check_free_space(path: Path, needed: int, what: str) -> None:
    free = free_bytes(path)
    if needed > free:
        raise ModelError(f"disk full: {what} needs {_human(needed)} more but only {_human(free)} is free at "
                         f"{path}; free space or point storage.root of the cluster profile at a larger volume")


def disk_full_error(e: OSError, path: Path, what: str) -> ModelError | None:
    """The ModelError for an out-of-space OSError during a download, else None."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return ModelError(f"disk full while fetching {what} into {path} ({e.strerror}); files already complete "
                          "are kept and a rerun resumes after space is freed")
    return None


@contextmanager
def model_lock(lock_path: Path, what: str, timeout_s: float = 24 * 3600) -> Iterator[None]:
    """Hold an exclusive file lock for one model: two runs fetching it at once take turns."""
    from filelock import FileLock, Timeout

    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(lock_path))
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            lock.acquire(timeout=LOG_EVERY_S)
            break
        except Timeout:
            if time.monotonic() > deadline:
                raise ModelError(f"gave up waiting {timeout_s:.0f}s for another prefetch of {what} "
                                 f"(lock {lock_path})") from None
            log.info("Waiting for another prefetch of %s to finish (lock %s)", what, lock_path)
    try:
        yield
    finally:
        lock.release()


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


class ProgressLog:
    """Logs ``label: X of Y (P%) at R/s`` every ``LOG_EVERY_S`` seconds and at the end."""

    def __init__(self, label: str, total: int, every_s: float = LOG_EVERY_S) -> None:
        self.label = label
        self.total = total
        self.done = 0
        self.every_s = every_s
        self._t0 = time.monotonic()
        self._last = self._t0

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._log(now)

    def finish(self) -> None:
        self._log(time.monotonic())

    def _log(self, now: float) -> None:
        pct = 100.0 * self.done / self.total if self.total else 100.0
        rate = self.done / max(now - self._t0, 1e-6)
        log.info("%s: %s of %s (%.1f%%) at %s/s", self.label, _human(self.done), _human(self.total), pct,
                 _human(rate))


__all__ = ["LOG_EVERY_S", "ProgressLog", "check_free_space", "disk_full_error", "ensure_writable",
           "model_lock"]
