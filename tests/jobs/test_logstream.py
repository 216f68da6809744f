from __future__ import annotations

import asyncio
import itertools
import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from verl_pipeline.jobs.logstream import CursorKeeper, LineReader, LogFollower, WaitCursor
from verl_pipeline.jobs.run_files import write_all

LOG = ("step:1 - perf/throughput:1317.6\n"
       "naïve café → ✓ 🚀 done\n"
       "\n"
       "crlf line\r\n"
       "last whole line\n").encode()


def _read(data: bytes, start: int, cuts: list[int]) -> tuple[list[str], int]:
    """Lines a reader from ``start`` hands out when ``data[start:]`` arrives cut at ``cuts``."""
    reader = LineReader(start)
    lines: list[str] = []
    edges = [start, *sorted(c for c in cuts if start < c < len(data)), len(data)]
    for a, b in itertools.pairwise(edges):
        lines += reader.feed(data[a:b])
    return lines, reader.cursor


def test_a_line_and_a_character_split_at_any_byte_come_out_whole_once() -> None:
    expected = LOG.decode().replace("\r\n", "\n").splitlines()
    for cut in range(1, len(LOG)):  # every position, including inside each multi-byte character
        lines, cursor = _read(LOG, 0, [cut])
        assert lines == expected, cut
        assert cursor == len(LOG)


def test_an_unfinished_last_line_is_not_forwarded_and_the_cursor_stays_before_it() -> None:
    data = LOG + "half a line é".encode()[:-1]  # ends inside the last character, too
    lines, cursor = _read(data, 0, [7, 40])
    assert lines[-1] == "last whole line"
    assert cursor == len(LOG)


def test_cursor_across_deferrals_no_line_twice_none_lost() -> None:
    rng = random.Random(12)
    words = ["ascii", "é", "€uro", "🚀", "step:3 - x:1"]
    full = b"".join(f"{i} {' '.join(rng.choice(words) for _ in range(rng.randint(0, 6)))}\n".encode()
                    for i in range(400))
    written, cursor, got = 0, 0, []
    while cursor < len(full):
        # The job writes a little more (ending anywhere, even mid-character); a new waiter (a
        # re-deferral: only the cursor survives) reads from the cursor in chunks cut anywhere.
        written = min(len(full), written + rng.randint(1, 900))
        cuts = [rng.randint(cursor, written) for _ in range(rng.randint(0, 4))]
        lines, cursor = _read(full[:written], cursor, cuts)
        got += lines
        assert full[:cursor].endswith(b"\n") or cursor == 0
    assert got == full.decode().splitlines()


def test_a_read_that_jumped_ahead_drops_the_fragment_it_starts_in() -> None:
    data = b"0123456789\nnext line\n"
    reader = LineReader(4, mid_line=True)
    assert list(reader.feed(data[4:])) == ["next line"]
    assert reader.cursor == len(data)


def test_an_endless_line_is_cut_into_pieces_on_character_boundaries() -> None:
    line = ("é" * 100).encode()  # 200 bytes, 2 per character
    reader = LineReader(0, max_line_bytes=33)
    pieces = list(reader.feed(line[:101])) + list(reader.feed(line[101:] + b"\n"))
    assert "".join(pieces) == "é" * 100
    assert all("\ufffd" not in p for p in pieces)
    assert all(len(p.encode()) <= 33 for p in pieces)
    assert reader.cursor == len(line) + 1


def test_wait_cursor_round_trip_and_another_jobs_cursor_is_not_used(tmp_path: Path) -> None:
    event = {"job_id": "run-a1", "log_offset_bytes": 1234, "metrics_offset_bytes": 56,
             "progress": {"step": 3, "total": 10}}
    WaitCursor.from_event(event).save(tmp_path)
    loaded = WaitCursor.load(tmp_path, "run-a1")
    assert (loaded.log_offset_bytes, loaded.metrics_offset_bytes, loaded.progress) == (1234, 56, event["progress"])
    assert WaitCursor.load(tmp_path, "run-a2") == WaitCursor(job_id="run-a2")
    assert WaitCursor.load(tmp_path / "none", "run-a1") == WaitCursor(job_id="run-a1")


def test_a_block_of_lines_comes_out_as_line_by_line_decoding_gives_it() -> None:
    """Lines with CR LF, invalid UTF-8, an empty line and one over the piece size, in one chunk."""
    lines = [b"plain", b"crlf\r", b"bad \xff\xfe bytes", b"", b"cut \xe2\x82", b"\xe2\x82\xac euro", b"x" * 50, b"end"]
    data = b"\n".join(lines) + b"\n"
    reader = LineReader(0, max_line_bytes=40)
    expected = []
    for line in lines:
        line = line.rstrip(b"\r")
        while len(line) > 40:
            expected.append(line[:40].decode("utf-8", errors="replace"))
            line = line[40:]
        expected.append(line.decode("utf-8", errors="replace"))
    assert reader.feed(data) == expected and reader.cursor == len(data)
    short = LineReader(0)
    assert short.feed(data) == [line.rstrip(b"\r").decode("utf-8", errors="replace") for line in lines]


