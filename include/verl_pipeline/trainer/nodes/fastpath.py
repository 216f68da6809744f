"""verl's fast path where every GPU node has a usable flash-attn; PyTorch's attention and fused kernels where not.

Decided at submit, from what the probe found on the nodes (:mod:`verl_pipeline.trainer.nodes.facts`):

- **flash-attn on every GPU node**: ``attn_implementation=flash_attention_2``, sequence packing
  (``use_remove_padding``) for actor, reference and critic, and dynamic batches
  (``use_dynamic_bsz``) whose per-GPU token budgets (:func:`token_budget`) replace the micro batch
  sizes: at least verl's recommended 2 x (prompt + response), at most what one GPU's share of the
  mini-batch (update) or batch (log-prob passes) holds, and no more than the GPU's memory left for
  activations fits. The fused log-prob kernels stay off (verl's default): with flash-attn verl's
  log-probs use its Triton cross-entropy, and no measurement here shows the fused kernels winning
  beside it (``bench/logprob_kernels.py`` measures both; a model profile may set them).
- **a GPU node without it**: ``attn_implementation=sdpa`` and the fused log-prob kernels
  (``use_fused_kernels``), which replaced verl's token-by-token log-softmax on an H200 (0.5B GRPO
  step ~300 -> 141 s). A critic still needs flash-attn in verl 0.9.1; the probe refuses that run.
- **no GPU node probed** (a CPU cluster, ``render`` without probe facts): nothing is decided; the job
  keeps the run's settings (verl's default attention) and says so.

Whatever the run's settings set, in any spelling, is kept (:class:`~verl_pipeline.trainer.nodes.choices.Choices`).
Pure functions; no heavy imports.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from verl_pipeline.spec import ModelFacts
from verl_pipeline.trainer.nodes.attention import (
    ACTOR_ATTN_KEY,
    ACTOR_ATTN_OVERRIDE,
    FLASH_IMPLS,
    SDPA,
    VERL_DEFAULT_ATTN,
    explicit_attn_implementation,
)
from verl_pipeline.trainer.nodes.choices import Choices
from verl_pipeline.trainer.nodes.facts import NodeFacts
from verl_pipeline.trainer.overrides import spelled
from verl_pipeline.trainer.scaling import (
    PARAM_OFFLOAD_KEY,
    ROLLOUT_HEADROOM_GB,
    ROLLOUT_HEADROOM_SHARE,
    VERL_DEFAULT_PROMPT,
    VERL_DEFAULT_RESPONSE,
    lora_adapters,
    train_state_gb,
    uses_critic,
    uses_reference,
)

FUSED_KERNELS_KEY = "actor_rollout_ref.model.use_fused_kernels"
SUM_PI_SQUARED_KEY = "actor_rollout_ref.actor.calculate_sum_pi_squared"
#: Sequence packing: the actor's model config (the reference reads the same) and the critic's.
REMOVE_PADDING_KEYS = ("actor_rollout_ref.model.use_remove_padding", "critic.model.use_remove_padding")
#: verl's switch for dynamic batches; the reference, rollout log-prob and critic keys follow it in
#: verl's YAML (``${oc.select:actor_rollout_ref.actor.use_dynamic_bsz,false}``).
DYNAMIC_BSZ_KEY = "actor_rollout_ref.actor.use_dynamic_bsz"
REF_DYNAMIC_KEY = "actor_rollout_ref.ref.log_prob_use_dynamic_bsz"
ROLLOUT_DYNAMIC_KEY = "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz"
CRITIC_DYNAMIC_KEY = "critic.use_dynamic_bsz"
#: The per-GPU token budgets of each pass (verl 0.9.1's ppo_trainer.yaml).
ACTOR_TOKENS_KEY = "actor_rollout_ref.actor.ppo_max_token_len_per_gpu"
ROLLOUT_LOG_PROB_TOKENS_KEY = "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu"
REF_LOG_PROB_TOKENS_KEY = "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu"
CRITIC_TOKENS_KEY = "critic.ppo_max_token_len_per_gpu"
CRITIC_FORWARD_TOKENS_KEY = "critic.forward_max_token_len_per_gpu"

#: verl's recommended least budget, in sequences of prompt + response: a micro batch holds at least this many.
MIN_SEQUENCES_PER_BUDGET = 2
#: Budgets are multiples of this many tokens (above the floor).
BUDGET_STEP = 1024
#: Share of the GPU memory left beside the resident training state (and a headroom) that one micro
#: batch's activations may take: the backward pass and the allocator's fragmentation need the rest.
ACTIVATION_SHARE = 0.5
#: Bytes per token per vocabulary entry in the update and in a log-prob pass: 1.6 to 2 times what the 0.5B
#: GRPO job measured on an H100, whose log-prob passes computed the entropy too (verl 0.9.1 keeps the
#: logits in bf16; the measurement is in docs/scaling.md).
LOGIT_BYTES_UPDATE = 4
LOGIT_BYTES_FORWARD = 4
#: The update's bytes per entry when the loss carries an entropy bonus (``entropy_coeff`` not 0): the
#: entropy's softmax and product and their gradients beside the logits. An estimate no run has measured.
LOGIT_BYTES_ENTROPY_BONUS = 12
ENTROPY_COEFF_KEY = "actor_rollout_ref.actor.entropy_coeff"
#: Bytes per token per hidden unit of one transformer layer's activations in bf16 (Korthikanti et al.,
#: "Reducing activation recomputation", 34 s·b·h per layer; flash-attn keeps no attention scores).
LAYER_BYTES = 34
#: Bytes per token per hidden unit per layer that gradient checkpointing keeps (each layer's bf16 input).
CHECKPOINT_BYTES = 2


class AttentionPath(str, Enum):
    """Which attention the actor gets, and so which path the job takes."""

    #: Every GPU node runs flash-attn: verl's fast path.
    FLASH = "flash-attn"
    #: A GPU node lacks a usable flash-attn: PyTorch's SDPA with the fused log-prob kernels.
    SDPA = "sdpa"
    #: The run's settings name the attention (kept as set).
    SET = "as set by the run"
    #: No GPU node was probed: nothing decided (a CPU cluster, or ``render`` without probe facts).
    UNDECIDED = "undecided"


def nodes_attention(nodes: NodeFacts) -> tuple[str | None, str]:
    """The attention ``nodes`` call for (``flash_attention_2`` where every GPU node runs flash-attn, ``sdpa``
    where one does not, None where no GPU node was probed) and why."""
    usable = nodes.flash_attn
    if usable is None:
        return None, (f"{nodes.describe()}: decided at submit from the probe (flash-attn where every GPU node runs "
                      f"it, else {SDPA}); verl's default {VERL_DEFAULT_ATTN} until then")
    if usable:
        versions = sorted({str(n.flash_attn) for n in nodes.gpu_nodes})
        return VERL_DEFAULT_ATTN, (f"flash-attn {', '.join(versions)} imports and runs on every GPU node "
                                   f"({len(nodes.gpu_nodes)}; {nodes.source})")
    lacking = [n for n in nodes.gpu_nodes if not n.flash_attn]
    why = "; ".join(f"{n.node}: {n.flash_attn_error}" for n in lacking[:3])
    if nodes.silent_gpu_nodes:
        why += ("; " if why else "") + f"{nodes.silent_gpu_nodes} GPU node(s) did not answer the probe"
    return SDPA, f"no usable flash-attn on every GPU node ({why}; {nodes.source})"


def attention_path(settings: Mapping[str, Any], nodes: NodeFacts) -> AttentionPath:
    """The path the actor's attention takes on ``nodes`` with these settings."""
    if explicit_attn_implementation(settings):
        return AttentionPath.SET
    wanted, _ = nodes_attention(nodes)
    return {None: AttentionPath.UNDECIDED, SDPA: AttentionPath.SDPA}.get(wanted, AttentionPath.FLASH)


