"""One model's greedy responses to the evaluation prompts: vLLM on a GPU, transformers on CPUs.

Each prompt is the row's chat messages with the model's own chat template applied and the assistant's
turn opened (``add_generation_prompt=True``), tokenized without adding special tokens: the prompt verl's
rollout gives the model. Generation is greedy (temperature 0). A response is its tokens up to and
including the first end-of-sequence token (what verl counts as the response's length), decoded without
special tokens (what verl's reward manager hands the reward function).

vLLM generates in a process of its own per model: the GPU memory of one model's engine is free when the
next model loads, and a model that crashes its engine is that model's error, not the job's.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from verl_pipeline.exceptions import ConfigError, ModelError
from verl_pipeline.scores import Engine

log = logging.getLogger(__name__)

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class Response:
    """A response as the reward function sees it, and its length in tokens."""

    text: str
    tokens: int


def choose_engine(requested: Engine | None, *, gpus: int, vllm_found: bool) -> Engine:
    """The engine that generates: the one asked for, or (None) vLLM where there is a GPU and vLLM, else
    transformers. vLLM asked for where it cannot run is a ConfigError."""
    if requested is Engine.TRANSFORMERS:
        return Engine.TRANSFORMERS
    if gpus > 0 and vllm_found:
        return Engine.VLLM
    if requested is Engine.VLLM:
        missing = "no GPU is visible to the job" if gpus == 0 else "vllm is not installed on the node"
        raise ConfigError("engine", Engine.VLLM.value, f"cannot run here: {missing}",
                          "engine: null (transformers where vLLM cannot run), or use_gpus: true on a GPU cluster "
                          "whose nodes have vllm (requirements/gpu.txt)")
    return Engine.TRANSFORMERS


def visible_gpus() -> int:
    """GPUs this process can use (torch's count; 0 without CUDA)."""
    import torch

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _tokenizer(model_path: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(model_path).is_dir():
        raise ModelError(f"no model directory at {model_path} (fix: a HuggingFace model directory; a run's exported "
                         "model is <run dir>/model, written by its export task)")
    return AutoTokenizer.from_pretrained(model_path, local_files_only=True)


def prompt_ids(tokenizer: Any, messages: Messages) -> list[int]:
    """The prompt's token ids: the chat template applied with the assistant's turn opened."""
    text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _eos_ids(tokenizer: Any, model_path: str) -> set[int]:
    """The tokens that end a response: the model's generation config's (one or several) and the tokenizer's."""
    from transformers import GenerationConfig

    try:
        named = GenerationConfig.from_pretrained(model_path, local_files_only=True).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's alone
        named = None
    ids = set(named if isinstance(named, list | tuple) else [named])
    ids.add(tokenizer.eos_token_id)
    return {int(i) for i in ids if i is not None}


def response_of(tokenizer: Any, ids: Sequence[int], eos: set[int]) -> Response:
    """The response in ``ids`` (the new tokens): cut after the first end-of-sequence token, decoded."""
    kept = list(ids)
    for i, token in enumerate(kept):
        if token in eos:
            kept = kept[:i + 1]
            break
    return Response(tokenizer.decode(kept, skip_special_tokens=True), len(kept))


def transformers_responses(model_path: str, prompts: Sequence[Messages], *, max_new_tokens: int,
                           seed: int) -> list[Response]:
    """Greedy responses with transformers on the CPU, one prompt at a time (no padding to change them)."""
    import torch
    from transformers import AutoModelForCausalLM

    tokenizer = _tokenizer(model_path)
    model: Any = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
    model.eval()
    torch.manual_seed(seed)
    eos = _eos_ids(tokenizer, model_path)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos, default=0)
    out = []
    for messages in prompts:
        ids = torch.tensor([prompt_ids(tokenizer, messages)])
        with torch.no_grad():
            generated = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                       max_new_tokens=max_new_tokens, pad_token_id=pad)
        out.append(response_of(tokenizer, generated[0, ids.shape[1]:].tolist(), eos))
    return out


def vllm_responses(model_path: str, prompts: Sequence[Messages], *, max_new_tokens: int,
                   seed: int, gpu_memory_utilization: float | None = None) -> list[Response]:
    """Greedy responses with vLLM's offline engine on this process's GPU (run in a process of its own),
    taking ``gpu_memory_utilization`` of its memory (None: vLLM's default)."""
    from vllm import LLM, SamplingParams

    tokenizer = _tokenizer(model_path)
    ids = [prompt_ids(tokenizer, m) for m in prompts]
    share = {} if gpu_memory_utilization is None else {"gpu_memory_utilization": gpu_memory_utilization}
    llm = LLM(model=model_path, seed=seed, enforce_eager=True,
              max_model_len=max(len(i) for i in ids) + max_new_tokens, **share)
    eos = _eos_ids(tokenizer, model_path)
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, seed=seed)
    outputs = llm.generate([{"prompt_token_ids": i} for i in ids], params)
    return [response_of(tokenizer, list(o.outputs[0].token_ids), eos) for o in outputs]


def responses(engine: Engine, model_path: str, prompts: Sequence[Messages], *, max_new_tokens: int,
              seed: int, gpu_memory_utilization: float | None = None) -> list[Response]:
    """Every prompt's response from the model at ``model_path`` (a ModelError when the directory is absent);
    ``gpu_memory_utilization``: vLLM's share of the GPU."""
    if not prompts:
        return []
    if engine is Engine.TRANSFORMERS:
        return transformers_responses(model_path, prompts, max_new_tokens=max_new_tokens, seed=seed)
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    _tokenizer(model_path)  # an absent model is named here, before an engine starts
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(vllm_responses, model_path, list(prompts), max_new_tokens=max_new_tokens,
                               seed=seed, gpu_memory_utilization=gpu_memory_utilization).result()
        except BrokenProcessPool as e:
            raise ModelError(f"vLLM's process for {model_path} died ({e}): see the job's log above") from None


__all__ = ["Response", "choose_engine", "prompt_ids", "response_of", "responses", "transformers_responses",
           "visible_gpus", "vllm_installed", "vllm_responses"]
