from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from verl_pipeline.exceptions import ModelError
from verl_pipeline.models.prefetch import prefetch, verify_model_dir
from verl_pipeline.models.tiny import build_tiny_model
from verl_pipeline.spec import ModelSource


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_tiny_model_is_deterministic_and_loads(tmp_path: Path, tiny_model_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = build_tiny_model(tmp_path / "again")
    assert _digest(again) == _digest(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(str(again))
    text = tok.apply_chat_template([{"role": "user", "content": "Ada has 3 apples."}], add_generation_prompt=True,
                                   tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    model = AutoModelForCausalLM.from_pretrained(str(again))
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 2
    assert model.config.vocab_size == len(tok)


def test_tiny_model_can_be_served_by_vllm_and_stays_about_a_megabyte(tiny_model_path: Path) -> None:
    """vLLM's attention kernels need head_dim >= 64 (v1's 16 could not be served on a GPU)."""
    import json

    cfg = json.loads((tiny_model_path / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert head_dim >= 64 and cfg["hidden_size"] % cfg["num_attention_heads"] == 0
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    total = sum(p.stat().st_size for p in tiny_model_path.iterdir() if p.is_file())
    assert 0.5e6 < total < 1.2e6, total


def test_prefetch_builtin_is_idempotent(tmp_path: Path) -> None:
    first = prefetch(ModelSource("builtin", "tiny-qwen2"), tmp_path)
    second = prefetch(ModelSource("builtin", "tiny-qwen2"), tmp_path)
    assert first.path == second.path and Path(first.path).is_dir()
    assert second.seconds < 10  # a cache hit (a busy machine may stall it, not by seconds)


def test_prefetch_local_path(tmp_path: Path, tiny_model_path: Path) -> None:
    r = prefetch(ModelSource("path", str(tiny_model_path)), tmp_path)
    assert r.path == str(tiny_model_path)
    with pytest.raises(ModelError, match="does not exist"):
        prefetch(ModelSource("path", str(tmp_path / "missing")), tmp_path)


def test_verify_names_the_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"config\.json"):
        verify_model_dir(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelError, match="tokenizer"):
        verify_model_dir(tmp_path)


def test_hub_unreachable_and_not_cached_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match="unreachable and the model is not in the cache"):
        prefetch(ModelSource("hf", "Qwen/Qwen2.5-0.5B-Instruct", "main"), tmp_path)
