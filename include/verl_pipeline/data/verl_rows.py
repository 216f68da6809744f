"""Rows already in verl's schema (recipe ``verl``): read whole, checked, written as they are.

The schema is what verl 0.9.1 reads (``verl/utils/dataset/rl_dataset.py`` and the agent loop):

- ``prompt``: a list of chat messages ``{"role", "content", …}`` (several turns, a system message,
  an assistant turn with ``tool_calls``); verl renders it with the model's chat template.
- ``data_source`` (per row: one file may hold several), ``reward_model`` ``{"style", "ground_truth"}``,
  optional ``ability``.
- ``extra_info``: a dict with any keys. verl takes ``index``, ``tools_kwargs`` and
  ``interaction_kwargs`` from it and puts them at the top of the row (a top-level column of one of
  those names is replaced, so it is refused here).
- ``agent_name``: the agent loop of the row (``single_turn_agent``, ``tool_agent`` or one of
  ``actor_rollout_ref.rollout.agent.agent_loop_config_path``); without the column verl runs
  ``rollout.agent.default_agent_loop``.

Columns are checked once per file (types), rows one by one; a bad row is rejected with a one-line
error (file, row, column, what is wrong, the fix). Exact duplicate prompts (the whole message list)
and prompts over ``max_prompt_length`` tokens after the chat template (counted as verl's filter
counts: the rendered text, no special tokens added) are filtered; a row the template cannot render
is rejected (verl's filter would drop it silently). Kept rows are written with every column as
read. Each data_source's reward function is checked as for the other recipes, its ground truth
answered in the recipe's form for that data_source. Last, verl's own ``RLHFDataset`` reads a
sample of each written split (its first rows, the first row of every data_source and agent loop,
the longest prompts) with its length filter on: it must keep every sampled row and return its
messages, ``index`` and ``tools_kwargs`` unchanged.
"""

from __future__ import annotations

import contextlib
import heapq
import io
import itertools
import json
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import pyarrow as pa

from verl_pipeline.data.checks import RewardCheck, SeenHashes
from verl_pipeline.data.recipes import VerlRecipe
from verl_pipeline.data.sources import Batch, Part, read_whole_rows
from verl_pipeline.exceptions import ConfigError, DataError

log = logging.getLogger(__name__)

REQUIRED_COLUMNS = ("prompt", "data_source", "reward_model")
#: Columns verl's RLHFDataset sets on every row itself (``index``, ``tools_kwargs`` and
#: ``interaction_kwargs`` from ``extra_info``): a column of that name never reaches the agent loop.
VERL_SETS = ("index", "tools_kwargs", "interaction_kwargs", "raw_prompt", "dummy_tensor")
#: verl's default image/video/audio keys: such rows are measured with the model's processor.
MEDIA_COLUMNS = ("images", "videos", "audios")
SINGLE_TURN_AGENT = "single_turn_agent"
#: Sampled rows per split for verl's own reader: the first ones, and the longest prompts.
_FIRST_ROWS, _LONGEST_ROWS = 4, 16
_MESSAGE_FIX = 'every message as {"role": "system" | "user" | "assistant" | "tool", "content": "<text>"}'


@dataclass(frozen=True)
class RowError:
    """What is wrong with one row: the column, a short reason (counted, in ``rejects.jsonl``), the
    problem and the fix."""

    column: str
    reason: str
    what: str
    fix: str

    def line(self, label: str, row: int) -> str:
        return f"{label} row {row}: column {self.column}: {self.what} (fix: {self.fix})"


