"""What verl's ``use_remove_padding`` costs when the actor attends with PyTorch's SDPA, not flash-attn.

With ``use_remove_padding: true`` verl packs a micro batch's sequences into one row and passes
position ids that restart at each sequence. flash-attn attends each sequence on its own (varlen);
transformers' SDPA path instead builds a block-diagonal mask over the whole row, so every token's
attention spans the packed row's length and the fused causal kernel cannot be used. This times one
training micro batch (forward + backward, gradient checkpointing, as the actor) and one log-prob
micro batch (forward only) of the 0.5B architecture both ways, on this machine's GPU.

Usage (a machine with a GPU and requirements/gpu.txt)::

    python bench/attention_packing.py [--micro 8] [--log-prob-micro 16] [--tokens 1124] [--out FILE]

On a machine without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_acceptance import QWEN25_05B_ARCH  # the one place the architecture is written


def _time(fn: Any, inputs: Any, repeats: int) -> float:
    import torch

    fn(inputs)  # warm-up: kernels chosen, allocator primed
    torch.cuda.synchronize()
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(inputs)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds)


def measure(micro: int, log_prob_micro: int, tokens: int, repeats: int) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**QWEN25_05B_ARCH)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(torch.bfloat16).cuda()
    model.gradient_checkpointing_enable()
    vocab = config.vocab_size

    def batch(n: int, packed: bool) -> dict[str, torch.Tensor]:
        # Lengths spread as a rollout's are (prompt + response, a few capped at the response limit).
        lengths = [tokens - (i * 37) % (tokens // 4) for i in range(n)]
        if packed:
            ids = torch.randint(0, vocab, (1, sum(lengths)), device="cuda")
            pos = torch.cat([torch.arange(k, device="cuda") for k in lengths]).unsqueeze(0)
            return {"input_ids": ids, "position_ids": pos}
        longest = max(lengths)
        ids = torch.randint(0, vocab, (n, longest), device="cuda")
        mask = torch.zeros((n, longest), dtype=torch.long, device="cuda")
        for i, k in enumerate(lengths):
            mask[i, longest - k:] = 1  # left padding, as verl's rollout batch has
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        return {"input_ids": ids, "attention_mask": mask, "position_ids": pos}

    def train(inputs: dict[str, torch.Tensor]) -> None:
        model.train()
        out = model(**inputs, use_cache=False)
        out.logits.float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    def log_prob(inputs: dict[str, torch.Tensor]) -> None:
        model.eval()
        with torch.no_grad():
            model(**inputs, use_cache=False).logits.float().logsumexp(-1)

    figures: dict[str, Any] = {"micro": micro, "log_prob_micro": log_prob_micro, "tokens_per_sequence": tokens,
                               "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    for name, fn, n in (("train", train, micro), ("log_prob", log_prob, log_prob_micro)):
        for packed in (True, False):
            inputs = batch(n, packed)
            torch.cuda.reset_peak_memory_stats()
            figures[f"{name}_{'packed' if packed else 'padded'}_s"] = round(_time(fn, inputs, repeats), 4)
            figures[f"{name}_{'packed' if packed else 'padded'}_peak_gb"] = round(
                torch.cuda.max_memory_allocated() / 2**30, 2)
        figures[f"{name}_packed_over_padded"] = round(figures[f"{name}_packed_s"] / figures[f"{name}_padded_s"], 2)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--micro", type=int, default=8, help="sequences per training micro batch (the 0.5B profile's)")
    p.add_argument("--log-prob-micro", type=int, default=16, help="sequences per log-prob micro batch")
    p.add_argument("--tokens", type=int, default=1124, help="longest sequence: prompt + response tokens")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to measure")
        return 0
    if not torch.cuda.is_available():
        print("no GPU on this machine: nothing to measure")
        return 0
    figures = measure(args.micro, args.log_prob_micro, args.tokens, args.repeats)
    print(json.dumps(figures, indent=2))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
