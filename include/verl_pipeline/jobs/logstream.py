"""Turning a job log read in byte ranges into whole lines, with a cursor that survives deferrals.

The cursor is a **byte offset into the job's driver log file** (``job-driver-<id>.log`` on the
driver's node): the end of the last whole line handed out. A reader is fed the bytes from the
cursor on, in chunks of any size; it keeps only the unfinished last line between chunks (bounded by
``max_line_bytes``), so a line or a multi-byte UTF-8 character split across two reads comes out
whole, exactly once, and the cursor never points into the middle of a line.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.paths import write_json_atomic
from verl_pipeline.rundir import RunDir

#: A line longer than this is handed out in pieces of this size (cut on a UTF-8 boundary).
MAX_LINE_BYTES = 64 * 1024


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
