"""The writes a waiter makes to the run directory, gathered from its parts and made in one trip off
the event loop.

Each part of a wait (the log cursor, the GPU samples, the start-up record) says what it has to
write this poll as a :class:`FileWrite`; the trigger runs them together in one thread, so a poll
costs the event loop at most one hand-off, and hands each failure back to the part that asked.
A write that fails never ends the wait: the storage may not be writable from the triggerer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class FileWrite:
    """One write of a part: what it is (for the warning), the blocking write, what the part does when it fails."""

    what: str
    write: Callable[[], object]
    failed: Callable[[OSError], None]


def write_all(writes: Iterable[FileWrite]) -> list[tuple[FileWrite, OSError]]:
    """Make every write (blocking file I/O: run in a thread); the ones that failed, with their error."""
    failed = []
    for w in writes:
        try:
            w.write()
        except OSError as e:
            failed.append((w, e))
    return failed
