"""A retry on a smaller cluster with ``on_world_size_change: merge`` continues from the merged weights.

Real Ray (the session's local head), a real FSDP checkpoint that 2 ranks wrote (the session's
``fsdp_checkpoint``, as the first attempt on 1 x 2 GPUs would have left it at step 2), verl's merger,
and the stand-in trainer training the new segment for real (``+fake.real_fsdp=true``: FSDP on 1 rank
from the merged weights, saved by verl's checkpoint manager).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.faults.conftest import metric_lines
from verl_pipeline.cluster.base import ClusterHandle
from verl_pipeline.constants import JobState, Mode
from verl_pipeline.jobs.checkpoints import list_checkpoints, read_segments
from verl_pipeline.jobs.submit import submit_or_reattach
from verl_pipeline.profiles import build_run_spec
from verl_pipeline.rundir import RunDir
from verl_pipeline.trainer.render import render_job

pytestmark = pytest.mark.integration

JOB_TIMEOUT_S = 300


def test_retry_on_a_smaller_world_size_merges_and_trains_a_new_segment(
    checkpoint_env: Path, ray_cluster: ClusterHandle, fsdp_checkpoint: Path, tiny_model_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    cfg = Path(os.environ["VERL_PIPELINE_CONFIGS"])
    prof = yaml.safe_load((cfg / "profiles" / "ckpt.yaml").read_text())
    prof["on_world_size_change"] = "merge"
    prof["trainer"]["total_training_steps"] = 4
    # Actor only (GRPO), as the real checkpoint was written; the segment trains for real.
    prof["verl"]["algorithm"] = {"adv_estimator": "grpo"}
    prof["verl"]["actor_rollout_ref"] = {"rollout": {"n": 2}}
    prof["verl"]["+fake"] = {**prof["verl"]["+fake"], "real_fsdp": True}
    (cfg / "profiles" / "ckpt-merge.yaml").write_text(yaml.safe_dump(prof))
    # The re-provisioned cluster has one GPU; the checkpoint was written by two ranks.
    spec = build_run_spec({"profile": "ckpt-merge", "n_gpus_per_node": 1}, run_name="faults/merge-1")
    shutil.copytree(fsdp_checkpoint / "checkpoints", spec.checkpoint_dir)
    job = render_job(spec, mode=Mode.TRAIN, train_files="/d/train.parquet", val_files="/d/val.parquet",
                     model_path=str(tiny_model_path))
    client = ray_cluster.client()
    started = time.monotonic()
    with caplog.at_level("INFO", logger="verl_pipeline"):
        sub = submit_or_reattach(client, job, dag_id="faults", run_id="merge-1", task_id="train",
                                 run_dir=spec.run_dir, checkpoint_dir=spec.checkpoint_dir)
    merge_s = round(time.monotonic() - started, 1)
    assert "written by world size 2 and this attempt runs on world size 1: merging it" in caplog.text
    assert f"{sub.submission_id}: merger: " in caplog.text
    (seg,) = read_segments(spec.checkpoint_dir)
    assert (seg.index, seg.start_step, seg.world_size) == (2, 2, 1)
    info = client.get_job(sub.submission_id)
    assert info is not None
    for override in (f"actor_rollout_ref.model.path={seg.model_path}",
                     f"trainer.default_local_dir={seg.checkpoint_dir}", "trainer.total_training_steps=2",
                     "trainer.resume_mode=auto"):
        assert override in info.entrypoint

    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not (info := client.get_job(sub.submission_id)) or not info.status.is_terminal():
        assert time.monotonic() < deadline, f"segment job still running after {JOB_TIMEOUT_S}s"
        time.sleep(0.5)
    logs = client.logs(sub.submission_id)
    assert info.status is JobState.SUCCEEDED, logs[-3000:]
    assert "Training from scratch" in logs  # verl's resume_mode=auto on the segment's empty directory
    (attempt,) = RunDir(spec.run_dir).attempts()
    assert (attempt.segment, attempt.segment_start_step, attempt.resume_from_step) == (2, 2, 2)
    # The segment's verl steps 1..2 are run steps 3..4.
    assert [m["step"] for m in metric_lines(Path(str(attempt.metrics_path)))] == [1, 2]
    (saved,) = list_checkpoints(Path(seg.checkpoint_dir))
    assert saved.complete and saved.world_size == 1 and saved.step == 2
    assert sorted(p.name for p in (saved.path / "actor").glob("model_world_size_*.pt")) == [
        "model_world_size_1_rank_0.pt"]
    assert [c.step for c in list_checkpoints(spec.checkpoint_dir)] == [2]  # the first segment's is kept
    print(f"merge + submit {merge_s}s, segment job {round(time.monotonic() - started - merge_s, 1)}s")
