"""Any data source → verl's parquet rows, checked row by row, streamed, atomic and idempotent.

verl's row schema: ``data_source`` (selects the reward function), ``prompt`` (chat messages),
``ability``, ``reward_model`` ``{"style": "rule", "ground_truth": …}`` and ``extra_info``.
Rows already in that schema (recipe ``verl``) are checked and kept as they are, every column
(:mod:`verl_pipeline.data.verl_rows`); what follows is how the other recipes make them.

What is checked, and how often:

- per row: the record parses and is an object with the recipe's columns of the right types; the
  prompt is non-empty after trimming; a ground truth is extracted; the prompt (after the model's
  chat template) fits ``max_prompt_length`` tokens (with a byte-level BPE tokenizer a prompt of at
  most that many UTF-8 bytes provably fits and is not tokenized; every other prompt is); the prompt
  is not an exact duplicate of an earlier one (train first, then val: a val prompt seen in train is
  removed too; 64-bit hashes, a collision would drop a row: ~3e-6 probability at 10M rows).
- per data_source (verl is imported in the background while rows are read; a failure stops the
  run at the next batch, and nothing is published before the check passed):
  verl's ``default_compute_score`` (or the configured custom reward function) has a reward
  function for it.
- per batch (its first accepted row): that scorer gives 1.0 to the extracted ground truth answered
  in the recipe's ``check_solution`` form, so the extraction matches what the scorer compares.

Failing rows go to ``rejects.jsonl`` (source, line, reason); rows removed as duplicates or too long
go to ``filtered.jsonl``. The step fails when rejects exceed ``max_reject_fraction`` (default 0).
Outputs live in a directory named by a hash of the input content, recipe, options and tokenizer:
an unchanged re-run finds them and does no work.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from verl_pipeline.constants import DEFAULT_RECIPE
from verl_pipeline.data.recipes import (
    GSM8K_PATTERN,
    RECIPE_KEYS,
    Recipe,
    VerlRecipe,
    extract_gsm8k,
    last_boxed,
    load_recipe,
)
from verl_pipeline.data.sources import Batch, Columns, Part, fingerprint, read_part, resolve_parts
from verl_pipeline.data.verl_rows import VerlRows
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.paths import write_json_atomic
from verl_pipeline.spec import DataSource

log = logging.getLogger(__name__)

#: Bump when the rows this module writes change, so cached outputs are rebuilt.
CODE_VERSION = "v2"
RECIPE_VERSION = f"gsm8k-{CODE_VERSION}"
DATA_SOURCE = "openai/gsm8k"
# verl's GSM8K example appends this so the model answers in the `#### N` form the scorer reads.
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
OPTION_KEYS = frozenset({"recipe", "train_size", "val_size", "seed", "val_fraction", "max_reject_fraction", "dedup",
                         "batch_rows", "max_prompt_length", "tokenizer", *RECIPE_KEYS})
FINGERPRINTS = "fingerprints.json"
#: Written last into a data directory: its counts, and the mark that the directory is complete.
STATS_FILE = "stats.json"
_MESSAGE = pa.struct([("role", pa.string()), ("content", pa.string())])

ROW_SCHEMA = pa.schema(
    [
        ("data_source", pa.string()),
        ("prompt", pa.list_(_MESSAGE)),
        ("ability", pa.string()),
        ("reward_model", pa.struct([("style", pa.string()), ("ground_truth", pa.string())])),
        (
            "extra_info",
            pa.struct([("split", pa.string()), ("index", pa.int64()), ("answer", pa.string()),
                       ("question", pa.string())]),
        ),
    ]
)

extract_ground_truth = extract_gsm8k


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


def output_dir(out_root: Path, recipe: str, key: str) -> Path:
    """The data directory of ``recipe``'s output with content ``key`` (same inputs, same directory)."""
    return out_root / f"{recipe}-{CODE_VERSION}-{key}"


