"""The profile's champion: the model a new run is compared with, beside its base model.

The champion is the model of the run ``<storage>/runs/latest/<profile>`` points to
(:func:`verl_pipeline.runs.latest_run`), when that run is not the one evaluated and has an exported model
(:func:`verl_pipeline.models.export.read_export`). It is always scored again, in the same job and on the
same rows as the new model: a retraining run on new data is compared with the model in service on that
data, never with the champion's old scores on the rows it was trained for. Every case without a
champion says why (:attr:`Champion.note`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verl_pipeline.models.export import read_export
from verl_pipeline.rundir import RunDir
from verl_pipeline.runs import latest_link, latest_run


@dataclass(frozen=True)
class Champion:
    """The champion's run directory and model directory (both None when there is none), and why."""

    run_dir: Path | None
    model_dir: str | None
    note: str


def _none(note: str) -> Champion:
    return Champion(None, None, note)


def find_champion(storage_root: Path, profile: str, *, this_run: Path) -> Champion:
    """The champion of ``profile`` for a run being evaluated (none, and why, when there is no other
    published run with an exported model)."""
    link = latest_link(storage_root, profile)
    latest = latest_run(storage_root, profile)
    if latest is None:
        return _none(f"no champion: {link} names no run (no run of profile {profile!r} was published yet)")
    if latest.resolve() == this_run.resolve():
        return _none(f"no champion: {link} is this run")
    export = read_export(latest)
    if export is None:
        return _none(f"no champion: the latest run {latest} has no exported model ({RunDir(latest).model_dir})")
    return Champion(latest, export.model_dir, f"champion: {latest} ({link}), scored on these rows")


__all__ = ["Champion", "find_champion"]
