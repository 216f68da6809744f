"""The manifest of a prefetched model: what was fetched (revision, files, sizes, hashes) and that it was verified.

It is written atomically, beside the model directory, only after the download completed and the
directory passed :func:`verl_pipeline.trainer.verify.verify_model_dir`. A directory without a
manifest is incomplete. A repeat run checks the manifest against the files on disk (stat and
safetensors headers, never a hash of the weights).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ModelError
from verl_pipeline.paths import write_json_atomic

MANIFEST_FORMAT = 1


def manifest_path(directory: Path, name: str) -> Path:
    """The manifest of the model ``name`` (a commit, a version, a keyed local path) in ``directory``."""
    return directory / f"{name}.manifest.json"


@dataclass
class FileEntry:
    size: int
    sha256: str | None = None
    blob_id: str | None = None
    #: Only for sources that have no revision (local directories): a change of mtime means a new model.
    mtime_ns: int | None = None


@dataclass
class Manifest:
    source: str
    kind: str
    path: str
    revision: str | None
    commit: str | None
    files: dict[str, FileEntry]
    facts: dict[str, Any] = field(default_factory=dict)
    #: What the remote listed when this was fetched (fsspec sources: sizes and etags/mtimes).
    remote: dict[str, Any] = field(default_factory=dict)
    created_at: float = field(default_factory=time.time)
    format: int = MANIFEST_FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["total_bytes"] = self.total_bytes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Manifest:
        return cls(
            source=d["source"], kind=d["kind"], path=d["path"], revision=d.get("revision"), commit=d.get("commit"),
            files={k: FileEntry(**v) for k, v in d["files"].items()}, facts=dict(d.get("facts") or {}),
            remote=dict(d.get("remote") or {}), created_at=float(d.get("created_at") or 0.0),
            format=int(d.get("format") or 0),
        )

    def write(self, dest: Path) -> None:
        write_json_atomic(dest, self.to_dict())


def read_manifest(path: Path) -> Manifest | None:
    """The manifest at ``path``; None when absent, unreadable or of another format (then it is rebuilt)."""
    try:
        data = json.loads(path.read_text())
        m = Manifest.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return m if m.format == MANIFEST_FORMAT else None


def list_files(root: Path) -> dict[str, Path]:
    """Files under ``root`` by relative POSIX path, skipping hidden entries (download metadata)."""
    out: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            if not name.startswith("."):
                p = Path(dirpath) / name
                out[p.relative_to(root).as_posix()] = p
    return out


def check_against_disk(manifest: Manifest, root: Path) -> None:
    """Every file of the manifest exists under ``root`` with its size (and mtime when recorded) and every
    safetensors header still fits its file. ModelError naming the first file that does not match."""
    from verl_pipeline.trainer.verify import check_safetensors

    for rel, entry in manifest.files.items():
        p = root / rel
        try:
            st = p.stat()
        except OSError:
            raise ModelError(f"{p}: listed in the manifest but missing on disk") from None
        if st.st_size != entry.size:
            raise ModelError(f"{p}: {st.st_size} bytes on disk, the manifest says {entry.size}")
        if entry.mtime_ns is not None and st.st_mtime_ns != entry.mtime_ns:
            raise ModelError(f"{p}: modified since it was verified")
        if rel.endswith(".safetensors"):
            check_safetensors(p)


__all__ = ["MANIFEST_FORMAT", "FileEntry", "Manifest", "check_against_disk", "list_files", "manifest_path",
           "read_manifest"]
