"""A LoRA adapter laid out as verl's merger writes it, merged into the weights beside it: as PEFT merges, or refused."""

from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from verl_pipeline.exceptions import ModelError
from verl_pipeline.trainer.lora_merge import ADAPTER_DIR, merge_lora_adapter


def _peft_model(tiny_model_path: Path, *, trained: bool) -> Any:
    """The tiny model with a LoRA adapter on every linear (verl's default), lora_B random when ``trained``
    (PEFT starts it at zero)."""
    import torch
    from peft import LoraConfig, TaskType, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16)
    model = get_peft_model(base, LoraConfig(task_type=TaskType.CAUSAL_LM, r=8, lora_alpha=16,
                                            target_modules="all-linear", bias="none"))
    if trained:
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    return model


def _merger_output(tiny_model_path: Path, out: Path, model: Any, *, meta: dict[str, Any] | None) -> Path:
    """``out`` as verl's merger leaves it for a LoRA actor: the base weights at the top level and the adapter
    written by verl's own ``save_lora_adapter`` from the actor's state dict (``meta``: the checkpoint's
    lora_train_meta.json; None: it has none)."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    shutil.copytree(tiny_model_path, out)
    local = out.parent / f"{out.name}-checkpoint"
    local.mkdir()
    if meta is not None:
        (local / "lora_train_meta.json").write_text(json.dumps(meta))
    merger = FSDPModelMerger.__new__(FSDPModelMerger)  # its writer alone: no checkpoint shards to load
    merger.config = ModelMergerConfig(operation="merge", backend="fsdp", target_dir=str(out), local_dir=str(local))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    # verl warns that it falls back to lora_alpha 0 without the metadata.
    with pytest.warns(UserWarning, match="lora_alpha=0") if meta is None else contextlib.nullcontext():
        assert merger.save_lora_adapter(state) == str(out / ADAPTER_DIR)
    return out


META = {"r": 8, "lora_alpha": 16, "task_type": "CAUSAL_LM"}


def test_a_trained_adapter_is_merged_exactly_as_peft_merges_it(tiny_model_path: Path, tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    model = _peft_model(tiny_model_path, trained=True)
    out = _merger_output(tiny_model_path, tmp_path / "model", model, meta=META)
    before = load_file(str(out / "model.safetensors"))
    done = merge_lora_adapter(out)
    assert done is not None and (done.rank, done.alpha, done.scaling) == (8, 16.0, 2.0)
    assert done.adapted == done.changed == 14 and done.max_abs_change > 0
    merged = load_file(str(out / "model.safetensors"))
    expected = model.merge_and_unload().state_dict()
    assert set(merged) == set(expected) - {"lm_head.weight"}  # tied to the embeddings: saved once
    assert all(torch.equal(merged[k], expected[k]) for k in merged)
    assert sorted(k for k in merged if not torch.equal(merged[k], before[k])) == sorted(
        f"model.layers.{i}.{part}_proj.weight" for i in (0, 1)
        for part in ("self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "mlp.gate", "mlp.up", "mlp.down"))
    assert (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()  # the adapter is kept beside the weights


def test_an_adapter_that_never_trained_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    out = _merger_output(tiny_model_path, tmp_path / "model", _peft_model(tiny_model_path, trained=False), meta=META)
    with pytest.raises(ModelError, match=r"changes no weight of the model \(every lora_B is zero"):
        merge_lora_adapter(out)


def test_an_adapter_without_its_alpha_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    # Without the checkpoint's lora_train_meta.json verl's merger writes lora_alpha 0: a merge would change nothing.
    out = _merger_output(tiny_model_path, tmp_path / "model", _peft_model(tiny_model_path, trained=True), meta=None)
    with pytest.raises(ModelError, match=r"lora_alpha=0 scales the adapter to nothing.*lora_train_meta\.json"):
        merge_lora_adapter(out)


def test_an_adapter_of_another_model_or_kind_is_refused(tiny_model_path: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    out = _merger_output(tiny_model_path, tmp_path / "model", _peft_model(tiny_model_path, trained=True), meta=META)
    weights = out / ADAPTER_DIR / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    renamed = {k.replace("layers.1.", "layers.7."): v for k, v in tensors.items()}
    save_file(renamed, str(weights))
    with pytest.raises(ModelError, match=r"adapts 7 weight\(s\) the model .* lacks \(e\.g\. model\.layers\.7\."):
        merge_lora_adapter(out)
    config_path = out / ADAPTER_DIR / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ModelError, match=r"with use_dora is not merged here"):
        merge_lora_adapter(out)


def test_a_model_without_an_adapter_is_left_as_it_is(tiny_model_path: Path, tmp_path: Path) -> None:
    shutil.copytree(tiny_model_path, tmp_path / "model")
    assert merge_lora_adapter(tmp_path / "model") is None
