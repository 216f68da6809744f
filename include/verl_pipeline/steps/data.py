"""The preprocess step: the run's data sources to verl's parquet, with the model's tokenizer."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from verl_pipeline.spec import DataSource, ModelSource, RunSpec

if TYPE_CHECKING:  # pyarrow and numpy stay out of DAG parsing
    from verl_pipeline.data.preprocess import PreprocessResult

log = logging.getLogger(__name__)


def tokenizer_for_model(model: ModelSource, cache_root: Path) -> str:
    """The directory whose tokenizer the run's model uses (the built-in model is built if needed)."""
    from verl_pipeline.models.prefetch import prefetch

    if model.kind == "path":
        return str(model.ref)
    return prefetch(model, cache_root).path


def preprocess(spec: RunSpec, sources: DataSource | Sequence[DataSource] | None = None,
               out_root: Path | None = None, recipe: str | None = None) -> PreprocessResult:
    """The run's data as verl's parquet (:func:`verl_pipeline.data.preprocess.preprocess`): its data
    options, its model's tokenizer (prefetched, or the built-in model built) and its max_prompt_length."""
    from verl_pipeline.data.preprocess import preprocess as write_parquet

    options = dict(spec.data_options)
    if recipe:
        options["recipe"] = recipe
    max_len = options.get("max_prompt_length") or spec.verl.get("data.max_prompt_length")
    tokenizer = options.get("tokenizer") or (tokenizer_for_model(spec.model, spec.model_cache) if max_len else None)
    return write_parquet(sources if sources is not None else spec.data, options,
                          out_root if out_root is not None else spec.data_root, tokenizer=tokenizer,
                          max_prompt_length=int(max_len) if max_len else None)