def split_file(out_dir: Path, split: str) -> Path:
    """A split's parquet file (``train``, ``val``) in a data directory."""
    return out_dir / f"{split}.parquet"


def _result(out_dir: Path, key: str, cached: bool, counts: dict[str, Any], t0: float) -> PreprocessResult:
    return PreprocessResult(str(split_file(out_dir, "train")), str(split_file(out_dir, "val")), str(out_dir), key,
                            cached, counts, round(time.monotonic() - t0, 3))


def row_schema(recipe: Recipe) -> pa.Schema:
    """ROW_SCHEMA, with the recipe's extra columns (strings) appended to ``extra_info``."""
    if not recipe.extra_columns:
        return ROW_SCHEMA
    info = ROW_SCHEMA.field("extra_info").type
    fields = [info.field(i) for i in range(info.num_fields)] + [pa.field(c, pa.string()) for c in recipe.extra_columns]
    return ROW_SCHEMA.set(ROW_SCHEMA.get_field_index("extra_info"), pa.field("extra_info", pa.struct(fields)))


def check_options(options: dict[str, Any]) -> None:
    for key in options:
        if key not in OPTION_KEYS:
            raise ConfigError(f"data.{key}", options[key], "unknown data option", f"use one of {sorted(OPTION_KEYS)}")
    frac = options.get("max_reject_fraction", 0.0)
    if isinstance(frac, bool) or not isinstance(frac, int | float) or not 0 <= frac <= 1:
        raise ConfigError("data.max_reject_fraction", frac, "must be a number from 0 to 1", "max_reject_fraction: 0")
    val = options.get("val_fraction", 0.1)
    if isinstance(val, bool) or not isinstance(val, int | float) or not 0 < val < 1:
        raise ConfigError("data.val_fraction", val, "must be a number between 0 and 1", "val_fraction: 0.1")
    mpl = options.get("max_prompt_length")
    if mpl is not None and (isinstance(mpl, bool) or not isinstance(mpl, int) or mpl < 1):
        raise ConfigError("data.max_prompt_length", mpl, "must be a positive integer", "max_prompt_length: 512")
    rows = options.get("batch_rows", 65536)
    if isinstance(rows, bool) or not isinstance(rows, int) or not 1 <= rows <= 1_000_000:
        raise ConfigError("data.batch_rows", rows, "must be an integer from 1 to 1000000", "batch_rows: 65536")