@dataclass(frozen=True)
class BudgetInputs:
    """What the token budgets are sized from: lengths, batch shares per GPU, the model and the GPU."""

    prompt: int
    response: int
    #: Samples (prompts x rollout.n) of one mini-batch, and of the whole batch, per training GPU.
    mini_samples_per_gpu: int
    batch_samples_per_gpu: int
    gpu_memory_gb: float
    #: Training state that stays on the GPU while it trains (0 when FSDP offloads it).
    resident_gb: float
    model: ModelFacts | None
    gradient_checkpointing: bool = True
    #: The actor's loss carries an entropy bonus: its update keeps the entropy's temporaries.
    entropy_bonus: bool = False

    @property
    def update_logit_bytes(self) -> int:
        return LOGIT_BYTES_ENTROPY_BONUS if self.entropy_bonus else LOGIT_BYTES_UPDATE

    @property
    def sequence(self) -> int:
        return self.prompt + self.response

    @property
    def activation_gb(self) -> float:
        headroom = max(ROLLOUT_HEADROOM_GB, ROLLOUT_HEADROOM_SHARE * self.gpu_memory_gb)
        return max(0.0, ACTIVATION_SHARE * (self.gpu_memory_gb - self.resident_gb - headroom))


def bytes_per_token(model: ModelFacts | None, *, logits: int, update: bool, checkpointing: bool = True) -> int | None:
    """Activation bytes one token costs in a pass; None when the model's vocabulary is unknown and the pass
    computes logits (``logits`` bytes per vocabulary entry; 0 for the critic's value head)."""
    if model is None or (logits and not model.vocab_size):
        return None
    h, layers = model.hidden_size, model.num_layers
    kept = (CHECKPOINT_BYTES * layers + LAYER_BYTES) * h if checkpointing else LAYER_BYTES * layers * h
    return logits * int(model.vocab_size or 0) + (kept if update else LAYER_BYTES * h)


