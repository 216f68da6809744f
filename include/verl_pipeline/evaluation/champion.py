"""The profile's champion: the model a new run is compared with, beside its base model.

The champion is the model of the run ``<storage>/runs/latest/<profile>`` points to
(:func:`verl_pipeline.runs.latest_run`), when that run is not the one evaluated, has an exported model
(:func:`verl_pipeline.models.export.read_export`) and was itself evaluated on the same rows: its
``evaluation.json`` has the data hash of the rows scored now. A champion evaluated on other rows was
trained and judged on other data; its scores here would compare two tasks. Every case without a
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


def find_champion(storage_root: Path, profile: str, *, this_run: Path, data_hash: str | None) -> Champion:
    """The champion of ``profile`` for a run evaluated on rows of ``data_hash`` (None: not known here)."""
    link = latest_link(storage_root, profile)
    latest = latest_run(storage_root, profile)
    if latest is None:
        return _none(f"no champion: {link} names no run (no run of profile {profile!r} was published yet)")
    if latest.resolve() == this_run.resolve():
        return _none(f"no champion: {link} is this run")
    export = read_export(latest)
    if export is None:
        return _none(f"no champion: the latest run {latest} has no exported model ({RunDir(latest).model_dir})")
    if data_hash is None:
        return _none(f"no champion: the hash of the rows is not known here, so {latest}'s evaluation cannot be "
                     "matched to them")
    recorded = (RunDir(latest).evaluation() or {}).get("data_hash")
    if recorded is None:
        return _none(f"no champion: the latest run {latest} has no evaluation ({RunDir(latest).evaluation_file}), "
                     "so it is not known to have been scored on these rows")
    if recorded != data_hash:
        return _none(f"no champion: the latest run {latest} was evaluated on other rows (data hash "
                     f"{recorded[:12]}…, these are {data_hash[:12]}…)")
    return Champion(latest, export.model_dir, f"champion: {latest} ({link}), evaluated on the same rows")


__all__ = ["Champion", "find_champion"]
