from __future__ import annotations

import itertools
import random
from pathlib import Path

from verl_pipeline.jobs.logstream import LineReader, WaitCursor

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
