"""Turning a job log read in byte ranges into whole lines, with a cursor that survives deferrals.

The cursor is a **byte offset into the job's driver log file** (``job-driver-<id>.log`` on the
driver's node): the end of the last whole line handed out. A reader is fed the bytes from the
cursor on, in chunks of any size; it keeps only the unfinished last line between chunks (bounded by
``max_line_bytes``), so a line or a multi-byte UTF-8 character split across two reads comes out
whole, exactly once, and the cursor never points into the middle of a line.

Two parts of a wait on a Ray job live here: :class:`LogFollower` reads the job's new output from
the cursor and forwards it, and :class:`CursorKeeper` saves the cursor (:class:`WaitCursor`) in the
run directory, so a restarted triggerer continues where the dead one stopped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from verl_pipeline.jobs.run_files import FileWrite
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import RunDir

#: A line longer than this is handed out in pieces of this size (cut on a UTF-8 boundary).
MAX_LINE_BYTES = 64 * 1024
#: Lines per forwarded log record (one record per batch keeps a chatty job cheap for the triggerer).
LINES_PER_RECORD = 200
#: Polls between two reads of a running job's log (the nodes are counted on the polls between). A
#: read costs a request whatever it brings, so a read every other poll, of twice the output, halves
#: what forwarding costs the triggerer; a new step is seen at most one poll later.
LOG_READ_EVERY_POLLS = 2
#: A chatty job's cursor is saved to the run directory at most this often (a quiet one's at once).
CURSOR_SAVE_INTERVAL_S = 30.0


class TaskLog(Protocol):
    """Where a wait's parts write for people: the trigger's logger (the Airflow task log), or any ``logging.Logger``."""

    def info(self, msg: str, /, *args: Any) -> Any: ...

    def warning(self, msg: str, /, *args: Any) -> Any: ...


def _utf8_cut(data: bytes, limit: int) -> int:
    """A cut ``<= limit`` (``limit < len(data)``) that does not split a UTF-8 character of ``data``."""
    cut = limit
    # Continuation bytes are 0b10xxxxxx; a character has at most 3 of them.
    for _ in range(3):
        if cut > 0 and (data[cut] & 0xC0) == 0x80:
            cut -= 1
        else:
            break
    return cut or limit


class LineReader:
    """Whole lines out of byte chunks read from ``start`` on.

    :param start: the byte offset the first chunk begins at (the cursor).
    :param mid_line: the first chunk starts inside a line (a read that skipped ahead): drop the
        bytes up to the first newline instead of handing out a fragment.
    """

    def __init__(self, start: int, *, mid_line: bool = False, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.cursor = start
        self.max_line_bytes = max_line_bytes
        self._pending = b""
        self._dropping = mid_line

    def feed(self, chunk: bytes) -> list[str]:
        """The whole lines ``chunk`` completes, decoded (invalid UTF-8 replaced), without newlines.

        A line longer than ``max_line_bytes`` comes out in pieces of at most that many bytes.
        """
        data = self._pending + chunk if self._pending else chunk
        end = data.rfind(b"\n") + 1
        lines: list[str] = []
        if end:
            block = data[:end]
            self.cursor += end
            if self._dropping:  # the rest of the line the read started inside
                self._dropping = False
                block = block[block.find(b"\n") + 1:]
            if block:
                lines = self._lines(block)
        rest = data[end:]
        while len(rest) > self.max_line_bytes:
            cut = _utf8_cut(rest, self.max_line_bytes)
            piece, rest = rest[:cut], rest[cut:]
            self.cursor += len(piece)
            if not self._dropping:
                lines.append(piece.decode("utf-8", errors="replace"))
        self._pending = rest
        return lines

    def _lines(self, block: bytes) -> list[str]:
        """The lines of ``block`` (whole lines, ending with a newline)."""
        parts = block[:-1].split(b"\n")
        if max(map(len, parts)) > self.max_line_bytes:
            return [piece for line in parts for piece in self._pieces(line.rstrip(b"\r"))]
        # One decode for the block: a newline is never part of a multi-byte character, so this
        # equals decoding line by line, for a fraction of the work per line.
        text = block[:-1].decode("utf-8", errors="replace")
        lines = text.split("\n")
        return [line.rstrip("\r") for line in lines] if "\r" in text else lines

    def _pieces(self, line: bytes) -> Iterator[str]:
        while len(line) > self.max_line_bytes:
            cut = _utf8_cut(line, self.max_line_bytes)
            yield line[:cut].decode("utf-8", errors="replace")
            line = line[cut:]
        yield line.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class WaitCursor:
    """How far a waiter got with one job: what the next deferral continues from.

    ``log_offset_bytes``: bytes of the driver log file forwarded (or skipped), at a line end;
    ``metrics_offset_bytes``: bytes of verl's metrics JSONL read; ``progress``: the last progress.
    Kept in the run directory, so a retry of the wait task (whose XCom starts empty) continues too.
    """

    job_id: str
    log_offset_bytes: int = 0
    metrics_offset_bytes: int = 0
    progress: dict[str, Any] | None = None

    @classmethod
    def from_event(cls, event: dict[str, Any]) -> WaitCursor:
        return cls(job_id=str(event.get("job_id", "")),
                   log_offset_bytes=int(event.get("log_offset_bytes") or 0),
                   metrics_offset_bytes=int(event.get("metrics_offset_bytes") or 0),
                   progress=event.get("progress"))

    def save(self, run_dir: Path) -> None:
        write_json_atomic(RunDir(run_dir).cursor_file, asdict(self))

    @classmethod
    def load(cls, run_dir: Path, job_id: str) -> WaitCursor:
        """The saved cursor of ``job_id``; a fresh one when none is saved or it is another job's."""
        try:
            data = json.loads(RunDir(run_dir).cursor_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            return cls(job_id=job_id)
        if data.get("job_id") != job_id:
            return cls(job_id=job_id)
        return cls(**data)


def where_the_log_is(*, dashboard_url: str, job_id: str, run_dir: str | None, driver_node_id: str | None) -> str:
    """Where a user reads a job's full log: its dashboard page, Ray's CLI (with the command that puts
    the run's cluster in the shell), and the file on the driver's node."""
    import shlex

    from verl_pipeline.jobs.client import JOB_LOG_FILE
    from verl_pipeline.jobs.ids import job_page_url

    # Ray's CLI needs the cluster's auth mode and token file besides its address (`--address` alone is
    # refused by a token-auth cluster): `verl-pipeline cluster env` prints all three for the run.
    run = (f"--run-dir {shlex.quote(run_dir)}" if run_dir
           else "--run-name <dag_id>/<run_id> --profile <the run's profile>")
    return (f"{job_page_url(dashboard_url, job_id)}, "
            f"`eval \"$(verl-pipeline cluster env {run})\"; ray job logs {job_id}`, or "
            f"{JOB_LOG_FILE.format(submission_id=job_id)} in the Ray log directory of node "
            f"{driver_node_id or '(the driver node)'}")


class LogFollower:
    """The log part of a wait: reads what the job wrote since the cursor, hands the lines to the other
    parts, forwards them to the task log and moves the cursor past every whole line read.

    The log is read on every other poll (:data:`LOG_READ_EVERY_POLLS`), on the first, on the one
    after a read that could not take everything, and on the poll that sees the job ended
    (:meth:`due`). At most ``max_lines_per_poll`` lines are forwarded and at most ``max_read_bytes``
    read per poll since the last read; the task log says what was left out and where the full log is.

    :param offset: the cursor (bytes of the driver log file already forwarded or skipped, at a line end).
    :param where: where the full log is, for the note on what was left out (:func:`where_the_log_is`).
    """

    def __init__(self, *, job_id: str, offset: int, max_lines_per_poll: int, max_read_bytes: int,
                 log: TaskLog, where: Callable[[Any], str]) -> None:
        self.job_id = job_id
        self.offset = offset
        self.max_lines_per_poll = max_lines_per_poll
        self.max_read_bytes = max_read_bytes
        self.log = log
        self.where = where
        #: The last read took everything there was (False: it failed, or left lines or bytes out).
        self.complete = True
        self._read_poll: int | None = None  # the poll that last read the log

    def due(self, poll: int, *, ended: bool) -> int | None:
        """Whether poll number ``poll`` reads the log: the polls its read covers (None: it does not read)."""
        last = self._read_poll
        polls = 1 if last is None else poll - last
        if not (ended or last is None or polls >= LOG_READ_EVERY_POLLS or not self.complete):
            return None
        self._read_poll = poll
        return polls

    async def read(self, hook: Any, info: Any, polls: int, *, lines_to: list[Callable[[list[str]], None]],
                   records_to: list[Callable[[str], None]]) -> None:
        """Forward the lines written since the cursor, ``polls`` polls' worth at most.

        :param lines_to: called with every batch of whole lines read (forwarded or not).
        :param records_to: called with the text of every record forwarded to the task log.
        """
        room = self.max_lines_per_poll * polls
        skipped = 0
        batch: list[str] = []
        async with hook.alog_stream(info, self.offset, max_bytes=self.max_read_bytes * polls) as stream:
            reader = LineReader(stream.start, mid_line=stream.mid_line)
            async for chunk in stream.chunks():
                lines = reader.feed(chunk)
                for observe in lines_to:
                    observe(lines)
                taken = lines[:room]
                batch += taken
                room -= len(taken)
                skipped += len(lines) - len(taken)
                while len(batch) >= LINES_PER_RECORD:
                    self._record(batch[:LINES_PER_RECORD], records_to)
                    batch = batch[LINES_PER_RECORD:]
            self.offset = reader.cursor
        if batch:
            self._record(batch, records_to)
        self.complete = not (skipped or stream.skipped_bytes)
        if not self.complete:
            what = [f"{skipped} lines not forwarded (over {self.max_lines_per_poll} per poll)"] if skipped else []
            if stream.skipped_bytes:
                what.append(f"{stream.skipped_bytes} bytes skipped (more than {self.max_read_bytes} new bytes)")
            self.log.warning("Ray job %s: %s; the full log: %s", self.job_id, ", ".join(what), self.where(info))

    def _record(self, lines: list[str], records_to: list[Callable[[str], None]]) -> None:
        """One task-log record for a batch of the job's lines."""
        text = "\n".join(lines)
        for observe in records_to:
            observe(text)
        self.log.info("[%s] %s", self.job_id, text)


class CursorKeeper:
    """Saves a wait's cursor in the run directory when it moved: on the first quiet read (the job
    printed nothing new), every :data:`CURSOR_SAVE_INTERVAL_S` while the job keeps printing (a chatty
    job does not cost a file write per poll), and when the job ended.

    :param run_dir: the run directory (None: not writable from the triggerer; nothing is saved).
    """

    def __init__(self, run_dir: str | None, job_id: str) -> None:
        self.run_dir = run_dir
        self.job_id = job_id
        self._saved: tuple[int, int] | None = None
        self._saved_at = float("-inf")

    def load(self) -> WaitCursor | None:
        """The cursor a previous waiter of this job saved (blocking file I/O); None when there is none."""
        if not self.run_dir:
            return None
        saved = WaitCursor.load(Path(self.run_dir), self.job_id)
        return saved if saved.log_offset_bytes or saved.metrics_offset_bytes else None

    def started_at(self, cursor: WaitCursor) -> None:
        """The waiter starts from ``cursor`` (nothing to save until it moves)."""
        self._saved = (cursor.log_offset_bytes, cursor.metrics_offset_bytes)

    def write(self, cursor: WaitCursor, *, moved: bool | None, final: bool = False) -> FileWrite | None:
        """The save of ``cursor``, when one is due.

        :param moved: whether this poll's read moved it (None: this poll did not read).
        :param final: the job ended (the last save of this waiter).
        """
        offsets = (cursor.log_offset_bytes, cursor.metrics_offset_bytes)
        if not self.run_dir or moved is None or offsets == self._saved:
            return None
        now = time.monotonic()
        if moved and not final and now - self._saved_at < CURSOR_SAVE_INTERVAL_S:
            return None
        self._saved_at = now
        run_dir = Path(self.run_dir)

        def save() -> None:
            cursor.save(run_dir)
            self._saved = offsets

        return FileWrite("save the log cursor", save, self._failed)

    def _failed(self, error: OSError) -> None:
        # Not writable from the triggerer: the deferral's cursor still serves.
        self.run_dir = None