class _Run:
    """One preprocessing run: the per-batch work and its counters."""

    def __init__(self, recipe: Recipe, options: dict[str, Any], tmp_dir: Path, tokenizer: str | None,
                 max_len: int | None) -> None:
        from verl_pipeline.data.checks import PromptLengths, RewardCheck, SeenHashes

        self.recipe = recipe
        self.schema = row_schema(recipe)
        self.tmp_dir = tmp_dir
        # The tokenizer first: RewardCheck imports verl (hence transformers) in a thread, and importing
        # transformers from two threads at once fails ("cannot import name 'PreTrainedTokenizer'").
        self.lengths = PromptLengths(tokenizer, recipe.system_prompt) if tokenizer and max_len else None
        self.reward = RewardCheck(recipe)
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.dedup = bool(options.get("dedup", True))
        self.seen = SeenHashes()
        self.every = max(2, round(1 / float(options.get("val_fraction", 0.1))))
        self.writers: dict[str, Any] = {}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="parquet-writer")
        self.pending: Future[None] | None = None
        self.rows = {"train": 0, "val": 0}
        self.read = 0
        self.rejected: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()
        self.longest: dict[str, Any] = {"tokens": 0}
        self.longest_kept = 0
        self.measured = 0
        self.rej = open(tmp_dir / "rejects.jsonl", "w", encoding="utf-8")
        self.filt = open(tmp_dir / "filtered.jsonl", "w", encoding="utf-8")
        self.columns = Columns(recipe.template_fields, recipe.answer_column, list(recipe.extra_columns))

    def read_part(self, part: Part, batch_rows: int) -> Iterator[Batch]:
        return read_part(part, self.columns, batch_rows)

    def close(self) -> None:
        try:
            if self.pending is not None:
                self.pending.result()
        finally:
            self.pool.shutdown(wait=True)
        for w in self.writers.values():
            w.close()
        self.rej.close()
        self.filt.close()

    def stats(self, *, source_text: str, max_frac: float, tokenizer_digest: str, t0: float) -> dict[str, Any]:
        """What the run read, kept, rejected and filtered (``stats.json``, the task's counts)."""
        n_rej = sum(self.rejected.values())
        return {
            "records_in": self.read, "train_rows": self.rows["train"], "val_rows": self.rows["val"],
            "written": self.rows["train"] + self.rows["val"], "rejected": dict(self.rejected),
            "reject_fraction": round(n_rej / self.read, 6), "max_reject_fraction": max_frac,
            "deduplicated": self.filtered.get("duplicate_prompt", 0),
            "too_long": self.filtered.get("prompt_too_long", 0),
            "length_filter": ({"tokenizer": self.tokenizer, "tokenizer_digest": tokenizer_digest,
                               "max_prompt_length": self.max_len, "longest_prompt": self.longest,
                               "longest_kept_tokens": self.longest_kept, "tokenized_rows": self.measured,
                               "byte_bound": bool(self.lengths.byte_level)}
                              if self.lengths else "off (no tokenizer or max_prompt_length)"),
            "data_source": self.recipe.data_source, "recipe": self.recipe.name, "source": source_text,
            "scorer": self.reward.scorer, "scorer_samples": self.reward.samples,
            "seconds": round(time.monotonic() - t0, 3),
        }

    def _log(self, f: IO[str], label: str, split: str, lines: np.ndarray, reasons: list[str]) -> None:
        f.writelines(json.dumps({"source": label, "split": split, "line": int(n), "reason": r}) + "\n"
                     for n, r in zip(lines, reasons, strict=True))

    def batch(self, b: Batch, part: Part, split: str) -> None:
        """Check one batch (rejects logged with their reason), filter it (duplicates, overlong prompts) and
        queue what is left for the split's parquet file (``split == "all"``: divided into train and val)."""
        r = self.recipe
        t = b.table
        n = t.num_rows
        self.read += n
        self.reward.poll()  # a scorer that failed to load stops the run here
        reasons = np.full(n, None, dtype=object)
        truth = self._ground_truth(t)
        truth_missing = pc.or_kleene(pc.is_null(truth), pc.equal(pc.utf8_length(truth), 0))
        reasons[_np(pc.fill_null(truth_missing, True))] = "no_ground_truth"
        question = _chunk(_render(r.prompt_template, t) if r.prompt_template is not None
                          else t.column(str(r.prompt_column)))
        trimmed = _chunk(pc.utf8_trim_whitespace(question))
        reasons[_np(pc.fill_null(pc.equal(pc.utf8_length(trimmed), 0), False))] = "empty_prompt"
        for c in reversed(self.columns.all):
            if c in self.columns.extra:
                continue
            reasons[_np(pc.is_null(t.column(c)))] = f"missing_{c}"
        if b.reasons is not None:
            pre = np.array(b.reasons, dtype=object)
            has = pre != None  # noqa: E711 - elementwise on an object array
            reasons[has] = pre[has]

        bad = reasons != None  # noqa: E711
        if bad.any():
            self.rejected.update(reasons[bad].tolist())
            self._log(self.rej, part.label, split, b.rows[bad], reasons[bad].tolist())
        keep = np.flatnonzero(~bad)
        if not len(keep):
            return
        idx = pa.array(keep)
        content = trimmed.take(idx)
        if r.instruction:
            content = pc.binary_join_element_wise(content, " " + r.instruction, "")
        rows = b.rows[keep]
        truth_k = truth.take(idx)
        self.reward.sample(truth_k[0].as_py(), self._sample_info(t, int(keep[0]), question, split),
                           part.label, int(rows[0]))

        sel = self._first_seen(content, rows, part, split) if self.dedup else np.arange(len(keep))
        if self.lengths is not None and len(sel):
            sel = self._short_enough(content, sel, rows, part, split)
        if not len(sel):
            return
        if split == "all":
            is_val = rows[sel] % self.every == 0
            self._write("train", sel[~is_val], keep, content, truth_k, question, t)
            self._write("val", sel[is_val], keep, content, truth_k, question, t)
        else:
            self._write(split, sel, keep, content, truth_k, question, t)

    def _sample_info(self, t: pa.Table, i: int, question: pa.Array, split: str) -> dict[str, Any]:
        """Row ``i``'s ``extra_info`` as :meth:`_write` puts it in the parquet (its index there not yet known)."""
        r = self.recipe
        info: dict[str, Any] = {"split": "train" if split == "all" else split, "index": self.rows.get(split, 0),
                                "answer": t.column(r.answer_column)[i].as_py(), "question": question[i].as_py()}
        for c in r.extra_columns:
            value = t.column(c)[i].as_py()
            info[c] = None if value is None else str(value)
        return info

    def _ground_truth(self, t: pa.Table) -> pa.ChunkedArray:
        """Each row's ground truth, as the recipe extracts it from its answer column."""
        r = self.recipe
        answer = t.column(r.answer_column)
        if r.answer_extraction == "gsm8k":
            truth = pc.struct_field(pc.extract_regex(pc.utf8_trim_whitespace(answer), GSM8K_PATTERN), [0])
            truth = pc.replace_substring(truth, ",", "")
        elif r.answer_extraction == "regex":
            truth = pc.utf8_trim_whitespace(pc.struct_field(pc.extract_regex(answer, r.answer_regex), ["answer"]))
        elif r.answer_extraction == "boxed":
            truth = pa.array([None if a is None else last_boxed(a) for a in answer.to_pylist()], pa.string())
        else:
            truth = pc.utf8_trim_whitespace(answer)
        return _chunk(truth)

    def _first_seen(self, content: pa.Array, rows: np.ndarray, part: Part, split: str) -> np.ndarray:
        """The positions of ``content`` whose prompt this run has not seen before (the rest logged as duplicates)."""
        # Python's string hash (64-bit SipHash): consistent within this run, which is all dedup needs.
        hashes = np.fromiter(map(hash, content.to_numpy(zero_copy_only=False)), dtype=np.int64, count=len(content))
        uniq, first = np.unique(hashes, return_index=True)
        is_first = np.zeros(len(hashes), dtype=bool)
        is_first[first] = True
        is_first &= ~self.seen.contains(hashes)
        self.seen.add(uniq)
        dup = ~is_first
        if dup.any():
            self.filtered["duplicate_prompt"] += int(dup.sum())
            self._log(self.filt, part.label, split, rows[dup], ["duplicate_prompt"] * int(dup.sum()))
        return np.flatnonzero(is_first)

    def _short_enough(self, content: pa.Array, sel: np.ndarray, rows: np.ndarray, part: Part,
                      split: str) -> np.ndarray:
        """``sel`` without the prompts longer than ``max_prompt_length`` tokens (logged as filtered)."""
        assert self.lengths is not None and self.max_len is not None
        lens = self.lengths.lengths(content.take(pa.array(sel)), self.max_len)
        i = int(lens.argmax())
        if lens[i] > self.longest["tokens"]:
            self.longest = {"tokens": int(lens[i]), "source": part.label, "line": int(rows[sel[i]])}
        self.measured += int((lens >= 0).sum())
        over = lens > self.max_len
        if over.any():
            self.filtered["prompt_too_long"] += int(over.sum())
            self._log(self.filt, part.label, split, rows[sel[over]], ["prompt_too_long"] * int(over.sum()))
            sel = sel[~over]
            lens = lens[~over]
        if len(lens):
            self.longest_kept = max(self.longest_kept, int(lens.max()))
        return sel

    def _write(self, split: str, sel: np.ndarray, keep: np.ndarray, content: pa.Array, truth: pa.Array,
               question: pa.Array, t: pa.Table) -> None:
        import pyarrow.parquet as pq

        m = len(sel)
        if not m:
            return
        r = self.recipe
        s = pa.array(sel)
        src = pa.array(keep[sel])
        content = _chunk(content.take(s))
        zeros = pa.array(np.zeros(m, dtype=np.int32))
        if r.system_prompt:
            roles = pa.array(["system", "user"]).take(pa.array(np.tile(np.array([0, 1], dtype=np.int32), m)))
            order = np.empty(2 * m, dtype=np.int64)
            order[0::2] = 0
            order[1::2] = np.arange(1, m + 1)
            texts = pa.concat_arrays([pa.array([r.system_prompt], pa.string()), content]).take(pa.array(order))
            offsets = pa.array(np.arange(0, 2 * m + 1, 2, dtype=np.int32))
        else:
            roles = pa.array(["user"]).take(zeros)
            texts = content
            offsets = pa.array(np.arange(0, m + 1, dtype=np.int32))
        messages = pa.StructArray.from_arrays([roles, texts], fields=list(_MESSAGE))
        prompt = pa.ListArray.from_arrays(offsets, messages, type=pa.list_(_MESSAGE))
        start = self.rows[split]
        info_arrays = [pa.array([split]).take(zeros), pa.array(np.arange(start, start + m, dtype=np.int64)),
                       t.column(r.answer_column).take(src), question.take(src)]
        info_arrays += [t.column(c).take(src) for c in r.extra_columns]
        info_type = self.schema.field("extra_info").type
        extra_info = pa.StructArray.from_arrays([_chunk(a) for a in info_arrays],
                                                fields=[info_type.field(i) for i in range(info_type.num_fields)])
        reward = pa.StructArray.from_arrays([pa.array(["rule"]).take(zeros), truth.take(s)],
                                            names=["style", "ground_truth"])
        table = pa.Table.from_arrays(
            [pa.array([r.data_source]).take(zeros), prompt, pa.array([r.ability]).take(zeros), reward, extra_info],
            schema=self.schema)
        if split not in self.writers:
            # Dictionary encoding only for the constant columns (it is wasted work on unique text).
            constant = ["data_source", "ability", "prompt.list.element.role", "reward_model.style", "extra_info.split"]
            self.writers[split] = pq.ParquetWriter(split_file(self.tmp_dir, split), self.schema,
                                                   use_dictionary=constant)
        # Parquet encoding runs on a writer thread (Arrow releases the GIL) while the next batch is read;
        # one write in flight at a time keeps memory bounded.
        if self.pending is not None:
            self.pending.result()
        self.pending = self.pool.submit(self.writers[split].write_table, table)
        self.rows[split] += m


