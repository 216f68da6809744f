"""Versioned run directories and the per-profile ``latest`` pointer.

Every run has its own directory, ``<storage>/runs/<run_key>/`` (``run_key`` is unique per DAG run),
holding ``run_spec.json`` (the resolved config), ``job.json``, one verl metrics file per attempt
(:meth:`verl_pipeline.rundir.RunDir.metrics_file`), the run report (``report/``), a ``checkpoints``
link to the run's checkpoint directory and ``manifest.json``: what the run was made of (data content
hash, model source and revision, mode, Ray job) and how it ended.

``<storage>/runs/latest/<profile>`` is a relative symlink to the run directory of the profile's most
recent *successful* run. It moves with an atomic rename, only to a run whose manifest says
``succeeded``; nothing here ever deletes a run directory, so the previous good run stays intact.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import PipelineError
from verl_pipeline.paths import slug, write_json_atomic
from verl_pipeline.rundir import RunDir, tracker_step

log = logging.getLogger(__name__)

LATEST_DIR = "latest"
MANIFEST_VERSION = 2


class RunStatus(str, Enum):
    SUCCEEDED = "succeeded"
    FAILED = "failed"


class RunRecordError(PipelineError):
    """A run directory or the latest pointer is not what it should be."""


@dataclass
class RunManifest:
    """What a run was made of and how it ended (``manifest.json`` of its run directory)."""

    run_key: str
    run_name: str
    profile: str
    status: RunStatus
    mode: str | None
    data_hash: str | None
    data: dict[str, Any]
    model_source: str | None
    model_revision: str | None
    model_path: str | None
    config_file: str
    checkpoint_dir: str
    latest_checkpoint_step: int | None
    job_id: str | None
    #: verl's metrics of every attempt, oldest first (version 1 named a ``metrics.jsonl`` never written).
    metrics_files: list[str] = field(default_factory=list)
    #: The promotion rule's verdict (``promotion.Verdict``) of a trained run; None: nothing was judged.
    promotion: dict[str, Any] | None = None
    finished_at: float = field(default_factory=time.time)
    version: int = MANIFEST_VERSION

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["status"] = self.status.value
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunManifest:
        fields: dict[str, Any] = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["status"] = RunStatus(data["status"])
        return cls(**fields)


def latest_checkpoint_step(checkpoint_dir: Path) -> int | None:
    """The run step of the newest checkpoint verl's tracker names, in the newest segment (after a merge
    on a changed world size, the segment's verl steps count from its start); None when it saved none."""
    from verl_pipeline.jobs.checkpoints import current_segment

    ckpt, start, _ = current_segment(checkpoint_dir)
    step = tracker_step(ckpt)
    if step is None:
        return start or None  # a segment that saved nothing yet starts from the checkpoint it merged
    return start + step


def _relative_link(link: Path, target: Path) -> None:
    """Create or atomically replace the symlink ``link`` → ``target`` (stored relative)."""
    link.parent.mkdir(parents=True, exist_ok=True)
    # Both sides resolved: the link stays valid when the storage root is mounted elsewhere.
    rel = os.path.relpath(target.resolve(), link.parent.resolve())
    tmp = link.parent / f".{link.name}.{os.getpid()}.tmp"
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(rel, tmp)
    os.replace(tmp, link)


def record_run(
    *,
    run_dir: Path,
    run_key: str,
    run_name: str,
    profile: str,
    status: RunStatus,
    checkpoint_dir: Path,
    data: dict[str, Any] | None = None,
    models: dict[str, Any] | None = None,
    submit: dict[str, Any] | None = None,
    promotion: dict[str, Any] | None = None,
) -> RunManifest:
    """Write the run's ``manifest.json`` (atomically) and its ``checkpoints`` link; return the manifest."""
    data = data or {}
    actor = (models or {}).get("actor") or {}
    submit = submit or {}
    # The run's last job: a retry's (or, on a shared cluster, the wait task's) when there was one.
    attempts = RunDir(run_dir).attempts()
    manifest = RunManifest(
        run_key=run_key,
        run_name=run_name,
        profile=profile,
        status=status,
        mode=submit.get("mode"),
        data_hash=data.get("key"),
        data={k: data.get(k) for k in ("train_path", "val_path", "counts") if k in data},
        model_source=actor.get("source"),
        model_revision=actor.get("revision"),
        model_path=actor.get("path"),
        config_file=str(RunDir(run_dir).spec_file),
        checkpoint_dir=str(checkpoint_dir),
        latest_checkpoint_step=(tracker_step(checkpoint_dir) or 0),
        job_id=attempts[-1].submission_id if attempts else submit.get("submission_id"),
        metrics_files=[str(p) for p in RunDir(run_dir).metrics_files().values()],
        promotion=promotion,
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    _relative_link(RunDir(run_dir).checkpoints_link, checkpoint_dir)
    write_json_atomic(RunDir(run_dir).manifest_file, manifest.to_dict())
    return manifest


def read_manifest(run_dir: Path) -> RunManifest:
    import json

    path = RunDir(run_dir).manifest_file
    try:
        return RunManifest.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RunRecordError(f"no readable run manifest at {path}: {e}") from e


def latest_link(storage_root: Path, profile: str) -> Path:
    """``<storage>/runs/latest/<profile>``: beside the run directories, so it lives on the same (shared)
    volume and its relative target ``../<run_key>`` resolves wherever that volume is mounted."""
    return storage_root / "runs" / LATEST_DIR / slug(profile, 80)


def latest_run(storage_root: Path, profile: str) -> Path | None:
    """The run directory ``latest`` points to for ``profile``, or None before the first good run."""
    link = latest_link(storage_root, profile)
    if not link.is_symlink():
        return None
    target = (link.parent / os.readlink(link)).resolve()
    return target if target.is_dir() else None


def promote(storage_root: Path, profile: str, run_dir: Path) -> Path | None:
    """Point ``latest/<profile>`` at ``run_dir``, which must hold a succeeded manifest of ``profile``.

    Returns the run directory ``latest`` pointed to before (kept, never deleted).
    """
    manifest = read_manifest(run_dir)
    if manifest.status is not RunStatus.SUCCEEDED:
        raise RunRecordError(f"run {manifest.run_key} ended {manifest.status.value}: latest is not moved")
    if manifest.profile != profile:
        raise RunRecordError(f"run {manifest.run_key} belongs to profile {manifest.profile!r}, not {profile!r}")
    previous = latest_run(storage_root, profile)
    _relative_link(latest_link(storage_root, profile), run_dir.resolve())
    log.info("latest/%s -> %s (was %s)", profile, run_dir, previous)
    return previous
