"""The checks behind a trustworthy dataset: verl can score it, prompts fit, no duplicates.

- :class:`RewardCheck` — the recipe's ``data_source`` has a reward function in verl's
  ``default_compute_score`` (or the configured custom function), checked once per source while the
  first rows are read (verl loads in the background; nothing is published before it passed), and
  a sample ground truth per batch (the batch's first accepted row) scores 1.0
  when answered in the recipe's ``check_solution`` form.
- :class:`PromptLengths` — prompt tokens after the model's chat template, as verl's ``RLHFDataset``
  counts them, for every row.
- :class:`SeenHashes` — exact-duplicate prompts across the whole input in bounded memory
  (8 bytes per distinct prompt).
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from verl_pipeline.data.recipes import Recipe
from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.trainer.reward import RewardFunction
from verl_pipeline.trainer.reward import call as call_reward
from verl_pipeline.trainer.reward import load as load_reward

log = logging.getLogger(__name__)

VERL_SCORED_EXAMPLES = ("openai/gsm8k", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                        "HuggingFaceH4/MATH-500", "math_dapo", "aime*", "numina_*", "hiyouga/geometry3k", "searchR1_*")


class RewardCheck:
    """The run's reward function (the user's, or verl's ``default_compute_score``), verified to exist and
    to accept the ground truths, called as verl's reward manager calls it (:mod:`verl_pipeline.trainer.reward`)."""

    def __init__(self, recipe: Recipe) -> None:
        self.recipe = recipe
        self.samples = 0
        self.queued: list[tuple[Any, dict[str, Any], str, int]] = []
        self.fn: Callable[..., Any] | None = None
        self.error: BaseException | None = None
        if recipe.custom_reward_path:
            self.function = RewardFunction(recipe.custom_reward_path, recipe.custom_reward_name,
                                           dict(recipe.custom_reward_kwargs), "data.custom_reward_path")
            self.fn = load_reward(self.function)
            self.scorer = self.function.label
            self.thread = None
        else:
            self.function = RewardFunction("verl/utils/reward_score/__init__.py", "default_compute_score",
                                           named_by="verl's default")
            self.scorer = "verl.utils.reward_score.default_compute_score"
            # Importing verl (torch) takes seconds: rows are read, checked and written (to the
            # unpublished temp directory) meanwhile; samples wait in a queue until it is loaded.
            self.thread = threading.Thread(target=self._init_verl, name="verl-reward-import", daemon=True)
            self.thread.start()

    def _init_verl(self) -> None:
        try:
            from verl.utils.reward_score import default_compute_score

            self.fn = default_compute_score
            self._check_source()
        except BaseException as e:  # re-raised by wait() in the caller's thread
            self.error = e

    def _check_source(self) -> None:
        """Score one known-good sample: verl has a scorer for the data_source, or the run is refused.

        verl 0.9.1 keeps no list of the data_sources it scores: ``default_compute_score`` is a chain of
        cases, and a data_source that none of them matches raises ``NotImplementedError`` (its last
        case, verl/utils/reward_score/__init__.py). That exception is the refusal. A custom function is
        only called on the rows themselves (with their ``extra_info``), in :meth:`sample`."""
        assert self.fn is not None
        try:
            self.fn(self.recipe.data_source, self.recipe.check_solution.format(ground_truth="1"), "1", extra_info={})
        except NotImplementedError as no_scorer:
            raise ConfigError("data.data_source", self.recipe.data_source,
                              f"{self.scorer} has no reward function for this data_source ({no_scorer})",
                              f"a data_source verl scores ({', '.join(VERL_SCORED_EXAMPLES)}) or set "
                              "data.custom_reward_path (or reward.custom_reward_function.path) to your reward "
                              "function's file") from None

    def wait(self) -> None:
        """Until the scorer is loaded and the data_source checked, then every queued sample scored;
        raises what failed."""
        if self.thread is not None:
            self.thread.join()
        self.poll()

    def poll(self) -> None:
        """Raise at once if loading the scorer or checking the data_source failed; once loaded, score
        the samples queued while it loaded. Never blocks."""
        if self.error is not None:
            raise self.error
        if self.fn is not None and (self.thread is None or not self.thread.is_alive()):
            queued, self.queued = self.queued, []
            for args in queued:
                self._score(*args)

    def sample(self, ground_truth: Any, extra_info: dict[str, Any], label: str, line: int) -> None:
        """Check one ground truth with the ``extra_info`` its row will carry in the parquet: now when the
        scorer is loaded, else as soon as it is (``poll``/``wait``).

        Reading and checking rows goes on while verl is imported; nothing is published before
        ``wait`` returned, and a failure of the import shows at the next ``poll``.
        """
        self.queued.append((ground_truth, extra_info, label, line))
        self.poll()

    def _score(self, ground_truth: Any, extra_info: dict[str, Any], label: str, line: int) -> None:
        assert self.fn is not None
        solution = self.recipe.check_solution.format(ground_truth=ground_truth)
        value = call_reward(self.fn, self.function, data_source=self.recipe.data_source, solution=solution,
                            ground_truth=ground_truth, extra_info=extra_info, where=f"{label} line {line}")
        self.samples += 1
        if value < 1.0:
            raise DataError(
                f"{label} line {line}: {self.scorer} scores the extracted ground truth {ground_truth!r} "
                f"{value} (not 1.0) for data_source {self.recipe.data_source!r} answered as {solution!r}: "
                "this scorer cannot reward correct answers for these rows. Fix: a data_source whose scorer "
                "matches these answers, a different answer_extraction, or check_solution in the recipe")


