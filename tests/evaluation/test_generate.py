"""Which engine generates, the prompt the model is given, and where a response ends."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_pipeline.evaluation.generate import Response, choose_engine, prompt_ids, response_of
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.scores import Engine


@pytest.mark.parametrize(("requested", "gpus", "vllm", "chosen"), [
    (None, 1, True, Engine.VLLM),
    (None, 0, True, Engine.TRANSFORMERS),
    (None, 2, False, Engine.TRANSFORMERS),
    (Engine.VLLM, 1, True, Engine.VLLM),
    (Engine.TRANSFORMERS, 8, True, Engine.TRANSFORMERS),
])
def test_vllm_where_a_gpu_and_vllm_are_there_else_transformers(requested: Engine | None, gpus: int, vllm: bool,
                                                               chosen: Engine) -> None:
    assert choose_engine(requested, gpus=gpus, vllm_found=vllm) is chosen


@pytest.mark.parametrize(("gpus", "vllm", "why"), [(0, True, "no GPU is visible to the job"),
                                                    (1, False, "vllm is not installed on the node")])
def test_vllm_asked_for_where_it_cannot_run_is_refused_saying_why(gpus: int, vllm: bool, why: str) -> None:
    with pytest.raises(ConfigError, match=rf"^engine='vllm': cannot run here: {why} \(fix: engine: null"):
        choose_engine(Engine.VLLM, gpus=gpus, vllm_found=vllm)


def test_the_prompt_is_the_chat_template_with_the_assistants_turn_opened(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Repeat: 7"}]
    ids = prompt_ids(tokenizer, messages)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nAnswer briefly.<|im_end|>\n"
                                     "<|im_start|>user\nRepeat: 7<|im_end|>\n<|im_start|>assistant\n")


def test_a_response_ends_with_its_first_end_of_sequence_token(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    seven, eos, pad = (tokenizer.convert_tokens_to_ids(t) for t in ("7", "<|im_end|>", "<|endoftext|>"))
    # The end-of-sequence token counts (as verl counts a response's length); what follows it does not.
    assert response_of(tokenizer, [seven, seven, eos, pad, pad], {eos}) == Response("77", 3)
    assert response_of(tokenizer, [seven, seven, seven], {eos}) == Response("777", 3)
    assert response_of(tokenizer, [eos, seven], {eos}) == Response("", 1)
