"""Versioned run directories and the ``latest`` pointer, on real files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from verl_pipeline import runs
from verl_pipeline.rundir import RunDir


def _record(root: Path, key: str, status: runs.RunStatus, *, profile: str = "smoke", step: int | None = None,
            data_key: str = "abc123") -> Path:
    run_dir = root / "runs" / key
    ckpt = root / "checkpoints" / key
    ckpt.mkdir(parents=True)
    if step is not None:
        (ckpt / f"global_step_{step}").mkdir()
        (ckpt / "latest_checkpointed_iteration.txt").write_text(f"{step}\n")
    (run_dir).mkdir(parents=True)
    (run_dir / "run_spec.json").write_text("{}")
    runs.record_run(
        run_dir=run_dir, run_key=key, run_name=f"verl_retrain__{profile}/{key}", profile=profile, status=status,
        checkpoint_dir=ckpt,
        data={"key": data_key, "train_path": "/d/train.parquet", "val_path": "/d/val.parquet", "counts": {"n": 1}},
        models={"actor": {"source": "hf://Qwen/Qwen2.5-0.5B-Instruct", "revision": "7ae557604adf", "path": "/m"}},
        submit={"submission_id": f"job-{key}", "mode": "train"},
    )
    return run_dir


def test_manifest_records_what_the_run_was_made_of(tmp_path: Path) -> None:
    run_dir = _record(tmp_path, "r1", runs.RunStatus.SUCCEEDED, step=40)
    m = json.loads(RunDir(run_dir).manifest_file.read_text())
    assert m["status"] == "succeeded" and m["profile"] == "smoke"
    assert m["data_hash"] == "abc123" and m["model_revision"] == "7ae557604adf"
    assert m["model_source"] == "hf://Qwen/Qwen2.5-0.5B-Instruct" and m["job_id"] == "job-r1" and m["mode"] == "train"
    assert m["latest_checkpoint_step"] == 40
    assert m["config_file"] == str(run_dir / "run_spec.json")
    # The run directory links its checkpoints (relative, so it survives a different mount point).
    link = run_dir / "checkpoints"
    assert link.is_symlink() and not os.readlink(link).startswith("/")
    assert (link / "global_step_40").is_dir()
    assert runs.read_manifest(run_dir).status is runs.RunStatus.SUCCEEDED


def test_latest_moves_only_to_succeeded_runs_and_keeps_the_previous(tmp_path: Path) -> None:
    assert runs.latest_run(tmp_path, "smoke") is None
    good1 = _record(tmp_path, "r1", runs.RunStatus.SUCCEEDED)
    assert runs.promote(tmp_path, "smoke", good1) is None
    assert runs.latest_run(tmp_path, "smoke") == good1.resolve()

    bad = _record(tmp_path, "r2", runs.RunStatus.FAILED)
    with pytest.raises(runs.RunRecordError, match="ended failed"):
        runs.promote(tmp_path, "smoke", bad)
    assert runs.latest_run(tmp_path, "smoke") == good1.resolve()

    good2 = _record(tmp_path, "r3", runs.RunStatus.SUCCEEDED, data_key="def456")
    assert runs.promote(tmp_path, "smoke", good2) == good1.resolve()
    assert runs.latest_run(tmp_path, "smoke") == good2.resolve()
    # Nothing was deleted: both good runs and the failed one are still there, manifests intact.
    assert [runs.read_manifest(d).run_key for d in (good1, bad, good2)] == ["r1", "r2", "r3"]
    assert RunDir(good1).manifest_file.is_file() and (good1 / "run_spec.json").is_file()
    # The pointer is a relative symlink (valid wherever the storage root is mounted).
    link = runs.latest_link(tmp_path, "smoke")
    assert link.is_symlink() and os.readlink(link) == os.path.join("..", "r3")
    assert not list(link.parent.glob(".*.tmp"))


def test_latest_is_per_profile(tmp_path: Path) -> None:
    a = _record(tmp_path, "a1", runs.RunStatus.SUCCEEDED, profile="smoke")
    b = _record(tmp_path, "b1", runs.RunStatus.SUCCEEDED, profile="gsm8k")
    runs.promote(tmp_path, "smoke", a)
    runs.promote(tmp_path, "gsm8k", b)
    assert runs.latest_run(tmp_path, "smoke") == a.resolve()
    assert runs.latest_run(tmp_path, "gsm8k") == b.resolve()
    with pytest.raises(runs.RunRecordError, match="belongs to profile"):
        runs.promote(tmp_path, "smoke", b)


def test_promote_needs_a_manifest(tmp_path: Path) -> None:
    d = tmp_path / "runs" / "x"
    d.mkdir(parents=True)
    with pytest.raises(runs.RunRecordError, match="no readable run manifest"):
        runs.promote(tmp_path, "smoke", d)
    assert runs.latest_run(tmp_path, "smoke") is None


def test_latest_survives_moving_the_storage_root(tmp_path: Path) -> None:
    """Relative links: the same volume mounted at another path still resolves (other host, container)."""
    root = tmp_path / "a"
    good = _record(root, "r1", runs.RunStatus.SUCCEEDED, step=5)
    runs.promote(root, "smoke", good)
    moved = tmp_path / "b"
    root.rename(moved)
    assert runs.latest_run(moved, "smoke") == (moved / "runs" / "r1").resolve()
    assert (moved / "runs" / "r1" / "checkpoints" / "global_step_5").is_dir()


def test_manifest_counts_the_newest_segments_checkpoint_in_run_steps(tmp_path: Path) -> None:
    """After a merge on a changed world size, segment 2 starts at run step 40 and verl saved its step 6."""
    from verl_pipeline.jobs.checkpoints import Segment, record_segment

    ckpt = tmp_path / "ckpt" / "seg"
    segment_dir = ckpt / "segment_2" / "checkpoints"
    (segment_dir / "global_step_6").mkdir(parents=True)
    record_segment(ckpt, Segment(2, 40, str(segment_dir), str(tmp_path / "merged"), 1, str(ckpt / "global_step_40")))
    assert runs.latest_checkpoint_step(ckpt) == 40
    (segment_dir / "latest_checkpointed_iteration.txt").write_text("6")
    assert runs.latest_checkpoint_step(ckpt) == 46