def check_columns(schema: pa.Schema, label: str) -> None:
    """DataError (one line) when a column's type is not what verl reads."""
    names = schema.names
    missing = [c for c in REQUIRED_COLUMNS if c not in names]
    if missing:
        raise DataError(f"{label}: column(s) {missing} not found (columns: {names}); recipe verl reads rows in "
                        "verl's schema (prompt, data_source, reward_model, extra_info). Fix: add them, or use "
                        "recipe generic to map raw columns")
    for c in VERL_SETS:
        if c in names:
            where = f"extra_info.{c}" if c in ("index", "tools_kwargs", "interaction_kwargs") else "another name"
            raise DataError(f"{label}: column {c!r}: verl's RLHFDataset sets {c} on every row itself, so this "
                            f"column never reaches the agent loop. Fix: move it to {where}")
    media = [c for c in MEDIA_COLUMNS if c in names]
    if media:
        raise DataError(f"{label}: column(s) {media}: recipe verl checks text prompts only (verl measures image, "
                        "video and audio prompts with the model's processor, which preprocessing does not load). "
                        "Fix: drop the columns, or give the parquet to verl directly")
    _check_prompt_type(schema.field("prompt").type, label)
    for c in ("data_source", "agent_name", "ability"):
        if c in names and not _is_text(schema.field(c).type):
            raise DataError(f"{label}: column {c!r} has type {schema.field(c).type}; verl reads a string per row. "
                            f"Fix: write {c} as text")
    reward = schema.field("reward_model").type
    if not pa.types.is_struct(reward) or reward.get_field_index("ground_truth") < 0:
        raise DataError(f"{label}: column 'reward_model' has type {reward}; verl reads a dict with ground_truth. "
                        'Fix: {"style": "rule", "ground_truth": "<answer>"} in every row')
    if "extra_info" in names:
        _check_extra_info_type(schema.field("extra_info").type, label)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_null(t)


def _check_prompt_type(t: pa.DataType, label: str) -> None:
    is_list = pa.types.is_list(t) or pa.types.is_large_list(t)
    message = t.value_type if is_list else None
    if message is None or not pa.types.is_struct(message) or message.get_field_index("role") < 0 \
            or message.get_field_index("content") < 0:
        raise DataError(f"{label}: column 'prompt' has type {t}; recipe verl reads a list of chat messages. Fix: "
                        f"{_MESSAGE_FIX} (or recipe generic for a text column)")
    content = message.field("content").type
    if not _is_text(content):
        raise DataError(f"{label}: column 'prompt': message content has type {content}; recipe verl checks text "
                        "messages only. Fix: content as a string")


def _check_extra_info_type(t: pa.DataType, label: str) -> None:
    if pa.types.is_null(t):
        return
    if not pa.types.is_struct(t):
        raise DataError(f"{label}: column 'extra_info' has type {t}; verl reads a dict per row (extra_info.get("
                        "'index'), tools_kwargs, interaction_kwargs). Fix: write extra_info as a dict (a struct), "
                        "not a JSON string")
    for key in ("tools_kwargs", "interaction_kwargs"):
        i = t.get_field_index(key)
        if i >= 0 and not (pa.types.is_struct(t.field(i).type) or pa.types.is_null(t.field(i).type)):
            raise DataError(f"{label}: column 'extra_info': {key} has type {t.field(i).type}; verl passes it to the "
                            "agent loop as a dict. Fix: write it as a dict "
                            + ('{"<tool name>": {"create_kwargs": {...}}}' if key == "tools_kwargs" else "{...}"))


def row_error(prompt: Any, data_source: Any, reward: Any, info: Any, agent: Any, *, has_agent: bool) -> RowError | None:
    """The first thing wrong with one row (its values as Python objects), None when it is good."""
    if not isinstance(data_source, str) or not data_source.strip():
        return RowError("data_source", "missing_data_source", "is empty",
                        "name the data_source whose reward function scores the row")
    problem = _prompt_error(prompt)
    if problem is not None:
        return problem
    if reward is None:
        return RowError("reward_model", "missing_reward_model", "is null",
                        '{"style": "rule", "ground_truth": "<answer>"}')
    truth = reward.get("ground_truth")
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        return RowError("reward_model", "no_ground_truth", "has no ground_truth",
                        "set reward_model.ground_truth to the answer the reward function compares against")
    if has_agent and (not isinstance(agent, str) or not agent.strip()):
        return RowError("agent_name", "missing_agent_name",
                        "is empty, and verl's agent loop fails on an unregistered name at the first rollout",
                        "name the row's agent loop (single_turn_agent, tool_agent or one of agent_loop_config_path), "
                        "or drop the column to use rollout.agent.default_agent_loop")
    if info is not None and agent != SINGLE_TURN_AGENT:
        return _tools_error(info)
    return None


