"""The evaluation rows, and one model's scores on them with the run's reward function.

Each response is scored as verl's naive reward manager scores a rollout: the reward function called with
keywords (``data_source``, ``solution_str``, ``ground_truth``, ``extra_info`` with verl's additions,
the run's ``reward_kwargs``), its number or its dict's ``score`` taken (:func:`verl_pipeline.trainer.reward.call`).
Without a reward function of the run's own, verl's ``default_compute_score`` scores.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.evaluation.generate import Response
from verl_pipeline.exceptions import DataError
from verl_pipeline.scores import EXAMPLES, Example, ModelScore
from verl_pipeline.trainer import reward

#: verl's scorer for its known data sources, used when the run names no reward function.
VERL_DEFAULT = reward.RewardFunction("verl.utils.reward_score", "default_compute_score", named_by="reward")
#: A response scoring at least this passes (``ModelScore.pass_rate``).
PASS_SCORE = 1.0
_FIX = "the pipeline's preprocess writes verl's RLHF parquet (prompt, data_source, reward_model, extra_info)"


@dataclass(frozen=True)
class Row:
    """One evaluation row, as verl's reward manager reads it."""

    messages: list[dict[str, Any]]
    data_source: str
    ground_truth: Any
    extra_info: dict[str, Any]

    @property
    def prompt(self) -> str:
        """The prompt's text as a person reads it: its messages' contents, one per line."""
        return "\n".join(str(m.get("content", "")) for m in self.messages)


def _row(data: Mapping[str, Any], where: str) -> Row:
    messages = data.get("prompt")
    scored = data.get("reward_model")
    truth = scored.get("ground_truth") if isinstance(scored, Mapping) else None
    if not isinstance(messages, list) or not messages or not all(isinstance(m, Mapping) for m in messages):
        raise DataError(f"{where}: column prompt is {messages!r}, not a list of chat messages. Fix: {_FIX}")
    if truth is None:
        raise DataError(f"{where}: no reward_model.ground_truth. Fix: {_FIX}")
    return Row([dict(m) for m in messages], str(data.get("data_source") or ""), truth,
               dict(data.get("extra_info") or {}))


def read_rows(path: str) -> list[Row]:
    """Every row of the parquet file at ``path``; a missing file or column is one DataError."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as e:
        raise DataError(f"the evaluation rows {path} cannot be read ({type(e).__name__}: {e}). Fix: the path of "
                        "the run's validation parquet (its data.val_files)") from None
    return [_row(r, f"{path} row {i}") for i, r in enumerate(table.to_pylist())]


@dataclass(frozen=True)
class Scorer:
    """The reward function that scores (``func``) and what it is (``fn``: its file, name and kwargs)."""

    func: Callable[..., Any]
    fn: reward.RewardFunction

    def scores(self, rows: Sequence[Row], responses: Sequence[Response], *, where: str) -> list[float]:
        """Each response's score, the function called as verl's naive reward manager calls it."""
        return [reward.call(self.func, self.fn, data_source=row.data_source, solution=resp.text,
                            ground_truth=row.ground_truth, extra_info=row.extra_info, where=f"{where} row {i}")
                for i, (row, resp) in enumerate(zip(rows, responses, strict=True))]


def reward_function(fn: reward.RewardFunction | None) -> Scorer:
    """The run's reward function (a relative path read from this process's working directory, the job's
    working_dir), else verl's ``default_compute_score``."""
    if fn is None:
        from verl.utils.reward_score import default_compute_score

        return Scorer(default_compute_score, VERL_DEFAULT)
    path = Path(fn.path).expanduser()
    found = reward.RewardFunction(str(path if path.is_absolute() else Path(os.getcwd()) / path), fn.name,
                                  dict(fn.kwargs), fn.named_by)
    return Scorer(reward.load(found), found)


def model_score(path: str, rows: Sequence[Row], responses: Sequence[Response], scores: Sequence[float], *,
                run_dir: str | None = None) -> ModelScore:
    """One model's :class:`~verl_pipeline.scores.ModelScore` over ``rows`` (their responses and scores)."""
    if not rows:
        raise DataError(f"no rows to score {path} on. Fix: evaluation rows with at least one row")
    examples = tuple(Example(prompt=row.prompt, response=resp.text, ground_truth=str(row.ground_truth), score=s)
                     for row, resp, s in list(zip(rows, responses, scores, strict=True))[:EXAMPLES])
    return ModelScore(path=path, mean_reward=statistics.fmean(scores),
                      pass_rate=sum(s >= PASS_SCORE for s in scores) / len(scores),
                      mean_response_length=statistics.fmean(r.tokens for r in responses), n=len(rows),
                      examples=examples, run_dir=run_dir)


__all__ = ["PASS_SCORE", "VERL_DEFAULT", "Row", "Scorer", "model_score", "read_rows", "reward_function"]