class PromptLengths:
    """Token counts of prompts after the chat template (``add_generation_prompt=True``), like verl's filter.

    The template is rendered once around a marker to get the text before and after the user
    content; that split is verified against the real template on sample rows, and if it ever
    differs every row is rendered by the template itself.
    """

    _MARK = "\u2063VERL_PIPELINE_PROMPT\u2063"

    def __init__(self, path: str, system_prompt: str | None) -> None:
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(path)
        except Exception as e:
            raise ConfigError("data.tokenizer", path, f"cannot load a tokenizer ({type(e).__name__}: {e})",
                              "the model directory (prefetched) or a directory with tokenizer files") from None
        self.system_prompt = system_prompt
        text = self._render(self._MARK)
        if text.count(self._MARK) != 1:
            raise ConfigError("data.tokenizer", path, "the chat template does not show the user content once")
        self.prefix, self.suffix = text.split(self._MARK)
        self.exact = True
        self.verified = 0
        backend = self.tok.backend_tokenizer
        self.encode = getattr(backend, "encode_batch_fast", None) or backend.encode_batch
        desc = json.loads(backend.to_str())
        self.byte_level = (desc.get("model") or {}).get("type") == "BPE" and '"ByteLevel"' in json.dumps(
            desc.get("pre_tokenizer"))
        self.overhead = len(self.prefix.encode()) + len(self.suffix.encode())

    def messages(self, content: str) -> list[dict[str, str]]:
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*msgs, {"role": "user", "content": content}]

    def _render(self, content: str) -> str:
        return str(self.tok.apply_chat_template(self.messages(content), add_generation_prompt=True, tokenize=False))

    def lengths(self, contents: Any, max_len: int | None = None, sample: int = 64) -> np.ndarray:
        """Token counts of ``contents`` (an Arrow string array); -1 where a row provably fits.

        With a byte-level BPE tokenizer every token covers at least one byte, so a prompt of at most
        ``max_len`` UTF-8 bytes (template included) has at most ``max_len`` tokens: such rows are
        not tokenized, except the ``sample`` longest of each call (for the longest-prompt report).
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        n = len(contents)
        out = np.full(n, -1, dtype=np.int64)
        if not n:
            return out
        if self.exact and self.verified < 16:
            for c in contents.slice(0, 4).to_pylist():
                if self._render(c) != self.prefix + c + self.suffix:
                    log.warning("The chat template does not wrap prompts uniformly: rendering every prompt")
                    self.exact = False
                    break
                self.verified += 1
        if self.exact and self.byte_level and max_len is not None:
            nbytes = np.asarray(pc.binary_length(contents).to_numpy(zero_copy_only=False)) + self.overhead
            todo = np.flatnonzero(nbytes > max_len)
            if sample:
                longest = np.argsort(nbytes, kind="stable")[-sample:]
                todo = np.union1d(todo, longest)
        else:
            todo = np.arange(n)
        if not len(todo):
            return out
        picked = contents.take(pa.array(todo)).to_pylist()
        texts = [self.prefix + c + self.suffix for c in picked] if self.exact else [self._render(c) for c in picked]
        enc = self.encode(texts, add_special_tokens=False)
        out[todo] = np.fromiter((len(e) for e in enc), dtype=np.int64, count=len(texts))
        return out


class SeenHashes:
    """A set of 64-bit (int64) prompt hashes as sorted numpy runs merged like an LSM tree (8 bytes per entry)."""

    def __init__(self) -> None:
        self.runs: list[np.ndarray] = []

    def __len__(self) -> int:
        return sum(len(r) for r in self.runs)

    def contains(self, h: np.ndarray) -> np.ndarray:
        found = np.zeros(len(h), dtype=bool)
        for run in self.runs:
            idx = np.searchsorted(run, h)
            idx[idx == len(run)] = len(run) - 1
            found |= run[idx] == h
        return found

    def add(self, sorted_unique: np.ndarray) -> None:
        if not len(sorted_unique):
            return
        self.runs.append(sorted_unique)
        while len(self.runs) > 1 and len(self.runs[-2]) <= 2 * len(self.runs[-1]):
            b = self.runs.pop()
            a = self.runs.pop()
            merged = np.concatenate([a, b])
            merged.sort(kind="stable")
            self.runs.append(merged)