def _np(mask: Any) -> np.ndarray:
    return np.asarray(_chunk(mask).to_numpy(zero_copy_only=False), dtype=bool)


def _chunk(a: Any) -> pa.Array:
    return a.combine_chunks() if isinstance(a, pa.ChunkedArray) else a


def _render(template: str, t: pa.Table) -> pa.Array:
    """``template`` filled from the table's columns, vectorized; null where any field is null."""
    import string

    pieces: list[Any] = []
    for literal, name, _spec, _conv in string.Formatter().parse(template):
        if literal:
            pieces.append(literal)
        if name is not None:
            pieces.append(_chunk(t.column(name)))
    if len(pieces) == 1 and not isinstance(pieces[0], str):
        return pieces[0]
    arrays = [p if not isinstance(p, str) else pa.array([p]).take(pa.array(np.zeros(t.num_rows, dtype=np.int32)))
              for p in pieces]
    return pc.binary_join_element_wise(*arrays, "")


def _as_list(sources: DataSource | Sequence[DataSource]) -> list[DataSource]:
    return [sources] if isinstance(sources, DataSource) else list(sources)


def preprocess(
    sources: DataSource | Sequence[DataSource],
    options: dict[str, Any],
    out_root: Path,
    *,
    tokenizer: str | None = None,
    max_prompt_length: int | None = None,
) -> PreprocessResult:
    """Write ``train.parquet`` and ``val.parquet`` for ``sources`` under ``out_root``.

    ``options`` are the data options (profile ``data:`` section): ``recipe`` and its keys,
    ``max_reject_fraction``, ``val_fraction``, ``dedup``, ``batch_rows``, builtin sizes; their
    ``tokenizer``/``max_prompt_length`` replace the arguments. Without a tokenizer and a maximum
    length the length filter is off (and ``counts["length_filter"]`` says so).
    """
    t0 = time.monotonic()
    options = dict(options)
    check_options(options)
    srcs = _as_list(sources)
    if not srcs:
        raise DataError("no data source given")
    recipe = load_recipe(str(options.get("recipe") or DEFAULT_RECIPE), options)
    tokenizer = options.get("tokenizer") or tokenizer
    max_len = options.get("max_prompt_length") or max_prompt_length
    if tokenizer and not Path(str(tokenizer)).is_dir():
        raise ConfigError("data.tokenizer", tokenizer, "no such directory", "the model directory (with tokenizer.json)")

    parts: dict[str, list[Part]] = {}
    for src in srcs:
        for split, ps in resolve_parts(src, options).items():
            parts.setdefault(split, []).extend(ps)
    out_root.mkdir(parents=True, exist_ok=True)
    key, tok_hash = _output_key(out_root, parts, recipe, options, tokenizer, max_len)
    out_dir = output_dir(out_root, recipe.name, key)
    stats_path = out_dir / STATS_FILE
    if stats_path.is_file():
        counts = json.loads(stats_path.read_text())
        log.info("Preprocessed data already present (key %s) in %s: nothing to do", key, out_dir)
        return _result(out_dir, key, True, counts, t0)

    tmp_dir = out_root / f".{out_dir.name}.{os.getpid()}.partial"
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    source_text = ", ".join(str(s) for s in srcs)
    try:
        run = _make_run(recipe, options, tmp_dir, str(tokenizer) if tokenizer else None,
                        int(max_len) if max_len else None)
        try:
            _read_all(run, parts, int(options.get("batch_rows", 65536)), t0)
        finally:
            run.close()
        run.reward.wait()
        max_frac = float(options.get("max_reject_fraction", 0.0))
        _check_kept(run, max_frac, source_text, kept_rejects=out_root / f"rejects-{key}.jsonl")
        if isinstance(run, VerlRows):
            run.check_with_verl()
        counts = run.stats(source_text=source_text, max_frac=max_frac, tokenizer_digest=tok_hash, t0=t0)
        write_json_atomic(tmp_dir / STATS_FILE, counts)
        try:
            os.rename(tmp_dir, out_dir)
        except OSError:
            if not stats_path.is_file():
                raise
            shutil.rmtree(tmp_dir, ignore_errors=True)  # a concurrent run wrote the same outputs first
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    log.info("Preprocessed %s with recipe %s: %d rows read, %d train / %d val written, rejected %s, "
             "filtered %s, longest prompt %s, into %s", source_text, recipe.name, run.read, counts["train_rows"],
             counts["val_rows"], dict(run.rejected), dict(run.filtered), run.longest, out_dir)
    return _result(out_dir, key, False, counts, t0)


