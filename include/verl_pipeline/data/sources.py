"""Read a data source as Arrow record batches of the recipe's columns, with source row numbers.

Sources: the built-in generator; local files, globs and directories; fsspec URLs (``s3://``,
``gs://``, ``memory://``, ``file://`` …); HuggingFace datasets by name (``hf://name?config=…``) or
saved with ``save_to_disk``. Formats: JSONL (``.jsonl``/``.ndjson``, or ``.json`` holding lines),
JSON arrays, CSV and Parquet, optionally compressed (``.gz``, ``.bz2``, ``.xz``, ``.zst``).

Every batch carries, per row, the source row number (1-based line for JSON lines, 1-based data row
otherwise) and an optional early rejection reason (``invalid_json``, ``not_an_object``,
``wrong_type:<column>``). JSON lines are parsed by Arrow's C++ reader one block at a time; a block
Arrow refuses (a broken line, a value of the wrong type) is re-read line by line so that every other
line in it is kept and each bad one gets its own reason.
"""

from __future__ import annotations

import glob as globlib
import hashlib
import io
import json
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import numpy as np
import pyarrow as pa

from verl_pipeline.data.generator import generate_problems
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.paths import fsspec_filesystem
from verl_pipeline.spec import DataSource

log = logging.getLogger(__name__)

FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
           ".pq": "parquet"}
COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst")
VAL_SPLIT_NAMES = ("validation", "val", "test")
_JSONL_CHUNK = 8 << 20
#: Arrow's JSON parse unit: several per chunk so that its thread pool parses them in parallel.
_ARROW_JSON_BLOCK = 1 << 20


@dataclass
class Batch:
    """Rows of one source part: the recipe's columns as strings (null = absent), row numbers, reasons."""

    table: pa.Table
    rows: np.ndarray
    reasons: list[str | None] | None = None


@dataclass
class Part:
    """One readable unit (a file, a dataset split) of a split."""

    label: str
    kind: str
    ref: Any

    def __str__(self) -> str:
        return self.label


@dataclass
class Columns:
    """What the recipe reads: text columns (the prompt's), the answer column and extra columns."""

    text: list[str]
    answer: str
    extra: list[str]

    @property
    def all(self) -> list[str]:
        return list(dict.fromkeys([*self.text, self.answer, *self.extra]))


# -- resolving a source into splits of parts -------------------------------------------------------

def file_format(name: str) -> str:
    base = name.lower()
    for comp in COMPRESSIONS:
        if base.endswith(comp):
            base = base[: -len(comp)]
    suffix = os.path.splitext(base)[1]
    if suffix not in FORMATS:
        raise ConfigError("data_source", name, "unsupported file type",
                          f"one of {sorted(FORMATS)} (optionally {'/'.join(COMPRESSIONS)} compressed)")
    return FORMATS[suffix]


def _split_of_file(name: str) -> str | None:
    stem = Path(name).name.lower().split(".", 1)[0]
    if stem == "train":
        return "train"
    return "val" if stem in VAL_SPLIT_NAMES else None


def resolve_parts(source: DataSource, options: dict[str, Any]) -> dict[str, list[Part]]:
    """``{split: [parts]}`` where split is ``train``, ``val`` or ``all`` (one split, to be divided)."""
    if source.kind == "builtin":
        seed = int(options.get("seed", 0))
        return {"train": [Part(f"{source}:train", "builtin", (source.ref, int(options.get("train_size", 256)), seed))],
                "val": [Part(f"{source}:val", "builtin",
                             (source.ref, int(options.get("val_size", 32)), seed + 1_000_003))]}
    if source.kind == "hf":
        return _hf_parts(source.ref, options)
    if source.kind == "hf_disk":
        return _dataset_parts(_load_from_disk(source.ref), source.ref, options)
    if source.kind == "url":
        fs, path = fsspec_filesystem(source.ref)
        directory = not globlib.has_magic(path) and fs.isdir(path)
        if globlib.has_magic(path):
            files = sorted(fs.glob(path))
        elif directory:
            files = sorted(p for p in fs.ls(path, detail=False) if _split_of_file(p) and _known(p))
        else:
            files = [path] if fs.exists(path) else []
        if not files:
            raise DataError(f"{source.ref}: no such file (or the glob/directory matches none)")
        return _file_parts([fs.unstrip_protocol(f) for f in files], directory=directory)
    # local files
    local = Path(source.ref)
    if globlib.has_magic(source.ref):
        files = sorted(globlib.glob(source.ref))
        if not files:
            raise DataError(f"{source.ref}: the glob matches no file")
        return _file_parts(files, directory=False)
    if local.is_dir():
        files = sorted(str(p) for p in local.iterdir() if p.is_file() and _split_of_file(p.name)
                       and _known(p.name))
        return _file_parts(files, directory=True)
    return _file_parts([str(local)], directory=False)


