"""The held-out rows an evaluation scores instead of the validation split: the run profile's
``evaluation.data``, checked before any cluster starts.

verl validates on ``data.val_files`` during training (``test_freq``), and a profile tuned until that
score looks good has used the split to choose a model. A team that keeps a set no run trains on or is
chosen by names it here: a parquet in verl's row schema (``prompt`` as chat messages, ``data_source``,
``reward_model.ground_truth``, optional ``extra_info``), on storage every node of the cluster sees. It is
checked at provision: on a cluster that shares this machine's disk (the local backend) the file must be
here; on any other it must lie under one of the cluster's shared mounts, and where this machine sees the
file too its columns are read (the schema only) and checked as the ``verl`` recipe checks its input. The
environment probe then checks that every node sees it (``scores.HELD_OUT_KEY`` among the job's paths).
"""

from __future__ import annotations

import logging
from pathlib import Path

from verl_pipeline.exceptions import ConfigError, DataError
from verl_pipeline.spec import RunSpec, require_shared

log = logging.getLogger(__name__)


def check_held_out(spec: RunSpec) -> str | None:
    """The held-out parquet's path when the run evaluates on one (None: the validation split); a one-line
    ConfigError when it cannot be read where the evaluation job runs, or its columns are not verl's."""
    path = spec.evaluation.data if spec.evaluation.enabled else None
    if path is None:
        return None
    key = f"profiles/{spec.profile}.evaluation.data"
    local = spec.cluster.get("backend") == "local"
    if not local:
        require_shared(key, path, spec.shared_roots, "the evaluation job's node would not find it")
    if not Path(path).is_file():
        if local:
            raise ConfigError(key, path, "does not exist", "the held-out rows' parquet, or data: null (the run's "
                              "validation split)")
        log.info("Run %s: %s=%s is not visible here; the environment probe checks it on every node", spec.run_name,
                 key, path)
        return path
    _check_schema(Path(path), key)
    return path


def _check_schema(path: Path, key: str) -> None:
    import pyarrow.parquet as pq

    from verl_pipeline.data.verl_rows import check_columns

    try:
        schema = pq.read_schema(path)
    except (OSError, ValueError) as e:
        raise ConfigError(key, str(path), f"is not a readable parquet file ({type(e).__name__}: {e})",
                          "a parquet in verl's row schema") from None
    try:
        check_columns(schema, f"{key}={str(path)!r}")
    except DataError as e:
        raise ConfigError(key, str(path), f"is not in verl's row schema: {e}", "write the held-out rows as the verl "
                          "recipe reads them (docs/data.md)") from None


__all__ = ["check_held_out"]