def _make_run(recipe: Recipe | VerlRecipe, options: dict[str, Any], tmp_dir: Path, tokenizer: str | None,
              max_len: int | None) -> _Run | VerlRows:
    """The run for ``recipe``: raw columns made into verl's rows, or rows already in verl's schema."""
    if isinstance(recipe, VerlRecipe):
        return VerlRows(recipe, options, tmp_dir, tokenizer, max_len, split_path=split_file)
    return _Run(recipe, options, tmp_dir, tokenizer, max_len)


def _output_key(out_root: Path, parts: dict[str, list[Part]], recipe: Recipe | VerlRecipe, options: dict[str, Any],
                tokenizer: Any, max_len: Any) -> tuple[str, str]:
    """The output's content key (code, recipe, options, the data's fingerprints, the tokenizer when the
    length filter is on) and the tokenizer's digest (empty without the filter). The data's fingerprints
    are kept in ``out_root`` so a file unchanged since is not read again."""
    fp_path = out_root / FINGERPRINTS
    try:
        fp_cache = json.loads(fp_path.read_text()) if fp_path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        fp_cache = {}
    data_hash, new_fp = fingerprint(parts, fp_cache)
    if new_fp and any(fp_cache.get(k) != v for k, v in new_fp.items()):
        write_json_atomic(fp_path, {**fp_cache, **new_fp})
    tok_hash = ""
    if tokenizer and max_len:
        from verl_pipeline.trainer.prefilter import tokenizer_digest

        tok_hash = tokenizer_digest(str(tokenizer))
    h = hashlib.sha256()
    keyed = {k: v for k, v in options.items() if k not in ("tokenizer", "max_prompt_length", "batch_rows")}
    for piece in (CODE_VERSION, json.dumps(recipe.to_dict(), sort_keys=True), json.dumps(keyed, sort_keys=True,
                  default=str), data_hash, tok_hash, str(max_len if tok_hash else None)):
        h.update(piece.encode() + b"\0")
    return h.hexdigest()[:16], tok_hash