def _known(name: str) -> bool:
    try:
        file_format(name)
    except ConfigError:
        return False
    return True


def _file_parts(files: list[str], *, directory: bool) -> dict[str, list[Part]]:
    out: dict[str, list[Part]] = {}
    for f in files:
        split = (_split_of_file(f) if directory else None) or "all"
        out.setdefault(split, []).append(Part(f, file_format(f), f))
    if directory and "train" not in out:
        raise DataError(f"{Path(files[0]).parent if files else 'directory'}: no train file "
                        "(train.jsonl / train.json / train.csv / train.parquet)")
    return out


def parse_hf_ref(ref: str) -> tuple[str, str | None, str | None, str | None]:
    """``hf://name?config=…&revision=…&split=…`` → ``(name, config, revision, split)``."""
    parts = urlsplit(ref)
    name = (parts.netloc + parts.path).strip("/")
    query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
    return name, query.get("config"), query.get("revision"), query.get("split")


def _hf_parts(ref: str, options: dict[str, Any]) -> dict[str, list[Part]]:
    import datasets

    name, config, revision, split = parse_hf_ref(ref)
    try:
        ds = datasets.load_dataset(name, config, revision=revision, split=split)
    except Exception as e:  # datasets raises many types for "not reachable and not cached"
        offline = os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1"
        text = f"{type(e).__name__}: {e}".splitlines()[0][:300]
        if offline or "offline" in text.lower() or "connect" in text.lower() or "not found" in text.lower() \
                or "doesn't exist" in text.lower() or "couldn't" in text.lower():
            raise DataError(
                f"{ref}: the dataset is not in the local HuggingFace cache and the hub cannot be reached"
                f"{' (offline mode)' if offline else ''} ({text}). Fix: load it once on a machine with access "
                "(same HF_HOME), or save it with Dataset.save_to_disk and use that directory") from None
        raise DataError(f"{ref}: loading the dataset failed ({text})") from None
    return _dataset_parts(ds, ref, options)


def _load_from_disk(path: str) -> Any:
    import datasets

    try:
        return datasets.load_from_disk(path)
    except Exception as e:
        raise DataError(f"{path}: not a dataset saved with save_to_disk ({type(e).__name__}: {e})") from None


def _dataset_parts(ds: Any, ref: str, options: dict[str, Any]) -> dict[str, list[Part]]:
    import datasets

    if isinstance(ds, datasets.Dataset):
        return {"all": [Part(f"{ref}", "dataset", ds)]}
    names = list(ds.keys())
    if "train" not in names:
        if len(names) == 1:
            return {"all": [Part(f"{ref}[{names[0]}]", "dataset", ds[names[0]])]}
        raise DataError(f"{ref}: splits {names} have no `train`; pick one with ?split=<name> in the source")
    out = {"train": [Part(f"{ref}[train]", "dataset", ds["train"])]}
    for val in VAL_SPLIT_NAMES:
        if val in names:
            out["val"] = [Part(f"{ref}[{val}]", "dataset", ds[val])]
            break
    ignored = [n for n in names if n != "train" and (n not in VAL_SPLIT_NAMES or "val" not in out
                                                     or out["val"][0].label != f"{ref}[{n}]")]
    if ignored:
        log.info("%s: splits %s are not used (train and the first of %s are)", ref, ignored, VAL_SPLIT_NAMES)
    return out


# -- fingerprints (for the content-keyed output directory) -----------------------------------------