def _prompt_error(prompt: Any) -> RowError | None:
    if not prompt:
        return RowError("prompt", "empty_prompt", "has no messages", _MESSAGE_FIX)
    texts = []
    for i, m in enumerate(prompt, 1):
        if m is None:
            return RowError("prompt", "message_not_a_dict", f"message {i} is null", _MESSAGE_FIX)
        role = m.get("role")
        if not isinstance(role, str) or not role.strip():
            return RowError("prompt", "message_without_role", f"message {i} has no role", _MESSAGE_FIX)
        content = m.get("content")
        if content is None:
            if role == "assistant" and m.get("tool_calls"):
                continue
            return RowError("prompt", "message_without_content", f"message {i} ({role}) has no content", _MESSAGE_FIX)
        texts.append(content)
    if not any(t.strip() for t in texts):
        return RowError("prompt", "empty_prompt", "has only empty messages", "at least one message with text")
    return None


def _tools_error(info: dict[str, Any]) -> RowError | None:
    """tools_kwargs as verl's tool agent loop reads it (``tools_kwargs.get(tool)["create_kwargs"]``).

    Parquet stores dicts as structs of every key any row has, so a key this row lacks reads back as
    null, and the loop then fails on every call of that tool (``'NoneType' object has no attribute
    'get'``, answered to the model as a tool error)."""
    if "tools_kwargs" not in info or (info["tools_kwargs"] is None and info.get("need_tools_kwargs")):
        if info.get("need_tools_kwargs"):
            return RowError("extra_info", "tools_kwargs_missing", "need_tools_kwargs is true but the row has no "
                            "tools_kwargs", "the tools' create_kwargs for this row, or need_tools_kwargs: false")
        return None
    tools = info["tools_kwargs"]
    if tools is None:
        return RowError("extra_info", "tools_kwargs_null",
                        "tools_kwargs is null (another row has it, so Parquet filled it here), and verl's tool "
                        "agent loop fails on it at the first tool call",
                        "give every tool-calling row tools_kwargs with an entry for every tool, or agent_name "
                        "single_turn_agent for rows without tools")
    for tool, kwargs in tools.items():
        if kwargs is None or ("create_kwargs" in kwargs and kwargs["create_kwargs"] is None):
            what = f"tools_kwargs.{tool}" + ("" if kwargs is None else ".create_kwargs")
            return RowError("extra_info", "tools_kwargs_null",
                            f"{what} is null (another row has it, so Parquet filled it here), and verl's tool agent "
                            f"loop fails on every call of {tool} in this row",
                            f'an entry for every tool in every row ({{"{tool}": {{"create_kwargs": {{}}}}}})')
    return None