def token_budget(inputs: BudgetInputs, *, samples_per_gpu: int, per_token: int | None) -> tuple[int, str]:
    """One pass's per-GPU token budget and why: at least :data:`MIN_SEQUENCES_PER_BUDGET` full sequences (verl's
    recommendation), at most the GPU's share of the samples (no pass holds more), within what memory fits."""
    floor = MIN_SEQUENCES_PER_BUDGET * inputs.sequence
    cap = max(floor, samples_per_gpu * inputs.sequence)
    share = (f"{samples_per_gpu} sample(s) per GPU x (prompt {inputs.prompt} + response {inputs.response}) = "
             f"{samples_per_gpu * inputs.sequence}")
    if per_token is None:
        return floor, (f"{MIN_SEQUENCES_PER_BUDGET} x (prompt + response) = {floor}, verl's floor: the model profile "
                       "gives no vocab_size, so the logits' memory cannot be sized (set model.vocab_size)")
    fits = int(inputs.activation_gb * 2**30 // per_token) // BUDGET_STEP * BUDGET_STEP
    value = max(floor, min(cap, fits))
    bound = "memory" if fits < cap else "the per-GPU share"
    return value, (f"{value} tokens ({bound} bounds it): the share is {share}; memory fits {fits} "
                   f"({inputs.activation_gb:.0f} GB for activations on a {inputs.gpu_memory_gb:g} GB GPU with "
                   f"{inputs.resident_gb:.1f} GB of training state, {per_token / 1024:.0f} KiB per token); at least "
                   f"{MIN_SEQUENCES_PER_BUDGET} x (prompt + response) = {floor}")


def _int(settings: Mapping[str, Any], key: str, default: int) -> int:
    found = spelled(settings, key)
    try:
        return int(found.value) if found is not None and found.value is not None else default
    except (TypeError, ValueError):
        return default


def _entropy_bonus(settings: Mapping[str, Any]) -> bool:
    found = spelled(settings, ENTROPY_COEFF_KEY)
    try:
        return found is not None and found.value is not None and float(found.value) != 0.0
    except (TypeError, ValueError):
        return True  # unreadable: sized as if the loss carried it, the safer side


def budget_inputs(settings: Mapping[str, Any], model: ModelFacts | None, gpu_memory_gb: float) -> BudgetInputs:
    """The budgets' inputs from the job's settings (shape, batches, lengths, offload) and the GPU's memory."""
    n_gpus = max(1, _int(settings, "trainer.nnodes", 1) * _int(settings, "trainer.n_gpus_per_node", 1))
    n = max(1, _int(settings, "actor_rollout_ref.rollout.n", 1))
    batch = _int(settings, "data.train_batch_size", 1)
    mini = _int(settings, "actor_rollout_ref.actor.ppo_mini_batch_size", batch)
    critic, ref = uses_critic(dict(settings)), uses_reference(dict(settings))
    offload = spelled(settings, PARAM_OFFLOAD_KEY)
    resident = 0.0 if model is None or (offload is not None and offload.value is True) else \
        train_state_gb(model, n_gpus, critic=critic, ref=ref, **lora_adapters(dict(settings), model, critic=critic))
    checkpointing = spelled(settings, "actor_rollout_ref.model.enable_gradient_checkpointing")
    return BudgetInputs(
        prompt=_int(settings, "data.max_prompt_length", VERL_DEFAULT_PROMPT),
        response=_int(settings, "data.max_response_length", VERL_DEFAULT_RESPONSE),
        mini_samples_per_gpu=math.ceil(mini * n / n_gpus), batch_samples_per_gpu=math.ceil(batch * n / n_gpus),
        gpu_memory_gb=gpu_memory_gb, resident_gb=resident, model=model,
        gradient_checkpointing=checkpointing is None or checkpointing.value is not False,
        entropy_bonus=_entropy_bonus(settings))


def dynamic_batches(c: Choices, inputs: BudgetInputs, *, critic: bool, ref: bool) -> None:
    """``use_dynamic_bsz`` and the token budget of each pass, unless the run's settings set them."""
    why = ("dynamic batches on the fast path: micro batches of up to a token budget instead of a fixed count "
           "(verl then ignores the *_micro_batch_size_per_gpu values)")
    if str(c.set(DYNAMIC_BSZ_KEY, True, why)).lower() != "true":
        return  # the run turned them off: verl's other dynamic keys follow its value, no budgets to size
    followers = [ROLLOUT_DYNAMIC_KEY] + ([REF_DYNAMIC_KEY] if ref else []) + ([CRITIC_DYNAMIC_KEY] if critic else [])
    for key in followers:
        c.set(key, True, f"follows {DYNAMIC_BSZ_KEY}")
    ck = inputs.gradient_checkpointing
    update = bytes_per_token(inputs.model, logits=inputs.update_logit_bytes, update=True, checkpointing=ck)
    forward = bytes_per_token(inputs.model, logits=LOGIT_BYTES_FORWARD, update=False)
    value, text = token_budget(inputs, samples_per_gpu=inputs.mini_samples_per_gpu, per_token=update)
    bonus = f" ({ENTROPY_COEFF_KEY} is not 0: the entropy's temporaries are sized too)" if inputs.entropy_bonus else ""
    c.set(ACTOR_TOKENS_KEY, value, f"actor update{bonus}: {text}")
    value, text = token_budget(inputs, samples_per_gpu=inputs.batch_samples_per_gpu, per_token=forward)
    c.set(ROLLOUT_LOG_PROB_TOKENS_KEY, value, f"old log-probs (forward only): {text}")
    if ref:
        c.set(REF_LOG_PROB_TOKENS_KEY, value, f"reference log-probs (forward only): {text}")
    if critic:
        value, text = token_budget(inputs, samples_per_gpu=inputs.mini_samples_per_gpu,
                                   per_token=bytes_per_token(inputs.model, logits=0, update=True, checkpointing=ck))
        c.set(CRITIC_TOKENS_KEY, value, f"critic update (a value per token, no logits): {text}")
        value, text = token_budget(inputs, samples_per_gpu=inputs.batch_samples_per_gpu,
                                   per_token=bytes_per_token(inputs.model, logits=0, update=False))
        c.set(CRITIC_FORWARD_TOKENS_KEY, value, f"critic values (forward only): {text}")


def log_prob_kernels(c: Choices, attention: str) -> None:
    """``use_fused_kernels`` where the actor attends without flash-attn; left to verl (off) where it does.

    Without flash-attn (whose Triton cross-entropy verl uses when it is installed), verl computes the
    log-probs of the packed (tokens x vocabulary) logits one token's log-softmax at a time, in the
    update with autograd: on one H200 that was 1.05 s of every 0.5B micro batch of 9,400 tokens
    against 0.075 s for the fused kernels (``bench/logprob_kernels.py``), and the 0.5B GRPO step went
    from 282-308 to 141 s (docs/benchmarks.md, 2026-12-03). verl refuses them with
    ``calculate_sum_pi_squared``."""
    if attention in FLASH_IMPLS:
        c.note(FUSED_KERNELS_KEY, False, f"left to verl (false): with {attention} verl's log-probs use flash-attn's "
               "Triton cross-entropy, and no measurement shows the fused kernels winning beside it")
        return
    sum_pi = spelled(c.settings, SUM_PI_SQUARED_KEY)
    if sum_pi is not None and str(sum_pi.value).lower() == "true":
        c.note(FUSED_KERNELS_KEY, False, f"left to verl (false): verl refuses them with {SUM_PI_SQUARED_KEY}")
        return
    c.set(FUSED_KERNELS_KEY, True, f"the actor's attention is {attention} (no flash-attn): verl's unfused log-probs "
          "take a log-softmax per token; the fused kernels work in chunks from the hidden states (0.5B GRPO step "
          "~300 -> 141 s on an H200)")


def decide_fast_path(c: Choices, nodes: NodeFacts, model: ModelFacts | None, gpu_memory_gb: float) -> AttentionPath:
    """The attention, packing, dynamic batches and log-prob kernels of the job on ``nodes`` (into ``c``)."""
    path = attention_path(c.settings, nodes)
    wanted, why = nodes_attention(nodes)
    if wanted is None:
        attention = explicit_attn_implementation(c.settings) or VERL_DEFAULT_ATTN
        c.note(ACTOR_ATTN_KEY, attention, why if path is AttentionPath.UNDECIDED else
               f"set by the run's settings; {why}")
    else:
        attention = str(c.set(ACTOR_ATTN_KEY, wanted, why, write_as=ACTOR_ATTN_OVERRIDE))
    if path is AttentionPath.UNDECIDED:
        return path
    critic, ref = uses_critic(dict(c.settings)), uses_reference(dict(c.settings))
    if attention in FLASH_IMPLS and nodes.flash_attn:
        for key in REMOVE_PADDING_KEYS if critic else REMOVE_PADDING_KEYS[:1]:
            c.set(key, True, f"sequence packing on the fast path ({attention} attends packed sequences without "
                  "padding)")
        dynamic_batches(c, budget_inputs(c.settings, model, gpu_memory_gb), critic=critic, ref=ref)
    log_prob_kernels(c, attention)
    return path


__all__ = [
    "ACTOR_TOKENS_KEY",
    "CRITIC_FORWARD_TOKENS_KEY",
    "CRITIC_TOKENS_KEY",
    "DYNAMIC_BSZ_KEY",
    "FUSED_KERNELS_KEY",
    "REF_LOG_PROB_TOKENS_KEY",
    "REMOVE_PADDING_KEYS",
    "ROLLOUT_LOG_PROB_TOKENS_KEY",
    "SUM_PI_SQUARED_KEY",
    "AttentionPath",
    "BudgetInputs",
    "attention_path",
    "budget_inputs",
    "bytes_per_token",
    "decide_fast_path",
    "dynamic_batches",
    "log_prob_kernels",
    "nodes_attention",
    "token_budget",
]
