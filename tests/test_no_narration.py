"""The project speaks of itself only: no file of it (docs, bench, tests, code, comments, configs) tells how it
was built instead of what it does and what was measured.

What counts as telling how the work went: numbered or device sessions and the plan for the next one,
work periods ("stop 33"), launches of a plan ("launch 5"), machines lent, leased or taken back and what a
call for one cost, numbered hosts ("a fifth host"), the device tool's ``$OUT`` and kit, issue numbers of
the tracker, and ``../shared`` (a folder beside the checkout that a user's clone does not have; a test
fixture may look there for data as long as it skips without it). A measurement says its figure, machine,
commit, date and command; that stays.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The folders and top-level files scanned (what a clone of the project holds, less data and images).
FOLDERS = ("bench", "configs", "dags", "docker", "docs", "include", "plugins", "tests", ".ci")
TOP_FILES = ("README.md", "CHANGELOG.md", "Makefile", "pyproject.toml", ".env.example", "docker-compose.yaml",
             "docker-compose.cpu.yaml", "requirements.txt")
SUFFIXES = frozenset({".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".j2", ".html"})
#: Files that name these patterns to test them.
SELF = frozenset({"tests/test_no_narration.py"})
#: Files whose narration is still to be removed: each must still narrate (see the test below), so an entry
#: goes once its file is clean.
PENDING = frozenset({
    "bench/gpu_acceptance.py",
    "bench/gpu_scaling.py",
    "bench/rollout_ceiling.py",
    "tests/bench/test_gpu_acceptance.py",
    "tests/e2e/compose_stack.py",
})

_ORDINAL = r"(?:second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth)"
#: What a line must not say, by what it is.
NARRATION: dict[str, re.Pattern[str]] = {
    "a session of the work": re.compile(
        rf"\b{_ORDINAL}\s+sessions?\b|\b(?:device|work|next|previous|earlier|later|this|that)\s+sessions?\b",
        re.IGNORECASE),
    "a plan for the next session": re.compile(r"\bplan for the next\b", re.IGNORECASE),
    "the device tool's time or kit": re.compile(
        r"\bdevice (?:time|minutes|seconds|budget|kit|tool|machine)\b|\bthe kit's\b|\.gpu/kit", re.IGNORECASE),
    "a lent machine": re.compile(r"\b(?:lent|lend|lender|lending|leased?|leases)\b", re.IGNORECASE),
    "a machine taken back": re.compile(
        r"\bmachine (?:went|goes|was taken|is taken) back\b|\bgave (?:it|the machine) back\b|\btaken back\b"
        r"|\bcalls? for a machine\b", re.IGNORECASE),
    "a numbered host": re.compile(rf"\b{_ORDINAL}\s+(?:H100\s+|H200\s+|GPU\s+)?(?:host|machine)\b", re.IGNORECASE),
    "a work period": re.compile(r"\bwork periods?\b|\bstop \d+\b|\b(?:this|previous|last|next) stop\b",
                                re.IGNORECASE),
    "a launch of a plan": re.compile(r"\blaunch(?:es)? \d+\b", re.IGNORECASE),
    "an issue of the tracker": re.compile(r"\bissues? ?#?\d+\b|\bissue-\d+\b", re.IGNORECASE),
    "the device tool's $OUT": re.compile(r"\$\{?OUT\b"),
    "a folder beside the checkout": re.compile(r"\.\./shared\b"),
}
#: A test file may look in ../shared for data, if it skips without it.
_SKIPS = re.compile(r"pytest\.skip\(|pytest\.mark\.skipif|skipif\(")


@dataclass(frozen=True)
class Finding:
    where: str
    line: int
    what: str
    text: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line}: {self.what}: {self.text.strip()[:140]}"


def files(root: Path = ROOT) -> Iterator[Path]:
    for name in TOP_FILES:
        if (root / name).is_file():
            yield root / name
    for folder in FOLDERS:
        for path in sorted((root / folder).rglob("*")):
            if path.is_file() and (path.suffix in SUFFIXES or path.name == "Makefile") \
                    and "__pycache__" not in path.parts:
                yield path


def findings_in(where: str, body: str) -> list[Finding]:
    """Every line of ``body`` that narrates, by what it says; ``where`` is the file's path in the project."""
    may_look_beside = where.startswith("tests/") and where.endswith(".py") and bool(_SKIPS.search(body))
    out = []
    for number, line in enumerate(body.splitlines(), 1):
        for what, pattern in NARRATION.items():
            if pattern.search(line) and not (what == "a folder beside the checkout" and may_look_beside):
                out.append(Finding(where, number, what, line))
    return out


def findings(root: Path = ROOT) -> list[Finding]:
    out = []
    for path in files(root):
        where = path.relative_to(root).as_posix()
        if where not in SELF:
            out += findings_in(where, path.read_text(errors="replace"))
    return out


def test_no_file_of_the_project_narrates_how_it_was_built() -> None:
    found = [f for f in findings() if f.where not in PENDING]
    assert not found, "narration (say what the software does and what was measured):\n" + "\n".join(map(str, found))
    assert sum(1 for _ in files()) > 200  # the scan reads the project (a broken walk would read nothing)


def test_each_pending_file_exists_and_still_narrates() -> None:
    narrating = {f.where for f in findings()}
    assert PENDING <= narrating, f"clean now, drop from PENDING: {sorted(PENDING - narrating)}"


def test_the_patterns_catch_narration_and_pass_what_the_software_does() -> None:
    narration = [
        "### 2026-12-06 (twelfth session): DAG, bare, DAG on one machine",
        "The plan for the next device session",
        "A session has 30 minutes of device time, of which the transfer takes 1 minute",
        "Twelve calls for a machine were refused; the thirteenth got one lent with 9 minutes left",
        "the machine went back between the last poll and the call that was to pack the files",
        "On a fifth host the same job took 91.2 s; on another H100 machine 46.5 s",
        "**2026-12-04 (stop 33: issues 35-39).** Same setup; this stop changed docs only",
        "Launch 2: the 0.5B GRPO job through the DAG (launch 6 ran the PPO pair)",
        "Configuration checks on the Airflow side (issue 5)",
        'cp -r /tmp/scaling/out "$OUT/"',
        "flash-attn from ../shared/gpu, the kit's site",
    ]
    for line in narration:
        assert findings_in("docs/x.md", line), line
    facts = [
        "One H100 80GB HBM3, 16 CPU cores, commit 83afff1, 2026-12-06: 67.17 s per steady step",
        "One Hydra session serves every compose; the trigger shares one HTTP session per event loop",
        "the session's local Ray cluster (the tests' one real cluster)",
        "it is verified again next time; a release of the lock; please note",
        "a node on another host; the host's per-core speed bounds generation",
        "the data under /shared/data (the compose stack's volume)",
    ]
    for line in facts:
        assert not findings_in("docs/x.md", line), line
    # A test fixture may look beside the checkout where it skips without it; nothing else may.
    fixture = 'GSM8K = REPO.parent / "shared"  # ../shared\npytest.skip("GSM8K not found")\n'
    assert not findings_in("tests/conftest.py", fixture)
    assert findings_in("bench/x.py", fixture) and findings_in("tests/x.py", fixture.splitlines()[0])