def fingerprint(parts: dict[str, list[Part]], cache: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A hash of every part's content. Local files are hashed in full once; their hash is reused while
    their size, mtime and inode are unchanged (``cache`` holds those, like git's index)."""
    h = hashlib.sha256()
    new_cache: dict[str, Any] = {}
    for split in sorted(parts):
        for part in parts[split]:
            h.update(f"{split}\0{part.label}\0{part.kind}\0".encode())
            if part.kind == "builtin":
                h.update(repr(part.ref).encode())
            elif part.kind == "dataset":
                h.update(str(getattr(part.ref, "_fingerprint", "")).encode())
                h.update(str(part.ref.num_rows).encode())
            elif "://" in part.ref and not part.ref.startswith("file://"):
                fs, path = fsspec_filesystem(part.ref)
                h.update(str(fs.ukey(path)).encode())
            else:
                local = part.ref[len("file://"):] if part.ref.startswith("file://") else part.ref
                st = os.stat(local)
                stamp = [st.st_size, st.st_mtime_ns, st.st_ino]
                entry = cache.get(local)
                if entry and entry.get("stat") == stamp:
                    digest = entry["sha256"]
                else:
                    fh = hashlib.sha256()
                    with open(local, "rb") as f:
                        for chunk in iter(lambda: f.read(8 << 20), b""):
                            fh.update(chunk)
                    digest = fh.hexdigest()
                new_cache[local] = {"stat": stamp, "sha256": digest}
                h.update(digest.encode())
    return h.hexdigest(), new_cache


# -- reading ---------------------------------------------------------------------------------------

def read_part(part: Part, columns: Columns, batch_rows: int) -> Iterator[Batch]:
    if part.kind == "builtin":
        yield from _builtin(part.ref, columns, batch_rows)
    elif part.kind == "dataset":
        yield from _arrow_batches(_dataset_batches(part.ref, batch_rows), part.ref.column_names, part.label,
                                  columns)
    elif part.kind == "parquet":
        yield from _parquet(part.ref, columns, batch_rows)
    elif part.kind == "csv":
        yield from _csv(part.ref, columns, batch_rows)
    else:
        yield from _json(part.ref, columns, batch_rows, part.kind)


def read_whole_rows(part: Part, batch_rows: int) -> Iterator[Batch]:
    """Every column of a Parquet file or a dataset, as stored (rows already in verl's schema), numbered
    from 1. Other formats are refused: their nested values have no types to keep."""
    if part.kind == "parquet":
        import pyarrow.parquet as pq

        with _open(part.ref) as f:
            pf = pq.ParquetFile(f)
            yield from _numbered(pa.Table.from_batches([b], schema=pf.schema_arrow)
                                 for b in pf.iter_batches(batch_size=batch_rows))
    elif part.kind == "dataset":
        yield from _numbered(_dataset_batches(part.ref, batch_rows))
    else:
        raise ConfigError("data.recipe", "verl", f"reads Parquet files and saved datasets; {part.label} is {part.kind}",
                          "write the rows with pandas/pyarrow/datasets to .parquet, or use recipe generic for "
                          "raw columns")


def _numbered(tables: Iterator[pa.Table]) -> Iterator[Batch]:
    start = 1
    for table in tables:
        if table.num_rows:
            yield Batch(table, np.arange(start, start + table.num_rows, dtype=np.int64))
            start += table.num_rows


def _open(ref: str) -> Any:
    import fsspec

    if "://" in ref:
        fsspec_filesystem(ref)  # a clear error for a missing backend
    try:
        return fsspec.open(ref, "rb", compression="infer").open()
    except FileNotFoundError:
        raise DataError(f"{ref}: no such file") from None


def _builtin(ref: tuple[str, int, int], columns: Columns, batch_rows: int) -> Iterator[Batch]:
    kind, n, seed = ref
    qs: list[str] = []
    ans: list[str] = []
    start = 1
    for p in generate_problems(n, seed=seed, kind=kind):
        qs.append(p.question)
        ans.append(p.answer)
        if len(qs) == batch_rows:
            yield _builtin_batch(kind, qs, ans, start, columns)
            start += len(qs)
            qs, ans = [], []
    if qs:
        yield _builtin_batch(kind, qs, ans, start, columns)


def _builtin_batch(kind: str, qs: list[str], ans: list[str], start: int, columns: Columns) -> Batch:
    table = pa.table({"question": pa.array(qs, pa.string()), "answer": pa.array(ans, pa.string())})
    return Batch(_select(table, columns, f"builtin:{kind}", typed_source=True),
                 np.arange(start, start + len(qs), dtype=np.int64))


def _dataset_batches(ds: Any, batch_rows: int) -> Iterator[pa.Table]:
    yield from ds.with_format("arrow").iter(batch_size=batch_rows)


def _parquet(ref: str, columns: Columns, batch_rows: int) -> Iterator[Batch]:
    import pyarrow.parquet as pq

    with _open(ref) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        present = [c for c in columns.all if c in names]
        yield from _arrow_batches((pa.Table.from_batches([b]) for b in
                                   pf.iter_batches(batch_size=batch_rows, columns=present)), names, ref, columns)


def _csv(ref: str, columns: Columns, batch_rows: int) -> Iterator[Batch]:
    import pyarrow.csv as pcsv

    with _open(ref) as f:
        reader = pcsv.open_csv(
            f, read_options=pcsv.ReadOptions(block_size=max(1 << 20, batch_rows * 256)),
            convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in columns.all}),
        )
        names = reader.schema.names
        tables = (pa.Table.from_batches([b]) for b in reader)
        yield from _arrow_batches(tables, names, ref, columns)