# -- the log part of a wait: LogFollower, CursorKeeper ------------------------------------------------
class _Body:
    def __init__(self, data: bytes) -> None:
        self.data = data

    async def iter_chunked(self, n: int) -> Any:
        for i in range(0, len(self.data), 5):  # cut anywhere: lines and characters split across chunks
            yield self.data[i:i + 5]


class _Hook:
    """The one method of the wait's hook the log part uses: the job's log from a byte offset."""

    def __init__(self, log: bytes) -> None:
        self.log = log
        self.starts: list[int] = []

    @asynccontextmanager
    async def alog_stream(self, info: Any, start: int, *, max_bytes: int) -> AsyncIterator[Any]:
        from verl_pipeline.jobs.client import LogSource, LogStream

        self.starts.append(start)
        yield LogStream(start=start, size=None, skipped_bytes=0, source=LogSource.AGENT, body=_Body(self.log[start:]))


def _follower(messages: list[str], *, offset: int = 0, max_lines: int = 1000) -> LogFollower:
    log = logging.getLogger(f"test.follower.{len(messages)}.{id(messages)}")
    log.setLevel(logging.INFO)
    log.addHandler(_Keep(messages))
    log.propagate = False
    return LogFollower(job_id="j", offset=offset, max_lines_per_poll=max_lines, max_read_bytes=1 << 20, log=log,
                       where=lambda info: "<where>")


class _Keep(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__()
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record.getMessage())


def test_the_log_part_reads_every_other_poll_and_whenever_the_job_ended_or_a_read_fell_short() -> None:
    follower = _follower([])
    assert [follower.due(p, ended=False) for p in range(1, 7)] == [1, None, 2, None, 2, None]
    assert follower.due(6, ended=True) == 1  # the poll that sees the end reads (again)
    follower.complete = False  # the last read left lines out: the next poll catches up
    assert follower.due(7, ended=False) == 1


def test_the_log_part_forwards_whole_lines_once_and_hands_every_line_to_the_other_parts() -> None:
    messages: list[str] = []
    follower = _follower(messages, max_lines=3)
    hook = _Hook("".join(f"line ✓ {i}\n" for i in range(5)).encode() + b"partial")
    seen: list[str] = []
    records: list[str] = []
    asyncio.run(follower.read(hook, None, 1, lines_to=[seen.extend], records_to=[records.append]))
    assert seen == [f"line ✓ {i}" for i in range(5)]  # every whole line, forwarded or not
    assert records == ["line ✓ 0\nline ✓ 1\nline ✓ 2"] and messages[0] == "[j] " + records[0]
    assert not follower.complete and "2 lines not forwarded (over 3 per poll); the full log: <where>" in messages[1]
    assert follower.offset == len(hook.log) - len(b"partial")  # past every whole line, not into the partial one
    asyncio.run(follower.read(hook, None, 2, lines_to=[], records_to=[]))
    assert hook.starts == [0, follower.offset] and follower.complete


def test_the_cursor_is_saved_when_it_moved_at_most_every_interval_while_the_job_prints(tmp_path: Path) -> None:
    keeper = CursorKeeper(str(tmp_path), "j")
    keeper.started_at(WaitCursor("j", 10, 0))

    def save(offset: int, moved: bool | None, final: bool = False) -> bool:
        write = keeper.write(WaitCursor("j", offset, 0), moved=moved, final=final)
        if write is not None:
            write.write()
        return write is not None

    assert not save(10, moved=False)  # did not move since the start
    assert save(20, moved=True)  # the first save of a chatty job
    assert not save(30, moved=True)  # within CURSOR_SAVE_INTERVAL_S of it
    assert not save(30, moved=None)  # a poll that did not read says nothing
    assert save(30, moved=False)  # the job went quiet: saved at once
    assert save(40, moved=True, final=True)  # the job ended
    assert WaitCursor.load(tmp_path, "j").log_offset_bytes == 40
    assert CursorKeeper(str(tmp_path), "j").load() == WaitCursor("j", 40, 0)
    assert CursorKeeper(str(tmp_path), "other").load() is None and CursorKeeper(None, "j").load() is None


def test_a_cursor_that_cannot_be_saved_is_not_tried_again(tmp_path: Path) -> None:
    keeper = CursorKeeper(str(tmp_path / "a-file"), "j")
    (tmp_path / "a-file").write_text("")  # the run directory is a file: every save fails
    failed = write_all([w for w in [keeper.write(WaitCursor("j", 5, 0), moved=False)] if w])
    assert len(failed) == 1 and failed[0][0].what == "save the log cursor"
    failed[0][0].failed(failed[0][1])
    assert keeper.run_dir is None and keeper.write(WaitCursor("j", 9, 0), moved=False) is None
