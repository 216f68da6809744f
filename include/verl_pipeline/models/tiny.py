"""A built-in tiny Qwen2-style causal LM, created locally for smoke runs (no download).

The model has a byte-level BPE tokenizer trained on a fixed corpus, a ChatML chat template like
Qwen2's, and seeded random weights. It is deterministic: the same version produces the same files.

Its shape is the smallest a GPU run can serve: vLLM's attention kernels need a head dimension of
at least 64 (v1 had 16 and could not be served), so 2 heads of 64 (hidden 128); bf16 weights, like
Qwen2's, keep it under a megabyte.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from verl_pipeline.data.generator import generate_problems
from verl_pipeline.paths import write_json_atomic

log = logging.getLogger(__name__)

#: Bump when the files this module writes change, so caches keyed by it are rebuilt.
TINY_MODEL_VERSION = "tiny-qwen2-v2"

_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# ChatML as Qwen2 uses it: verl applies it with add_generation_prompt=True to build prompts.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCH: dict[str, Any] = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    # head_dim = hidden_size / num_attention_heads = 64: the least vLLM's attention kernels serve.
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "hidden_act": "silu",
}


def _train_tokenizer(vocab_size: int = 1024) -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [p.question + "\n" + p.answer for p in generate_problems(2000, seed=7)]
    corpus += ["user", "assistant", "system", "Let's think step by step"]
    tok.train_from_iterator(corpus, trainer=trainer)
    return tok


def config_facts() -> dict[str, Any]:
    """The architecture the built model's config.json has (its vocabulary is the tokenizer's, trained in a
    fraction of a second), without building the weights: what the scaling rules read at provision."""
    return {**_ARCH, "vocab_size": _train_tokenizer().get_vocab_size()}  # type: ignore[attr-defined]


def build_tiny_model(dest: Path) -> Path:
    """Write the tiny model (config, tokenizer, safetensors weights) into ``dest``.

    Written into a temporary sibling directory and renamed, so ``dest`` is complete or absent.
    Returns ``dest``.
    """
    import torch
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config

    dest = dest.resolve()
    if (dest / "config.json").exists():
        return dest
    tmp = dest.with_name(f".{dest.name}.partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    raw = _train_tokenizer()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=raw,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        model_max_length=2048,
    )
    tokenizer.chat_template = _CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp)

    arch = dict(_ARCH)
    arch["vocab_size"] = len(tokenizer)
    arch["eos_token_id"] = tokenizer.convert_tokens_to_ids("<|im_end|>")
    arch["pad_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    arch["bos_token_id"] = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    config = Qwen2Config(**{k: v for k, v in arch.items() if k not in ("architectures", "model_type")})
    config.architectures = arch["architectures"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    model.save_pretrained(tmp, safe_serialization=True)
    write_json_atomic(tmp / "verl_pipeline_model.json", {"source": f"builtin:{TINY_MODEL_VERSION}"})

    import os

    # Temporary files are created 0600; the Ray nodes' users must be able to read the model.
    for p in tmp.iterdir():
        os.chmod(p, p.stat().st_mode | 0o644)

    dest.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp, dest)
    except OSError:
        # Another process finished the same model first: keep theirs.
        if not (dest / "config.json").exists():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    log.info("Built the tiny model %s in %s", TINY_MODEL_VERSION, dest)
    return dest


def describe(path: Path) -> dict[str, object]:
    """Small facts about a model directory for logs and XCom."""
    cfg = json.loads((path / "config.json").read_text())
    files = sorted(p.name for p in path.iterdir() if p.is_file())
    return {
        "path": str(path),
        "architectures": cfg.get("architectures"),
        "model_type": cfg.get("model_type"),
        "files": files,
        "bytes": sum((path / f).stat().st_size for f in files),
    }


__all__ = ["TINY_MODEL_VERSION", "build_tiny_model", "config_facts", "describe"]
