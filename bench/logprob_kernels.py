"""Per-token log-probs of one packed micro batch: verl's default path against its fused kernels.

Why: on 2026-12-03 the 0.5B architecture's update_actor held the H200 at 0-30% for minutes (MFU 1.9%).
Without flash-attn, ``verl.utils.torch_functional.logprobs_from_logits`` takes the log-softmax of the
packed (tokens x vocabulary) logits one row at a time; ``actor_rollout_ref.model.use_fused_kernels``
instead computes them from the hidden states in chunks (verl's ``FusedLinearForPPO``), never holding
the whole logits. This times both on the head of the shipped 0.5B profile (hidden 896, vocabulary
151,936) for one micro batch, forward only (the reference and old-log-prob passes) and forward plus
backward (the update), checks that they agree, and scales the figures to a step of the profile.

Usage::

    python bench/logprob_kernels.py [--tokens N] [--device cuda|cpu] [--repeats R] [--out FILE]

On a machine without a GPU it runs on the CPU at a size the CPU finishes (figures then say nothing
about a GPU); ``--device cuda`` without one exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu_acceptance import QWEN25_05B_ARCH  # the 0.5B architecture the GPU runs train (bench/ is on the path)

HIDDEN, VOCAB = QWEN25_05B_ARCH["hidden_size"], QWEN25_05B_ARCH["vocab_size"]
#: The shipped qwen2.5-0.5b-grpo profile on one node: 128 prompts x 5 responses, update micro batch 8,
#: responses up to 1024 tokens after a GSM8K prompt of ~150.
STEP_SEQUENCES, UPDATE_MICRO, TOKENS_PER_SEQUENCE = 640, 8, 1174


def _timed(fn: Callable[[], Any], repeats: int, sync: Callable[[], None]) -> float:
    fn()  # warm-up: allocator, kernels picked
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _entropy_gradient_gap(hidden0: Any, weight0: Any, labels: Any, fused: Any, token_weights: Any) -> float:
    """The entropy bonus's part of the update (``entropy_coeff`` > 0, as the GPU acceptance profile runs):
    the gradient of the tokens' weighted entropy through the fused kernels against plain autograd, in
    float32; the largest difference relative to the largest gradient. (Beside the log-probs' gradient
    the bonus is small: a path that dropped it would hide under a check of the two together.)"""
    import torch

    def grad(use_fused: bool) -> torch.Tensor:
        hidden = hidden0.detach().float().requires_grad_(True)
        weight = weight0.detach().float()
        if use_fused:
            logp, entropy = fused(hidden, weight, labels)
        else:
            logits = hidden @ weight.T
            log_softmax = logits.log_softmax(dim=-1)
            logp = log_softmax.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
            entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        del logp
        (entropy * token_weights).sum().backward()
        assert hidden.grad is not None
        return hidden.grad

    reference, fused_grad = grad(False), grad(True)
    return float(((reference - fused_grad).abs().max() / reference.abs().max()).item())


def measure(tokens: int, device: str, repeats: int, dtype_name: str = "bfloat16") -> dict[str, Any]:
    import torch
    from verl.utils import torch_functional as verl_f
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cpu").manual_seed(0)
    hidden0 = (torch.randn(tokens, HIDDEN, generator=gen) * 0.5).to(device=device, dtype=dtype)
    weight0 = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.02).to(device=device, dtype=dtype)
    labels = torch.randint(0, VOCAB, (tokens,), generator=gen).to(device)
    fused = FusedLinearForPPO()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    # The update's loss weighs each token's log-prob (by its advantage): random weights stand in.
    token_weights = torch.randn(tokens, generator=gen).to(device)

    def default_path(backward: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = hidden0.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            logits = hidden @ weight0.T  # the lm_head the model runs before verl sees logits
            out = verl_f.logprobs_from_logits(logits, labels)
            if backward:
                (out.float() * token_weights).sum().backward()
        return out.detach(), hidden.grad

    def fused_path(backward: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        hidden = hidden0.detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            out, _entropy = fused(hidden, weight0, labels)
            if backward:
                (out.float() * token_weights).sum().backward()
        return out.detach(), hidden.grad

    (a, grad_a), (b, grad_b) = default_path(True), fused_path(True)
    assert grad_a is not None and grad_b is not None
    max_diff = (a.float() - b.float()).abs().max().item()
    grad_diff = ((grad_a.float() - grad_b.float()).abs().max() / grad_a.float().abs().max()).item()
    entropy_grad_diff = _entropy_gradient_gap(hidden0, weight0, labels, fused, token_weights)
    figures: dict[str, Any] = {
        "device": device if device == "cpu" else torch.cuda.get_device_name(), "dtype": dtype_name,
        "tokens": tokens, "hidden": HIDDEN, "vocab": VOCAB,
        "default_path": "flash-attn cross-entropy" if verl_f.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE
        else "row-by-row log-softmax", "max_abs_diff": max_diff, "max_grad_rel_diff": grad_diff,
        "entropy_grad_rel_diff": entropy_grad_diff,
    }
    for name, fn in (("default", default_path), ("fused", fused_path)):
        figures[f"{name}_forward_s"] = _timed(lambda fn=fn: fn(False), repeats, sync)
        figures[f"{name}_forward_backward_s"] = _timed(lambda fn=fn: fn(True), repeats, sync)
    # Scaled to one step of the profile: the update's micro batches run forward and backward, the two
    # log-prob passes (reference, old policy) forward only, at this benchmark's tokens per micro batch.
    per_token = {k: v / tokens for k, v in figures.items() if k.endswith("_s")}
    step_tokens = STEP_SEQUENCES * TOKENS_PER_SEQUENCE
    for name in ("default", "fused"):
        figures[f"{name}_step_s"] = round(step_tokens * (per_token[f"{name}_forward_backward_s"]
                                                         + 2 * per_token[f"{name}_forward_s"]), 1)
    figures["step_tokens"] = step_tokens
    figures["update_speedup"] = round(figures["default_forward_backward_s"] / figures["fused_forward_backward_s"], 2)
    return figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="default: cuda if there is one")
    p.add_argument("--tokens", type=int, default=None,
                   help=f"tokens in the micro batch (default: a full update micro batch, "
                        f"{UPDATE_MICRO * TOKENS_PER_SEQUENCE}, on a GPU; 512 on the CPU)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--out", type=Path, default=None, help="write the figures (JSON) here")
    args = p.parse_args(argv)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("logprob_kernels: --device cuda but torch sees no GPU")
        return 2
    tokens = args.tokens or (UPDATE_MICRO * TOKENS_PER_SEQUENCE if device == "cuda" else 512)
    figures = measure(tokens, device, args.repeats, args.dtype)
    print(json.dumps(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2))
    print(f"{figures['device']}, {tokens} tokens x {VOCAB} vocabulary ({figures['dtype']}), default path = "
          f"{figures['default_path']}: forward {figures['default_forward_s']:.3f} s vs fused "
          f"{figures['fused_forward_s']:.3f} s; forward+backward {figures['default_forward_backward_s']:.3f} s vs "
          f"fused {figures['fused_forward_backward_s']:.3f} s ({figures['update_speedup']}x); at the profile's "
          f"{figures['step_tokens']:,} tokens per step: {figures['default_step_s']} s vs {figures['fused_step_s']} s "
          f"of log-prob work; max |diff| {figures['max_abs_diff']:.3g}, gradients {figures['max_grad_rel_diff']:.3g} "
          f"of their largest (the entropy bonus alone: {figures['entropy_grad_rel_diff']:.3g}, float32)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
