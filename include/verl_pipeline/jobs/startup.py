"""What a wait keeps of its job's start, for the run report: when the first training step arrived.

The record lies beside the attempt's metrics file (``rundir.first_step_file``); the first record
stays, because a waiter that reattached later saw the step later.
"""

from __future__ import annotations

from pathlib import Path

from verl_pipeline.jobs.progress import Progress, record_first_step
from verl_pipeline.jobs.run_files import FileWrite


class FirstStepRecord:
    """The first-step part of a wait: once the job's first training step is seen, one write of when.

    :param metrics_path: the attempt's metrics file (None: nothing is recorded).
    """

    def __init__(self, metrics_path: str | None) -> None:
        self.metrics_path = metrics_path
        self._pending: Progress | None = None
        self._done = not metrics_path

    def step(self, progress: Progress) -> None:
        """A step was seen (the first one this waiter saw, or a later one)."""
        if not self._done:
            self._done = True  # once per waiter, written or not
            self._pending = progress

    def writes(self) -> list[FileWrite]:
        pending, self._pending = self._pending, None
        if pending is None or not self.metrics_path:
            return []
        path = Path(self.metrics_path)
        # Not writable from the triggerer: the report says the time is unknown.
        return [FileWrite("record when it logged its first step", lambda: record_first_step(path, pending),
                          lambda error: None)]