def _arrow_batches(tables: Iterator[pa.Table], names: list[str], label: str, columns: Columns) -> Iterator[Batch]:
    """Typed sources (Parquet, CSV, datasets): a missing or wrongly typed column fails the whole source."""
    missing = [c for c in columns.all if c not in names]
    if missing:
        raise DataError(f"{label}: column(s) {missing} not found (columns: {names}); map yours with the "
                        "recipe options prompt_column/prompt_template/answer_column/extra_columns"
                        + (_VERL_HINT if {"prompt", "reward_model"} <= set(names) else ""))
    start = 1
    for table in tables:
        if table.num_rows == 0:
            continue
        yield Batch(_select(table, columns, label, typed_source=True),
                    np.arange(start, start + table.num_rows, dtype=np.int64))
        start += table.num_rows


_VERL_HINT = ("; rows already in verl's schema (chat messages, reward_model, extra_info) take recipe verl, kept as "
              "they are")


def _ok_type(t: pa.DataType, role: str) -> bool:
    if pa.types.is_null(t) or pa.types.is_string(t) or pa.types.is_large_string(t):
        return True
    primitive = pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_decimal(t)
    if role == "answer":
        return primitive
    if role == "extra":
        return primitive or pa.types.is_boolean(t) or pa.types.is_temporal(t)
    return False


def _select(table: pa.Table, columns: Columns, label: str, *, typed_source: bool) -> pa.Table:
    """The recipe's columns cast to string; raises _WrongType (typed sources: DataError)."""
    out = {}
    for name in columns.all:
        role = "text" if name in columns.text else "answer" if name == columns.answer else "extra"
        if name not in table.column_names:
            out[name] = pa.nulls(table.num_rows, pa.string())
            continue
        col = table.column(name)
        if not _ok_type(col.type, role):
            if typed_source and role == "extra":
                out[name] = pa.array([None if v is None else json.dumps(v, default=str, sort_keys=True)
                                      for v in col.to_pylist()], pa.string())
                continue
            if typed_source:
                verl_rows = role == "text" and (pa.types.is_list(col.type) or pa.types.is_large_list(col.type))
                raise DataError(f"{label}: column {name!r} has type {col.type}; "
                                f"{'the prompt needs text' if role == 'text' else 'the answer needs text or a number'}"
                                + (_VERL_HINT if verl_rows else ""))
            raise _WrongType(name)
        out[name] = col.cast(pa.string()).combine_chunks() if col.num_chunks != 1 or col.type != pa.string() \
            else col.chunk(0)
    return pa.table(out)


class _WrongType(Exception):
    pass