class ChatTemplateLengths:
    """Prompt tokens after the model's chat template, as verl's ``RLHFDataset`` filter counts them: the
    messages rendered with ``add_generation_prompt=True``, tokenized without special tokens.

    With a byte-level BPE tokenizer every token covers at least one byte, so a rendered prompt of at
    most ``max_len`` UTF-8 bytes has at most ``max_len`` tokens and is not tokenized (except the
    longest of each batch, for the longest-prompt report)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok: Any = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ConfigError("data.tokenizer", path, f"cannot load a tokenizer ({type(e).__name__}: {e})",
                              "the model directory (prefetched) or a directory with tokenizer files") from None
        backend = getattr(self.tok, "backend_tokenizer", None)
        desc = json.loads(backend.to_str()) if backend is not None else {}
        self.byte_level = (desc.get("model") or {}).get("type") == "BPE" and '"ByteLevel"' in json.dumps(
            desc.get("pre_tokenizer"))

    def render(self, messages: list[dict[str, Any]]) -> str | RowError:
        try:
            return str(self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
        except Exception as e:
            text = f"{type(e).__name__}: {e}".splitlines()[0][:200]
            return RowError("prompt", "chat_template_failed", f"the model's chat template cannot render it ({text})",
                            "messages the template accepts (its roles, in its order); verl's filter would drop "
                            "the row without a word")

    def count(self, texts: list[str], max_len: int, sample: int = 16) -> np.ndarray:
        """Token counts of ``texts`` (rendered prompts); -1 where a prompt provably fits ``max_len``."""
        out = np.full(len(texts), -1, dtype=np.int64)
        if self.byte_level:
            nbytes = np.fromiter((len(t.encode()) for t in texts), dtype=np.int64, count=len(texts))
            todo = np.union1d(np.flatnonzero(nbytes > max_len), np.argsort(nbytes, kind="stable")[-sample:])
        else:
            todo = np.arange(len(texts))
        if len(todo):
            ids = self.tok([texts[i] for i in todo], add_special_tokens=False, return_attention_mask=False)["input_ids"]
            out[todo] = [len(i) for i in ids]
        return out


class _Rewards:
    """One reward check per data_source (:class:`verl_pipeline.data.checks.RewardCheck`), made as each
    data_source first appears. verl is imported by one check's thread at a time (two threads importing
    transformers at once fail), so a data_source seen meanwhile waits in a queue."""

    def __init__(self, recipe: VerlRecipe) -> None:
        self.recipe = recipe
        self.checks: dict[str, RewardCheck] = {}
        self.queue: list[tuple[str, Any, dict[str, Any], str, int]] = []
        self.unchecked: dict[str, str] = {}
        self.scorer = (f"{recipe.custom_reward_path}:{recipe.custom_reward_name}" if recipe.custom_reward_path
                       else "verl.utils.reward_score.default_compute_score")

    @property
    def samples(self) -> int:
        return sum(c.samples for c in self.checks.values())

    def sample(self, data_source: str, truth: Any, extra_info: dict[str, Any], label: str, row: int) -> None:
        if data_source in self.unchecked:
            return
        if isinstance(truth, bool) or not isinstance(truth, str | int | float):
            if data_source not in self.checks:
                self.unchecked[data_source] = (f"ground truths are {type(truth).__name__}s: no answer form to "
                                               "check them with (the preflight scores them)")
            return
        self.queue.append((data_source, truth, extra_info, label, row))
        self.poll()

    def _loading(self) -> bool:
        return any(c.thread is not None and c.thread.is_alive() for c in self.checks.values())

    def poll(self) -> None:
        """Raise what failed; make the next data_source's check once no other is importing verl."""
        for c in self.checks.values():
            c.poll()
        while self.queue:
            data_source, truth, extra_info, label, row = self.queue[0]
            if data_source not in self.checks:
                if self._loading():
                    return
                self.checks[data_source] = RewardCheck(self.recipe.scoring_recipe(data_source))
            self.queue.pop(0)
            self.checks[data_source].sample(truth, extra_info, label, row)

    def wait(self) -> None:
        """Until every data_source's check has loaded and scored its samples; raises what failed."""
        while True:
            for c in list(self.checks.values()):
                c.wait()
            self.poll()
            if not self.queue and not self._loading():
                break
        for c in self.checks.values():
            c.wait()


@dataclass
class _Sample:
    """Rows of one split that verl's RLHFDataset reads back: where they came from and their values."""

    tables: list[pa.Table]
    origin: list[tuple[str, int, int]]  # (source label, source row, tokens or -1)
    longest: list[tuple[int, int, pa.Table, str, int]]  # a min-heap of (tokens, order seen, row, label, line)
    groups: set[tuple[str, str | None]]