def _read_all(run: _Run | VerlRows, parts: dict[str, list[Part]], batch_rows: int, t0: float) -> None:
    """Every part through ``run`` batch by batch (train, val, then the parts split here), progress every 10 s."""
    last_log = time.monotonic()
    for split in ("train", "val", "all"):
        for part in parts.get(split, []):
            log.info("Reading %s (%s) for split %s", part.label, part.kind, split)
            for b in run.read_part(part, batch_rows):
                run.batch(b, part, split)
                if time.monotonic() - last_log > 10:
                    last_log = time.monotonic()
                    log.info("... %d rows read, %d written, %d rejected, %d filtered (%.0f rows/s)",
                             run.read, sum(run.rows.values()), sum(run.rejected.values()),
                             sum(run.filtered.values()), run.read / (last_log - t0))


def _check_kept(run: _Run | VerlRows, max_frac: float, source_text: str, *, kept_rejects: Path) -> None:
    """DataError when the source had no records, more were rejected than ``max_frac`` allows (the rejects
    kept in ``kept_rejects``), or a split is left empty."""
    n_rej = sum(run.rejected.values())
    if run.read == 0:
        raise DataError(f"data source {source_text} has no records")
    if n_rej / run.read > max_frac:
        shutil.copyfile(run.tmp_dir / "rejects.jsonl", kept_rejects)
        first = run.first_error if isinstance(run, VerlRows) else None
        raise DataError(
            f"{n_rej} of {run.read} records rejected ({dict(run.rejected)}), more than max_reject_fraction="
            f"{max_frac}{f'; first: {first}' if first else ''}; see {kept_rejects}")
    if not run.rows["train"] or not run.rows["val"]:
        raise DataError(f"data source {source_text} gave {run.rows['train']} train / {run.rows['val']} val rows "
                        f"after checks ({dict(run.rejected)} rejected, {dict(run.filtered)} filtered); "
                        "both splits need rows")