def _json(ref: str, columns: Columns, batch_rows: int, kind: str) -> Iterator[Batch]:
    with _open(ref) as f:
        if kind == "json":
            head = f.read(4096).lstrip()
            f.seek(0)
            if head.startswith(b"["):
                try:
                    records = json.load(io.TextIOWrapper(f, encoding="utf-8"))
                except json.JSONDecodeError as e:
                    raise DataError(f"{ref}: not valid JSON ({e})") from None
                for start in range(0, len(records), batch_rows):
                    chunk = records[start:start + batch_rows]
                    yield _slow(list(enumerate(chunk, start=start + 1)), columns)
                return
        yield from _jsonl(f, columns, batch_rows)


def _jsonl(f: Any, columns: Columns, batch_rows: int) -> Iterator[Batch]:
    import pyarrow.json as pj

    rest = b""
    line_base = 0
    chunk_bytes = _JSONL_CHUNK
    while True:
        data = f.read(chunk_bytes)
        eof = not data
        buf = rest + data
        if eof:
            if not buf.strip():
                return
            block, rest = buf, b""
        else:
            cut = buf.rfind(b"\n")
            if cut < 0:
                rest = buf
                continue
            block, rest = buf[: cut + 1], buf[cut + 1:]
        n_lines = block.count(b"\n") + (0 if block.endswith(b"\n") else 1)
        batch = None
        if b"\n\n" not in block and not block.startswith(b"\n") and b"\r\n\r\n" not in block:
            # Arrow parses blocks on its thread pool (both cores); a record longer than a block makes it
            # fail, and then the chunk is parsed again as one block.
            for block_size in dict.fromkeys((min(len(block) + 1, _ARROW_JSON_BLOCK), len(block) + 1)):
                try:
                    table = pj.read_json(io.BytesIO(block), read_options=pj.ReadOptions(block_size=block_size))
                    if table.num_rows == n_lines:
                        batch = Batch(_select(table, columns, "", typed_source=False),
                                      np.arange(line_base + 1, line_base + n_lines + 1, dtype=np.int64))
                    break
                except _WrongType:
                    break
                except pa.ArrowInvalid:
                    continue
        if batch is not None:
            yield from _rechunk(batch, batch_rows)
        else:
            lines = block.split(b"\n")
            numbered = [(line_base + i + 1, line) for i, line in enumerate(lines[:n_lines])]
            for start in range(0, len(numbered), batch_rows):
                yield _slow_lines(numbered[start:start + batch_rows], columns)
        line_base += n_lines
        if eof:
            return


def _rechunk(batch: Batch, batch_rows: int) -> Iterator[Batch]:
    for start in range(0, batch.table.num_rows, batch_rows):
        yield Batch(batch.table.slice(start, batch_rows), batch.rows[start:start + batch_rows])


def _slow_lines(numbered: list[tuple[int, bytes]], columns: Columns) -> Batch:
    records: list[tuple[int, Any]] = []
    for lineno, line in numbered:
        if not line.strip():
            continue
        try:
            records.append((lineno, json.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError):
            records.append((lineno, _INVALID))
    return _slow(records, columns)


_INVALID = object()


def _slow(records: list[tuple[int, Any]], columns: Columns) -> Batch:
    """Records one by one, each bad one with its own reason."""
    names = columns.all
    values: dict[str, list[str | None]] = {c: [] for c in names}
    reasons: list[str | None] = []
    rows: list[int] = []
    for lineno, rec in records:
        rows.append(lineno)
        reason = None
        if rec is _INVALID:
            reason = "invalid_json"
        elif not isinstance(rec, dict):
            reason = "not_an_object"
        cells: dict[str, str | None] = {}
        if reason is None:
            assert isinstance(rec, dict)
            for c in names:
                v = rec.get(c)
                role = "text" if c in columns.text else "answer" if c == columns.answer else "extra"
                if v is None or isinstance(v, str):
                    cells[c] = v
                elif role != "text" and isinstance(v, int | float) and not isinstance(v, bool):
                    cells[c] = str(v)
                elif role == "extra":
                    cells[c] = json.dumps(v, sort_keys=True, default=str)
                else:
                    reason = reason or f"wrong_type:{c}"
                    cells[c] = None
        for c in names:
            values[c].append(cells.get(c))
        reasons.append(reason)
    table = pa.table({c: pa.array(values[c], pa.string()) for c in names})
    return Batch(table, np.asarray(rows, dtype=np.int64), reasons)