class VerlRows:
    """One preprocessing run of rows already in verl's schema (the interface of ``preprocess._Run``)."""

    def __init__(self, recipe: VerlRecipe, options: dict[str, Any], tmp_dir: Path, tokenizer: str | None,
                 max_len: int | None, *, split_path: Callable[[Path, str], Path]) -> None:
        self.recipe = recipe
        self.tmp_dir = tmp_dir
        self.split_path = split_path
        # The tokenizer before any reward check starts importing verl in a thread (see _Rewards).
        self.lengths = ChatTemplateLengths(tokenizer) if tokenizer else None
        self.reward = _Rewards(recipe)
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.dedup = bool(options.get("dedup", True))
        self.seen = SeenHashes()
        self.every = max(2, round(1 / float(options.get("val_fraction", 0.1))))
        self.writers: dict[str, Any] = {}
        self.first_schema: dict[str, tuple[pa.Schema, str]] = {}
        self.rows = {"train": 0, "val": 0}
        self.read = 0
        self.rejected: Counter[str] = Counter()
        self.filtered: Counter[str] = Counter()
        self.data_sources: Counter[str] = Counter()
        self.agent_names: Counter[str] = Counter()
        self.longest: dict[str, Any] = {"tokens": 0}
        self.longest_kept = 0
        self.measured = 0
        self.first_error: str | None = None
        self.checked_parts: set[str] = set()
        self.samples = {s: _Sample([], [], [], set()) for s in ("train", "val")}
        self.order = itertools.count()
        self.verl_check: dict[str, Any] = {}
        self.rej: IO[str] = open(tmp_dir / "rejects.jsonl", "w", encoding="utf-8")
        self.filt: IO[str] = open(tmp_dir / "filtered.jsonl", "w", encoding="utf-8")

    def read_part(self, part: Part, batch_rows: int) -> Iterator[Batch]:
        return read_whole_rows(part, batch_rows)

    def close(self) -> None:
        for w in self.writers.values():
            w.close()
        self.rej.close()
        self.filt.close()

    # -- one batch -------------------------------------------------------------------------------

    def batch(self, b: Batch, part: Part, split: str) -> None:
        """Check one batch of whole rows, filter it (duplicates, overlong prompts), write what is left."""
        t = b.table
        if part.label not in self.checked_parts:
            check_columns(t.schema, part.label)
            self.checked_parts.add(part.label)
        self.read += t.num_rows
        self.reward.poll()
        prompts = t.column("prompt").to_pylist()
        sources = t.column("data_source").to_pylist()
        rewards = t.column("reward_model").to_pylist()
        has_agent = "agent_name" in t.column_names
        infos = t.column("extra_info").to_pylist() if "extra_info" in t.column_names else [None] * t.num_rows
        agents = t.column("agent_name").to_pylist() if has_agent else [None] * t.num_rows
        texts: list[str] = [""] * t.num_rows
        keep: list[int] = []
        for i in range(t.num_rows):
            problem = row_error(prompts[i], sources[i], rewards[i], infos[i], agents[i], has_agent=has_agent)
            if problem is None and self.lengths is not None:
                rendered = self.lengths.render(prompts[i])
                if isinstance(rendered, RowError):
                    problem = rendered
                else:
                    texts[i] = rendered
            if problem is None:
                keep.append(i)
            else:
                self._reject(part, split, int(b.rows[i]), problem)
        if self.dedup:
            keep = self._first_seen(keep, prompts, b.rows, part, split)
        tokens = np.full(t.num_rows, -1, dtype=np.int64)
        if self.lengths is not None and self.max_len is not None and keep:
            keep = self._short_enough(keep, texts, tokens, b.rows, part, split)
        if not keep:
            return
        firsts: set[str] = set()
        for i in keep:
            if sources[i] not in firsts:
                firsts.add(sources[i])
                self.reward.sample(sources[i], rewards[i]["ground_truth"], dict(infos[i] or {}), part.label,
                                   int(b.rows[i]))
        sel = np.asarray(keep, dtype=np.int64)
        if split == "all":
            is_val = b.rows[sel] % self.every == 0
            for name, pick in (("train", sel[~is_val]), ("val", sel[is_val])):
                self._write(name, t, pick, b.rows, tokens, sources, agents, part)
        else:
            self._write(split, t, sel, b.rows, tokens, sources, agents, part)

    def _reject(self, part: Part, split: str, row: int, problem: RowError) -> None:
        self.rejected[problem.reason] += 1
        line = problem.line(part.label, row)
        self.first_error = self.first_error or line
        self.rej.write(json.dumps({"source": part.label, "split": split, "line": row, "reason": problem.reason,
                                   "column": problem.column, "error": line}) + "\n")

    def _filter(self, reason: str, part: Part, split: str, row: int) -> None:
        self.filtered[reason] += 1
        self.filt.write(json.dumps({"source": part.label, "split": split, "line": row, "reason": reason}) + "\n")

    def _first_seen(self, keep: list[int], prompts: list[Any], rows: np.ndarray, part: Part, split: str) -> list[int]:
        """``keep`` without the rows whose whole message list this run has seen before."""
        hashes = np.fromiter((hash(json.dumps(prompts[i], sort_keys=True, ensure_ascii=False, default=str))
                              for i in keep), dtype=np.int64, count=len(keep))
        uniq, first = np.unique(hashes, return_index=True)
        is_first = np.zeros(len(hashes), dtype=bool)
        is_first[first] = True
        is_first &= ~self.seen.contains(hashes)
        self.seen.add(uniq)
        for j in np.flatnonzero(~is_first):
            self._filter("duplicate_prompt", part, split, int(rows[keep[j]]))
        return [keep[j] for j in np.flatnonzero(is_first)]

    def _short_enough(self, keep: list[int], texts: list[str], tokens: np.ndarray, rows: np.ndarray, part: Part,
                      split: str) -> list[int]:
        assert self.lengths is not None and self.max_len is not None
        counts = self.lengths.count([texts[i] for i in keep], self.max_len)
        self.measured += int((counts >= 0).sum())
        tokens[keep] = counts
        j = int(counts.argmax())
        if counts[j] > self.longest["tokens"]:
            self.longest = {"tokens": int(counts[j]), "source": part.label, "line": int(rows[keep[j]])}
        out = []
        for i, n in zip(keep, counts, strict=True):
            if n > self.max_len:
                self._filter("prompt_too_long", part, split, int(rows[i]))
            else:
                out.append(i)
        kept = counts[counts <= self.max_len]
        self.longest_kept = max(self.longest_kept, int(kept.max()) if len(kept) else 0)
        return out

    def _write(self, split: str, t: pa.Table, sel: np.ndarray, rows: np.ndarray, tokens: np.ndarray,
               sources: list[Any], agents: list[Any], part: Part) -> None:
        import pyarrow.parquet as pq

        if not len(sel):
            return
        table = t.take(pa.array(sel))
        if split not in self.writers:
            self.first_schema[split] = (table.schema, part.label)
            self.writers[split] = pq.ParquetWriter(self.split_path(self.tmp_dir, split), table.schema)
        schema, first = self.first_schema[split]
        if not table.schema.equals(schema):
            raise DataError(f"{part.label}: its columns ({table.schema.to_string(show_schema_metadata=False)}) "
                            f"differ from those of {first} in the {split} split; verl reads the files of a split "
                            "as one table. Fix: write them with the same columns and types")
        self.writers[split].write_table(table)
        self.data_sources.update(sources[i] for i in sel)
        self.agent_names.update(a for a in (agents[i] for i in sel) if a is not None)
        self._keep_sample(split, t, sel, rows, tokens, sources, agents, part)
        self.rows[split] += len(sel)

    def _keep_sample(self, split: str, t: pa.Table, sel: np.ndarray, rows: np.ndarray, tokens: np.ndarray,
                     sources: list[Any], agents: list[Any], part: Part) -> None:
        """The first rows, the first of each (data_source, agent_name) and the longest prompts of a split."""
        s = self.samples[split]
        # take, not slice: a slice would keep the whole batch's buffers alive.
        taken = set()
        for i in sel:
            group = (sources[i], agents[i])
            if len(s.origin) < _FIRST_ROWS or group not in s.groups:
                s.groups.add(group)
                s.tables.append(t.take([int(i)]))
                s.origin.append((part.label, int(rows[i]), int(tokens[i])))
                taken.add(int(i))
        measured = sel[tokens[sel] >= 0]
        for i in measured[np.argsort(tokens[measured], kind="stable")[-_LONGEST_ROWS:]]:
            if int(i) in taken or (len(s.longest) == _LONGEST_ROWS and tokens[i] <= s.longest[0][0]):
                continue
            entry = (int(tokens[i]), next(self.order), t.take([int(i)]), part.label, int(rows[i]))
            if len(s.longest) < _LONGEST_ROWS:
                heapq.heappush(s.longest, entry)
            else:
                heapq.heapreplace(s.longest, entry)

    # -- after the last batch --------------------------------------------------------------------

    def check_with_verl(self) -> dict[str, Any]:
        """verl's own ``RLHFDataset`` (and the tokenizer, length filter on) reads each split's sample:
        it must keep every row and return its messages, index and tools_kwargs as written."""
        import pyarrow.parquet as pq

        t0 = time.monotonic()
        check_dir = self.tmp_dir / ".verl-check"
        check_dir.mkdir()
        out: dict[str, Any] = {"length_filter": bool(self.lengths is not None and self.max_len)}
        try:
            for split, s in self.samples.items():
                tables = s.tables + [e[2] for e in s.longest]
                origin = s.origin + [(e[3], e[4], e[0]) for e in s.longest]
                if not tables:
                    continue
                path = check_dir / f"{split}.parquet"
                pq.write_table(pa.concat_tables(tables), path)
                out[split] = self._read_back(path, pa.concat_tables(tables), origin, check_dir / "cache")
        finally:
            import shutil

            shutil.rmtree(check_dir, ignore_errors=True)
        out["seconds"] = round(time.monotonic() - t0, 3)
        self.verl_check = out
        return out

    def _read_back(self, path: Path, sample: pa.Table, origin: list[tuple[str, int, int]],
                   cache: Path) -> dict[str, Any]:
        import datasets
        from omegaconf import OmegaConf
        from verl.utils.dataset.rl_dataset import RLHFDataset

        on = self.lengths is not None and self.max_len is not None
        cfg = OmegaConf.create({"max_prompt_length": int(self.max_len or 1024), "filter_overlong_prompts": on,
                                "filter_overlong_prompts_workers": 1, "cache_dir": str(cache), "prompt_key": "prompt"})
        # datasets keeps a converted copy of what it loads in its cache: here, in the temporary directory.
        saved = datasets.config.HF_DATASETS_CACHE
        datasets.config.HF_DATASETS_CACHE = cache / "datasets"
        printed = io.StringIO()
        tokenizer: Any = self.lengths.tok if self.lengths else None  # used by verl's length filter only
        try:
            with contextlib.redirect_stdout(printed):  # verl prints its counts; stdout may carry --json output
                ds = RLHFDataset(data_files=[str(path)], tokenizer=tokenizer, config=cfg)
                items = [ds[i] for i in range(len(ds))]
        except Exception as e:
            raise DataError(f"verl's RLHFDataset cannot read these rows ({type(e).__name__}: {e})".splitlines()[0]
                            + f"; sampled from {origin[0][0]} row {origin[0][1]} on") from None
        finally:
            datasets.config.HF_DATASETS_CACHE = saved
        log.debug("verl's RLHFDataset said: %s", printed.getvalue().strip())
        rows = sample.to_pylist()
        kept = {json.dumps(it["raw_prompt"], sort_keys=True, default=str) for it in items}
        for row, (label, line, tokens) in zip(rows, origin, strict=True):
            if json.dumps(row["prompt"], sort_keys=True, default=str) not in kept:
                raise DataError(f"{label} row {line}: verl's RLHFDataset drops this prompt as longer than "
                                f"max_prompt_length={self.max_len} where preprocessing counted {tokens} tokens")
        for it, row, (label, line, _) in zip(items, rows, origin, strict=True):
            info = row.get("extra_info") or {}
            expect = {"raw_prompt": row["prompt"], "index": info.get("index", 0),
                      "tools_kwargs": info.get("tools_kwargs", {})}
            for key, value in expect.items():
                if it[key] != value:
                    raise DataError(f"{label} row {line}: verl's RLHFDataset returns {key}={it[key]!r}, not the "
                                    f"{value!r} written")
        return {"sampled": len(rows), "kept": len(items),
                "tools_kwargs_rows": sum(1 for it in items if it["tools_kwargs"])}

    def stats(self, *, source_text: str, max_frac: float, tokenizer_digest: str, t0: float) -> dict[str, Any]:
        """What the run read, kept, rejected and filtered (``stats.json``, the task's counts)."""
        n_rej = sum(self.rejected.values())
        measured = self.lengths is not None and self.max_len
        return {
            "records_in": self.read, "train_rows": self.rows["train"], "val_rows": self.rows["val"],
            "written": self.rows["train"] + self.rows["val"], "rejected": dict(self.rejected),
            "reject_fraction": round(n_rej / self.read, 6), "max_reject_fraction": max_frac,
            "deduplicated": self.filtered.get("duplicate_prompt", 0),
            "too_long": self.filtered.get("prompt_too_long", 0),
            "length_filter": ({"tokenizer": self.tokenizer, "tokenizer_digest": tokenizer_digest,
                               "max_prompt_length": self.max_len, "longest_prompt": self.longest,
                               "longest_kept_tokens": self.longest_kept, "tokenized_rows": self.measured,
                               "byte_bound": bool(self.lengths and self.lengths.byte_level)}
                              if measured else "off (no tokenizer or max_prompt_length)"),
            "data_source": sorted(self.data_sources)[0] if len(self.data_sources) == 1 else "(per row)",
            "data_sources": dict(self.data_sources), "agent_names": dict(self.agent_names),
            "answer_forms": {ds: self.recipe.answer_form(ds) for ds in sorted(self.data_sources)},
            "recipe": self.recipe.name, "source": source_text,
            "scorer": self.reward.scorer, "scorer_samples": self.reward.samples,
            "scorer_not_checked": dict(self.reward.unchecked), "rlhf_dataset": self.verl_check,
            "seconds": round(time.monotonic() - t0, 3),
        }
