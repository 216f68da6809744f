"""``on_world_size_change``: refuse (default) or merge the checkpoint into a new segment of the run."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from verl_pipeline.constants import WorldSizeChange
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.jobs.checkpoints import (
    ResumeMode,
    current_segment,
    list_checkpoints,
    new_segment,
    plan_resume,
    read_segments,
    tracker_step,
)
from verl_pipeline.profiles import build_run_spec


def test_another_world_size_is_merged_only_when_the_profile_says_so(fsdp_checkpoint: Path) -> None:
    ckpt = fsdp_checkpoint / "checkpoints"
    found, tracker = list_checkpoints(ckpt), tracker_step(ckpt)
    with pytest.raises(ConfigError, match="on_world_size_change: merge in the run profile"):
        plan_resume(found, tracker, world_size=1)
    plan = plan_resume(found, tracker, world_size=1, on_world_size_change=WorldSizeChange.MERGE)
    assert plan.merge and plan.mode is ResumeMode.DISABLE and plan.step == 2 and plan.world_size == 2
    assert plan.path == str(ckpt / "global_step_2") and "optimizer state is lost" in plan.reason
    # The same world size resumes as before, whatever the choice.
    same = plan_resume(found, tracker, world_size=2, on_world_size_change=WorldSizeChange.MERGE)
    assert not same.merge and same.mode is ResumeMode.AUTO and same.step == 2


def test_an_unknown_choice_is_a_one_line_config_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import yaml

    from verl_pipeline.paths import configs_dir

    cfg = tmp_path / "configs"
    shutil.copytree(configs_dir(), cfg)
    prof = yaml.safe_load((cfg / "profiles" / "smoke.yaml").read_text())
    (cfg / "profiles" / "smoke-merge.yaml").write_text(yaml.safe_dump({**prof, "on_world_size_change": "merge"}))
    (cfg / "profiles" / "smoke-bad.yaml").write_text(yaml.safe_dump({**prof, "on_world_size_change": "resize"}))
    monkeypatch.setenv("VERL_PIPELINE_CONFIGS", str(cfg))
    assert build_run_spec({"profile": "smoke"}, run_name="d/r").on_world_size_change is WorldSizeChange.FAIL
    spec = build_run_spec({"profile": "smoke-merge"}, run_name="d/r")
    assert spec.on_world_size_change is WorldSizeChange.MERGE
    assert spec.to_dict()["on_world_size_change"] == "merge"
    with pytest.raises(ConfigError) as e:
        build_run_spec({"profile": "smoke-bad"}, run_name="d/r")
    text = str(e.value)
    assert text.startswith("profiles/smoke-bad.on_world_size_change='resize'") and "fail" in text and "merge" in text
    assert "\n" not in text


def test_a_merge_starts_a_recorded_segment_from_weights_equal_to_the_trained_state(
    fsdp_checkpoint: Path, tmp_path: Path,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(fsdp_checkpoint / "checkpoints", ckpt)
    plan = plan_resume(list_checkpoints(ckpt), tracker_step(ckpt), world_size=1,
                       on_world_size_change=WorldSizeChange.MERGE)
    seg = new_segment(ckpt, plan, world_size=1, job_id="job-a2")
    assert (seg.index, seg.start_step, seg.world_size) == (2, 2, 1)
    assert seg.checkpoint_dir == str(ckpt / "segment_2" / "checkpoints")
    assert read_segments(ckpt) == [seg] and current_segment(ckpt) == (Path(seg.checkpoint_dir), 2, 2)
    assert seg.settings(6) == {"trainer.default_local_dir": seg.checkpoint_dir,
                               "actor_rollout_ref.model.path": seg.model_path, "trainer.total_training_steps": 4}
    # The segment's folder holds no global_step_N of its own yet: the run's checkpoints are unchanged.
    assert [c.step for c in list_checkpoints(ckpt)] == [2]
    merged = AutoModelForCausalLM.from_pretrained(seg.model_path).state_dict()
    trained = torch.load(fsdp_checkpoint / "full_state.pt")
    assert all(torch.equal(merged[k], v.to(torch.bfloat16)) for k, v in trained.items())


def test_an_attempt_of_a_segment_logs_run_steps_after_its_start(tmp_path: Path) -> None:
    import json

    from verl_pipeline.jobs.attempts import run_steps
    from verl_pipeline.rundir import Attempt

    metrics = tmp_path / "metrics-a2.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "data": {"training/global_step": s}}) + "\n" for s in (1, 2)))
    first = Attempt("j-a1", 1, 0.0, "", 0, str(metrics))
    segment = Attempt("j-a2", 2, 0.0, "", 4, str(metrics), segment=2, segment_start_step=4)
    assert run_steps(first) == [1, 2] and run_steps(segment) == [5, 6]
    assert run_steps(Attempt("j-a3", 3, 0.0, "", 0, None)) == []


def test_a_checkpoint_trained_with_flash_attn_merges_on_a_cpu_into_a_model_without_that_choice(
    fsdp_checkpoint: Path, tmp_path: Path,
) -> None:
    """verl writes its override_config into the checkpoint's config (attn_implementation: flash_attention_2
    on the fast path); transformers then refuses to build the model where flash-attn cannot run, as the
    export task's CPU. The merge leaves the choice out and the checkpoint as it was."""
    import json

    from transformers import AutoModelForCausalLM

    from verl_pipeline.trainer.merge import merge_checkpoint

    actor = tmp_path / "global_step_2" / "actor"
    shutil.copytree(fsdp_checkpoint / "checkpoints" / "global_step_2" / "actor", actor)
    config_path = actor / "huggingface" / "config.json"
    config = {**json.loads(config_path.read_text()), "attn_implementation": "flash_attention_2"}
    config_path.write_text(json.dumps(config))
    merge_checkpoint(actor, tmp_path / "model", job_id="job-a1")
    assert "attn_implementation" not in json.loads((tmp_path / "model" / "config.json").read_text())
    assert json.loads(config_path.read_text())["attn_implementation"] == "flash_attention_2"  # untouched
    assert not list(tmp_path.glob(".model.*"))  # no stage or partial folder left
    AutoModelForCausalLM.from_pretrained(tmp_path / "model")  # loads on this CPU
