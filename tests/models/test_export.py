"""Export: verl's own merger over a real FSDP checkpoint, verified, with its manifest."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from verl_pipeline.exceptions import ModelError
from verl_pipeline.jobs.checkpoints import list_checkpoints
from verl_pipeline.models.export import export_run, final_reward, read_export
from verl_pipeline.rundir import RunDir
from verl_pipeline.trainer.merge import merge_checkpoint, merge_command


def _metrics(path: Path, rewards: dict[int, float]) -> None:
    path.write_text("".join(json.dumps({"step": s, "data": {"training/global_step": s, "critic/score/mean": r}}) + "\n"
                            for s, r in rewards.items()) + '{"step": 9, "da')  # a line cut by a kill


def test_export_merges_the_newest_complete_checkpoint_into_weights_equal_to_the_trained_state(
    fsdp_checkpoint: Path, tiny_model_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(fsdp_checkpoint / "checkpoints", ckpt)
    # A newer save cut short by a kill: only rank 0's model shard.
    (ckpt / "global_step_3" / "actor").mkdir(parents=True)
    shutil.copy(ckpt / "global_step_2" / "actor" / "model_world_size_2_rank_0.pt",
                ckpt / "global_step_3" / "actor" / "model_world_size_2_rank_0.pt")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _metrics(run_dir / "metrics-a1.jsonl", {1: 0.1, 2: 0.25})
    with caplog.at_level(logging.INFO, logger="verl_pipeline"):
        manifest = export_run(run_dir=run_dir, checkpoints=list_checkpoints(ckpt), run_key="rk", run_name="d/r",
                              profile="smoke", job_id="job-1", data={"key": "data123"},
                              actor_model={"source": "builtin:tiny-qwen2", "revision": "tiny-qwen2-v2"})
    assert manifest.step == 2 and manifest.world_size == 2 and manifest.final_reward == 0.25
    assert manifest.data_hash == "data123" and manifest.base_model_revision == "tiny-qwen2-v2"
    assert "global_step_3 is incomplete" in caplog.text
    assert "job-1: merger: " in caplog.text  # the merger's own output reaches the task log
    on_disk = json.loads(RunDir(run_dir).model_manifest_file.read_text())
    assert on_disk["model_dir"] == str(run_dir / "model") and "model.safetensors" in on_disk["files"]["names"]

    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    AutoTokenizer.from_pretrained(run_dir / "model")
    merged = model.state_dict()
    trained = torch.load(fsdp_checkpoint / "full_state.pt")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path).state_dict()
    assert set(merged) == set(trained)
    for name, tensor in trained.items():
        # verl's merger writes bf16 (the trainer keeps fp32 master weights): equal after that cast.
        assert torch.equal(merged[name], tensor.to(torch.bfloat16)), name
    assert sum(not torch.equal(merged[k], initial[k]) for k in merged) == len(merged)  # training moved them

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="verl_pipeline.models.export"):
        again = export_run(run_dir=run_dir, checkpoints=list_checkpoints(ckpt), run_key="rk", run_name="d/r",
                           profile="smoke", job_id="job-1")
    assert again.exported_at == manifest.exported_at and "already exported" in caplog.text
    assert read_export(run_dir) == manifest


def test_a_lora_runs_export_is_the_base_with_its_trained_adapter_merged(
    lora_fsdp_checkpoint: Path, tiny_model_path: Path, tmp_path: Path,
) -> None:
    """verl's merger writes a LoRA actor's adapter to lora_adapter/ beside the untouched base weights; the export
    publishes them merged (as PEFT merges them), keeps the adapter, and records what the merge changed."""
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    ckpt = tmp_path / "checkpoints"
    shutil.copytree(lora_fsdp_checkpoint / "checkpoints", ckpt)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    manifest = export_run(run_dir=run_dir, checkpoints=list_checkpoints(ckpt), run_key="rk", run_name="d/lora",
                          profile="smoke", job_id="job-lora")
    model_dir = run_dir / "model"
    lora = manifest.files["lora"]
    assert (lora["rank"], lora["alpha"], lora["scaling"]) == (8, 16.0, 2.0)
    # Every linear of both decoder layers: q, k, v, o, gate, up and down.
    assert lora["adapted"] == lora["changed"] == 14 and lora["max_abs_change"] > 0
    assert lora["target_modules"] == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"])
    # The kept adapter is the one the ranks trained.
    trained = torch.load(lora_fsdp_checkpoint / "full_state.pt")
    kept = load_file(str(model_dir / "lora_adapter" / "adapter_model.safetensors"))
    assert len(kept) == 28
    for key, tensor in kept.items():
        assert torch.equal(tensor, trained[key.replace(".weight", ".default.weight")].to(tensor.dtype)), key
    # The published weights: the base with that adapter merged, exactly as PEFT merges it; they differ from the base.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    expected = PeftModel.from_pretrained(base, model_dir / "lora_adapter").merge_and_unload().state_dict()
    published = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).state_dict()
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).state_dict()
    assert set(published) == set(expected)
    assert all(torch.equal(published[k], expected[k]) for k in published)
    changed = sorted(k for k in published if not torch.equal(published[k], initial[k]))
    assert len(changed) == 14 and all(k.endswith("_proj.weight") for k in changed)


def test_export_without_a_complete_checkpoint_names_the_run(tmp_path: Path) -> None:
    (tmp_path / "global_step_4" / "actor").mkdir(parents=True)
    with pytest.raises(ModelError, match=r"run rk has no complete checkpoint to export .*global_step_4"):
        export_run(run_dir=tmp_path / "run", checkpoints=list_checkpoints(tmp_path), run_key="rk", run_name="d/r",
                   profile="smoke", job_id="j")


def test_merge_refuses_a_folder_verl_did_not_write_before_running_the_merger(tmp_path: Path) -> None:
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "fsdp_config.json").write_text('{"world_size": 2}')
    with pytest.raises(ModelError, match=r"actor has no huggingface/config.json"):
        merge_checkpoint(tmp_path / "actor", tmp_path / "out", job_id="j")
    assert not (tmp_path / "out").exists()


def test_merge_command_is_verls_fsdp_merger() -> None:
    assert merge_command(Path("/c/global_step_2/actor"), Path("/r/model"), python="py") == [
        "py", "-m", "verl.model_merger", "merge", "--backend", "fsdp", "--local_dir", "/c/global_step_2/actor",
        "--target_dir", "/r/model"]


def test_final_reward_is_the_score_of_the_highest_step_over_attempts(tmp_path: Path) -> None:
    _metrics(tmp_path / "a1.jsonl", {1: 0.1, 2: 0.2, 3: 0.3})
    _metrics(tmp_path / "a2.jsonl", {3: 0.35, 4: 0.4})  # resumed from step 2: redid 3
    assert final_reward([tmp_path / "a1.jsonl", tmp_path / "a2.jsonl"]) == 0.4
    assert final_reward([tmp_path / "missing.jsonl"]) is None
