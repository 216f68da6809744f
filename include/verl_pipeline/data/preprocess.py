"""Convert a data source to verl's parquet rows (the ``gsm8k`` recipe), atomically and idempotently.

verl's row schema: ``data_source`` (selects the reward function), ``prompt`` (chat messages),
``ability``, ``reward_model`` ``{"style": "rule", "ground_truth": …}`` and ``extra_info``.
Outputs live in a directory named by a hash of the inputs and options: an unchanged re-run finds
them and does no work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from verl_pipeline.config import DataSource
from verl_pipeline.data.generator import generate_problems
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.paths import write_json_atomic

log = logging.getLogger(__name__)

#: Bump when the rows this module writes change, so cached outputs are rebuilt.
RECIPE_VERSION = "gsm8k-v1"
DATA_SOURCE = "openai/gsm8k"
# verl's GSM8K example appends this so the model answers in the `#### N` form the scorer reads.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
_ANSWER = re.compile(r"####\s*(-?[0-9][0-9,]*(?:\.[0-9]+)?)\s*$")

ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                       ("question", pa.string())]),
        ),
    ]
)


@dataclass
class PreprocessResult:
    train_path: str
    val_path: str
    output_dir: str
    key: str
    cached: bool
    counts: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def extract_ground_truth(answer: str) -> str | None:
    """The number after ``####`` on the answer's last line, commas removed (GSM8K's convention)."""
    m = _ANSWER.search(answer.strip())
    return m.group(1).replace(",", "") if m else None


def _records(source: DataSource, options: dict[str, Any]) -> dict[str, Iterator[tuple[int, Any]]]:
    """``{split: iterator of (source line number, raw record)}``."""
    if source.kind == "builtin":
        seed = int(options.get("seed", 0))
        n_train = int(options.get("train_size", 256))
        n_val = int(options.get("val_size", 32))
        train = ((i + 1, asdict(p)) for i, p in enumerate(generate_problems(n_train, seed=seed)))
        val = ((i + 1, asdict(p)) for i, p in enumerate(generate_problems(n_val, seed=seed + 1_000_003)))
        return {"train": train, "val": val}
    path = Path(source.ref)
    if path.is_dir():
        splits = {"train": path / "train.jsonl"}
        if (path / "test.jsonl").is_file():
            splits["val"] = path / "test.jsonl"
        return {name: _jsonl(p) for name, p in splits.items()}
    return {"all": _jsonl(path)}


def _jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield lineno, json.loads(line)
            except json.JSONDecodeError as e:
                yield lineno, DataError(f"{path.name}:{lineno}: not valid JSON ({e.msg})")


def _to_row(record: Any, split: str, index: int) -> tuple[dict[str, Any] | None, str | None]:
    """A verl row, or ``(None, reason)`` for a rejected record."""
    if isinstance(record, Exception):
        return None, "invalid_json"
    if not isinstance(record, dict):
        return None, "not_an_object"
    question, answer = record.get("question"), record.get("answer")
    if not isinstance(question, str) or not isinstance(answer, str):
        return None, "missing_question_or_answer"
    if not question.strip():
        return None, "empty_prompt"
    truth = extract_ground_truth(answer)
    if truth is None:
        return None, "no_ground_truth"
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": f"{question.strip()} {INSTRUCTION}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": split, "index": index, "answer": answer, "question": question},
    }, None


def _input_key(source: DataSource, options: dict[str, Any]) -> str:
    h = hashlib.sha256()
    h.update(f"{RECIPE_VERSION}\0{source}\0{json.dumps(options, sort_keys=True)}".encode())
    if source.kind != "builtin":
        path = Path(source.ref)
        files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
        for f in files:
            h.update(f.name.encode())
            with open(f, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def preprocess(source: DataSource, options: dict[str, Any], out_root: Path) -> PreprocessResult:
    """Write ``train.parquet`` and ``val.parquet`` for ``source`` under ``out_root``.

    Rejected records go to ``rejects.jsonl`` with their line number and reason; any reject above
    ``options["max_reject_fraction"]`` (default 0) fails the step.
    """
    t0 = time.monotonic()
    known = {"train_size", "val_size", "seed", "val_fraction", "max_reject_fraction"}
    for key in options:
        if key not in known:
            raise ConfigError(f"data.{key}", options[key], "unknown data option", f"use one of {sorted(known)}")
    key = _input_key(source, options)
    out_dir = out_root / f"{RECIPE_VERSION}-{key}"
    stats_path = out_dir / "stats.json"
    if stats_path.is_file():
        counts = json.loads(stats_path.read_text())
        log.info("Preprocessed data already present (key %s) in %s: nothing to do", key, out_dir)
        return PreprocessResult(str(out_dir / "train.parquet"), str(out_dir / "val.parquet"), str(out_dir), key,
                                True, counts, round(time.monotonic() - t0, 3))

    tmp_dir = out_root / f".{out_dir.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    rows: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    rejects: Counter[str] = Counter()
    seen = 0
    try:
        with open(tmp_dir / "rejects.jsonl", "w", encoding="utf-8") as rej:
            for split, records in _records(source, options).items():
                for lineno, record in records:
                    seen += 1
                    target = split
                    if split == "all":
                        # Deterministic split of a single file: every k-th record goes to val.
                        every = max(2, round(1 / float(options.get("val_fraction", 0.1))))
                        target = "val" if lineno % every == 0 else "train"
                    row, reason = _to_row(record, target, len(rows[target]))
                    if row is None:
                        rejects[str(reason)] += 1
                        rej.write(json.dumps({"split": split, "line": lineno, "reason": reason}) + "\n")
                        continue
                    rows[target].append(row)
        max_frac = float(options.get("max_reject_fraction", 0.0))
        n_rej = sum(rejects.values())
        if seen == 0:
            raise DataError(f"data source {source} has no records")
        if n_rej / seen > max_frac:
            kept = out_root / f"rejects-{key}.jsonl"
            shutil.copyfile(tmp_dir / "rejects.jsonl", kept)
            raise DataError(
                f"{n_rej} of {seen} records rejected ({dict(rejects)}), more than max_reject_fraction={max_frac}; "
                f"see {kept}"
            )
        if not rows["train"] or not rows["val"]:
            raise DataError(f"data source {source} gave {len(rows['train'])} train / {len(rows['val'])} val rows; "
                            "both splits need rows")
        for split in ("train", "val"):
            table = pa.Table.from_pylist(rows[split], schema=ROW_SCHEMA)
            pq.write_table(table, tmp_dir / f"{split}.parquet")
        counts = {"records_in": seen, "train_rows": len(rows["train"]), "val_rows": len(rows["val"]),
                  "rejected": dict(rejects), "data_source": DATA_SOURCE, "recipe": RECIPE_VERSION,
                  "source": str(source)}
        write_json_atomic(tmp_dir / "stats.json", counts)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not stats_path.is_file():
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)  # a concurrent run wrote the same outputs first
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log.info("Preprocessed %s: %d train / %d val rows, %d rejected, into %s", source, counts["train_rows"],
             counts["val_rows"], sum(rejects.values()), out_dir)
    return PreprocessResult(str(out_dir / "train.parquet"), str(out_dir / "val.parquet"), str(out_dir), key,
                            False, counts, round(time.monotonic() - t0, 3))
