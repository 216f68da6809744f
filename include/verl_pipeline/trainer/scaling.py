"""Scaling rules: verl settings derived from the model, the cluster hardware and the target shape.

Every rule is a plain function of the model profile's facts (``model.params_b``, ``hidden_size``,
``num_layers``, ``num_attention_heads``), the cluster profile's hardware (GPU memory, CPUs, network)
and the shape (``nnodes`` x ``n_gpus_per_node``). Each derived value is recorded with the rule
that produced it, and each is overridable: a key set explicitly in a profile's ``verl:`` section
(or passed as an override) is kept, and the record says what the rule would have chosen.

What depends on the nodes themselves (flash-attn or not, the GPU they have, the versions their caches
are keyed by) is decided at submit, once the probe has seen them: ``trainer/nodes/decisions.py``.

No heavy imports here: the rules run on the Airflow worker in microseconds.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from verl_pipeline.exceptions import ConfigError
from verl_pipeline.spec import Hardware, ModelFacts, PoolSplit
from verl_pipeline.trainer.lora import CRITIC_PREFIX, Adapter, adapter
from verl_pipeline.trainer.overrides import spellings

#: Share of a GPU's memory the rollout weights may take; the rest is KV cache and the actor.
ROLLOUT_WEIGHT_SHARE = 0.35
#: Hard limit for an explicit TP: weights may take at most this share of vLLM's memory (rest: KV cache).
ROLLOUT_WEIGHT_LIMIT = 0.5
#: Models at least this large (billions of parameters) always get tensor parallelism >= 2.
LARGE_MODEL_B = 20.0
#: FSDP training state per parameter with fp32 master weights: 4 (weights) + 4 (grads) + 8 (Adam).
TRAIN_BYTES_PER_PARAM = 16
#: A LoRA run's frozen base weights per parameter: fp32 (verl loads a trained model in ``fsdp_config.model_dtype``
#: fp32), without gradients or Adam's moments, which only the adapter has (``trainer/lora.py``).
FROZEN_BYTES_PER_PARAM = 4
#: What a checkpoint saves of that per parameter: the weights and Adam's moments, not the gradients (verl's
#: default ``save_contents``; the extra state is small).
SAVE_BYTES_PER_PARAM = TRAIN_BYTES_PER_PARAM - 4
#: Share of a GPU's memory the sharded training state may take before offloading switches on.
TRAIN_STATE_SHARE = 0.35
#: CPUs verl's placement group reserves per GPU (one bundle per GPU, ``max_colocate_count`` = 3).
CPUS_PER_GPU_BUNDLE = 3
#: TransferQueue's default number of storage actors (1 CPU each) in verl 0.9.
TRANSFER_QUEUE_STORAGE_UNITS = 8
#: Driver-side actors of a verl job: the TaskRunner and the TransferQueue controller (1 CPU each).
DRIVER_CPUS = 2
#: Oldest Ray verl 0.9 supports on the cluster.
MIN_RAY_VERSION = (2, 41)

# gpu_memory_utilization by GPU memory (GB): bigger GPUs keep a smaller share free for the actor.
_UTILIZATION = ((24, 0.8), (48, 0.85), (96, 0.9), (math.inf, 0.95))
#: verl 0.9.1's ``actor_rollout_ref.rollout.max_num_seqs`` (rollout.yaml): the most sequences one vLLM replica
#: decodes at once; a step's sequences beyond it wait and run in another wave, as long as its longest response.
VERL_MAX_NUM_SEQS = 256
MAX_NUM_SEQS_KEY = "actor_rollout_ref.rollout.max_num_seqs"
ROLLOUT_TP_KEY = "actor_rollout_ref.rollout.tensor_model_parallel_size"
#: vLLM's share of each GPU's memory (the rollout engine's weights and KV cache).
ROLLOUT_GPU_SHARE_KEY = "actor_rollout_ref.rollout.gpu_memory_utilization"
#: The actor's FSDP parameter offload (the reference's and the critic's follow it in the offload rule).
PARAM_OFFLOAD_KEY = "actor_rollout_ref.actor.fsdp_config.param_offload"
#: The largest decode batch vLLM 0.24 captures a CUDA graph for by default (``min(2 x max_num_seqs, 512)``,
#: vllm/config/vllm.py): a larger one runs without graphs, so a wave is kept at most this large.
VLLM_MAX_GRAPH_BATCH = 512
#: Share of vLLM's memory left after the weights that is not KV cache (its activations, CUDA graphs, sampler).
ROLLOUT_NON_KV_SHARE = 0.2
#: verl's defaults for the lengths when the run leaves them unset (ppo_trainer.yaml ``data:``).
VERL_DEFAULT_PROMPT, VERL_DEFAULT_RESPONSE = 512, 512
#: What vLLM's share must leave on the GPU besides the training state that stays there while it
#: generates: the other processes' CUDA contexts and allocator caches (the larger of the two).
ROLLOUT_HEADROOM_GB, ROLLOUT_HEADROOM_SHARE = 4.0, 0.10


@dataclass(frozen=True)
class Rule:
    """One derived (or explicitly kept) value and why."""

    key: str
    value: Any
    rule: str
    overridden: bool = False

    def text(self) -> str:
        return f"{self.value!r} — {self.rule}" + (" [explicit value kept]" if self.overridden else "")


@dataclass
class Derivation:
    settings: dict[str, Any]
    rules: list[Rule] = field(default_factory=list)

    def set(self, key: str, value: Any, rule: str, explicit: set[str]) -> None:
        given = next((spelling for spelling in spellings(key) if spelling in explicit), None)
        if given is not None:
            if given != key:
                # ``++key`` / ``+key`` for a key the rules set bare: the bare spelling is valid for it and means the
                # same, and with one spelling the user's value is the one rendered (beside the rule's bare key,
                # Hydra applied whichever sorted last) and the one the later rules read.
                self.settings[key] = self.settings.pop(given)
            self.rules.append(Rule(key, self.settings[key], f"set explicitly; the rule would give {value!r} ({rule})",
                                   overridden=True))
            return
        self.settings[key] = value
        self.rules.append(Rule(key, value, rule))


ROLLOUT_NODES_KEY = "actor_rollout_ref.rollout.nnodes"
ROLLOUT_GPUS_KEY = "actor_rollout_ref.rollout.n_gpus_per_node"


def split_pools(nnodes: int, n_gpus_per_node: int, settings: dict[str, Any]) -> PoolSplit:
    """Split the cluster between training and rollout: half the nodes (rounded down) generate, the
    rest train, since generation is most of an RL step; on one node its GPUs are halved. An explicit
    ``actor_rollout_ref.rollout.nnodes`` / ``n_gpus_per_node`` sets the rollout pool instead."""
    g = n_gpus_per_node
    set_nodes, set_gpus = settings.get(ROLLOUT_NODES_KEY), settings.get(ROLLOUT_GPUS_KEY)
    if nnodes >= 2:
        rollout_nodes = int(set_nodes) if set_nodes else nnodes // 2
        if not 1 <= rollout_nodes < nnodes:
            raise ConfigError(ROLLOUT_NODES_KEY, rollout_nodes,
                              f"must leave training at least one of the {nnodes} nodes",
                              f"{ROLLOUT_NODES_KEY}={nnodes // 2}")
        rollout_g = int(set_gpus) if set_gpus else g
        if not 1 <= rollout_g <= g:
            raise ConfigError(ROLLOUT_GPUS_KEY, rollout_g, f"must be between 1 and n_gpus_per_node ({g})",
                              f"{ROLLOUT_GPUS_KEY}={g}")
        why = ("set explicitly" if set_nodes else
               f"half of {nnodes} nodes, rounded down: generation is most of an RL step")
        return PoolSplit(nnodes - rollout_nodes, g, rollout_nodes, rollout_g,
                         f"{rollout_nodes} node(s) x {rollout_g} GPU(s) for rollout ({why}), "
                         f"{nnodes - rollout_nodes} node(s) x {g} for training")
    if g < 2:
        raise ConfigError("placement", "separate", "needs at least 2 GPUs: one pool trains, the other generates",
                          "placement: colocated, or n_gpus_per_node >= 2")
    if set_nodes and int(set_nodes) != 1:
        raise ConfigError(ROLLOUT_NODES_KEY, set_nodes, "a 1-node cluster has one node to share",
                          f"{ROLLOUT_NODES_KEY}=1")
    rollout_g = int(set_gpus) if set_gpus else g // 2
    if not 1 <= rollout_g < g:
        raise ConfigError(ROLLOUT_GPUS_KEY, rollout_g, f"must leave training at least one of the node's {g} GPUs",
                          f"{ROLLOUT_GPUS_KEY}={g // 2}")
    why = "set explicitly" if set_gpus else f"half of the node's {g} GPUs"
    return PoolSplit(1, g - rollout_g, 1, rollout_g,
                     f"1 node: {rollout_g} GPU(s) for rollout ({why}), {g - rollout_g} for training")


def separate_settings(d: Derivation, split: PoolSplit, explicit: set[str]) -> None:
    """verl's settings for a rollout pool of its own (``trainer.v1.trainer_mode=separate_async``)."""
    d.set("trainer.v1.trainer_mode", "separate_async", "placement: separate (rollout on its own GPU pool)", explicit)
    d.set("actor_rollout_ref.hybrid_engine", False,
          "placement: separate — no rollout replicas on the training GPUs", explicit)
    d.set(ROLLOUT_NODES_KEY, split.rollout_nnodes, split.reason, explicit)
    d.set(ROLLOUT_GPUS_KEY, split.rollout_gpus_per_node, split.reason, explicit)
    d.set("actor_rollout_ref.rollout.checkpoint_engine.backend", "nccl",
          "separate pools send the weights to rollout over NCCL (verl refuses 'naive' here)", explicit)
    tbs = int(d.settings["data.train_batch_size"])
    mini = int(d.settings["actor_rollout_ref.actor.ppo_mini_batch_size"])
    sync_key = "trainer.v1.separate_async.parameter_sync_step"
    if tbs % mini:
        raise ConfigError("actor_rollout_ref.actor.ppo_mini_batch_size", mini,
                          f"placement: separate needs data.train_batch_size ({tbs}) = parameter_sync_step x "
                          "ppo_mini_batch_size", f"a divisor of {tbs}")
    d.set(sync_key, tbs // mini, f"data.train_batch_size {tbs} / ppo_mini_batch_size {mini}: weights go to rollout "
          "after every mini-batch update (verl requires the product)", explicit)
    if int(d.settings[sync_key]) * mini != tbs:
        raise ConfigError(sync_key, d.settings[sync_key], f"verl's separate_async trainer needs parameter_sync_step x "
                          f"ppo_mini_batch_size ({mini}) = data.train_batch_size ({tbs})", f"{sync_key}={tbs // mini}")
    tp = int(d.settings.get(ROLLOUT_TP_KEY, 1) or 1)
    if split.rollout_gpus_per_node % tp:
        raise ConfigError(ROLLOUT_TP_KEY, tp,
                          f"must divide the rollout pool's GPUs per node ({split.rollout_gpus_per_node})",
                          f"one of {_divisors(split.rollout_gpus_per_node)}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def uses_critic(settings: dict[str, Any]) -> bool:
    enabled = settings.get("critic.enable")
    if enabled is not None:
        return bool(enabled)
    return settings.get("algorithm.adv_estimator", "gae") == "gae"


def uses_reference(settings: dict[str, Any]) -> bool:
    return bool(settings.get("actor_rollout_ref.actor.use_kl_loss")) or bool(settings.get("algorithm.use_kl_in_reward"))


def batch_step(n_gpus_per_node: int, rollout_n: int) -> int:
    """The per-node prompt count must be a multiple of this so prompts x rollout.n split evenly over GPUs."""
    return n_gpus_per_node // math.gcd(n_gpus_per_node, rollout_n)


def rollout_tp(model: ModelFacts, hw: Hardware, n_gpus_per_node: int) -> tuple[int | None, str]:
    """Smallest tensor-parallel size that divides GPUs per node, the attention heads, and fits the weights."""
    budget = ROLLOUT_WEIGHT_SHARE * hw.gpu_memory_gb
    floor = 2 if model.params_b >= LARGE_MODEL_B else 1
    for tp in _divisors(n_gpus_per_node):
        if tp < floor or model.num_attention_heads % tp:
            continue
        if model.weights_gb / tp <= budget:
            why = (f"bf16 weights {model.weights_gb:.1f} GB / tp {tp} = {model.weights_gb / tp:.1f} GB <= "
                   f"{ROLLOUT_WEIGHT_SHARE:.0%} of {hw.gpu_memory_gb:g} GB; tp divides n_gpus_per_node "
                   f"({n_gpus_per_node}) and num_attention_heads ({model.num_attention_heads})")
            if floor > 1:
                why += f"; >= 2 for models >= {LARGE_MODEL_B:g}B"
            if model.estimated:
                why += f"; {model.params_b:.1f}B estimated from hidden_size x num_layers (set model.params_b)"
            return tp, why
    need = max(floor, math.ceil(model.weights_gb / budget))
    return None, (f"bf16 weights {model.weights_gb:.1f} GB need tp >= {need} to stay within "
                  f"{ROLLOUT_WEIGHT_SHARE:.0%} of {hw.gpu_memory_gb:g} GB per GPU, but only {n_gpus_per_node} "
                  "GPU(s) per node")


def min_gpus_per_node(model: ModelFacts, hw: Hardware) -> int:
    """The fewest GPUs per node (a power of two) for which the rollout TP rule has a solution."""
    for g in (1, 2, 4, 8, 16):
        if rollout_tp(model, hw, g)[0] is not None:
            return g
    return 32


def memory_utilization(gpu_memory_gb: float) -> tuple[float, str]:
    for limit, util in _UTILIZATION:
        if gpu_memory_gb <= limit:
            bound = f"<= {limit:g} GB" if math.isfinite(limit) else f"> {_UTILIZATION[-2][0]:g} GB"
            return util, f"GPU memory {gpu_memory_gb:g} GB ({bound}) -> {util}"
    raise AssertionError("unreachable")


def rollout_memory_utilization(gpu_memory_gb: float, resident_gb: float) -> tuple[float, str]:
    """vLLM's share of a GPU whose training state (``resident_gb``; 0 when offloaded) stays on it while
    vLLM generates: the tier by GPU memory, capped so the state and a headroom fit beside vLLM's share.

    vLLM takes its share of the whole GPU when it wakes for a rollout; verl frees it only while the actor
    trains. On one H200 the 0.5B GRPO profile at 0.95 (132.8 GiB) ran out of memory at step 2's rollout,
    beside the actor's 7 GiB of FSDP state.
    """
    tier, why = memory_utilization(gpu_memory_gb)
    headroom = max(ROLLOUT_HEADROOM_GB, ROLLOUT_HEADROOM_SHARE * gpu_memory_gb)
    fit = math.floor(20 * (1 - (resident_gb + headroom) / gpu_memory_gb)) / 20
    if fit >= tier:
        return tier, why
    return max(fit, 0.1), (f"{why}, capped at {max(fit, 0.1)}: the training state left on the GPU during rollout "
                           f"({resident_gb:.1f} GB) and {headroom:.0f} GB for the other processes must fit beside "
                           "vLLM's share")


def _model_state_gb(model: ModelFacts, lora: Adapter | None) -> float:
    """One trained model's FSDP state, unsharded: every weight trained, or frozen fp32 weights and an adapter."""
    if lora is None:
        return model.params_b * TRAIN_BYTES_PER_PARAM
    return model.params_b * FROZEN_BYTES_PER_PARAM + lora.params_b * TRAIN_BYTES_PER_PARAM


def train_state_gb(model: ModelFacts, n_gpus: int, *, critic: bool, ref: bool, actor_lora: Adapter | None = None,
                   critic_lora: Adapter | None = None) -> float:
    """Estimated sharded FSDP state per GPU: actor (+ critic) Adam state, (+ bf16 reference weights). A LoRA model
    (``actor_lora``/``critic_lora``: :func:`verl_pipeline.trainer.lora.adapter`) counts gradients and Adam for its
    adapter only; a LoRA actor's reference is itself without the adapter (no reference weights)."""
    total = _model_state_gb(model, actor_lora) + (_model_state_gb(model, critic_lora) if critic else 0.0)
    if ref and actor_lora is None:
        total += model.params_b * 2
    return total / n_gpus


def lora_adapters(settings: dict[str, Any], model: ModelFacts, *, critic: bool) -> dict[str, Adapter | None]:
    """The adapters :func:`train_state_gb` counts (None: a model that trains every weight)."""
    return {"actor_lora": adapter(settings, model), "critic_lora": adapter(settings, model, CRITIC_PREFIX) if critic
            else None}


def _state_terms(model: ModelFacts, *, critic: bool, ref: bool, actor_lora: Adapter | None,
                 critic_lora: Adapter | None) -> str:
    """What :func:`train_state_gb` counted, in words."""
    full = f"{model.params_b:g}B x {TRAIN_BYTES_PER_PARAM} B/param"
    if actor_lora is None and critic_lora is None:
        return f"{full}{' x 2 (critic)' if critic else ''}{' + bf16 reference' if ref else ''}"

    def one(lora: Adapter | None) -> str:
        if lora is None:
            return full
        return (f"{model.params_b:g}B frozen x {FROZEN_BYTES_PER_PARAM} B (fp32 weights, no gradients or Adam) + "
                f"{lora.describe()} x {TRAIN_BYTES_PER_PARAM} B/param")

    terms = f"actor: {one(actor_lora)}" + (f"; critic: {one(critic_lora)}" if critic else "")
    if ref:
        terms += ("; the reference is the actor without its adapter (no copy)" if actor_lora is not None
                  else " + bf16 reference")
    return terms


def _pick_mini(base: int, step: int, per_node_batch: int) -> int:
    """Multiple of ``step`` dividing ``per_node_batch``, closest to ``base`` from below (else the smallest)."""
    options = [m for m in range(step, per_node_batch + 1, step) if per_node_batch % m == 0]
    below = [m for m in options if m <= base]
    return max(below) if below else min(options)


def _largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in _divisors(n) if d <= max(1, cap))


def derive(
    settings: dict[str, Any],
    scaling: dict[str, Any],
    model: ModelFacts,
    hw: Hardware,
    *,
    nnodes: int,
    n_gpus_per_node: int,
    explicit: set[str],
) -> Derivation:
    """Apply every rule to ``settings`` (flat verl keys); keys in ``explicit`` are kept as set."""
    d = Derivation(dict(settings))
    g, n_gpus = n_gpus_per_node, nnodes * n_gpus_per_node
    n = int(settings.get("actor_rollout_ref.rollout.n", 1) or 1)
    critic, ref = uses_critic(settings), uses_reference(settings)

    # -- batch sizes ------------------------------------------------------------------------------
    step = batch_step(g, n)
    base = int(scaling.get("train_batch_size_per_node", 0) or 0)
    if base < 1:
        raise ConfigError("scaling.train_batch_size_per_node", scaling.get("train_batch_size_per_node"),
                          "the model profile must give a positive per-node prompt batch",
                          "train_batch_size_per_node: 128")
    per_node = math.ceil(base / step) * step
    rounded = "" if per_node == base else f" (rounded up from {base})"
    d.set("data.train_batch_size", per_node * nnodes,
          f"{per_node} prompts per node{rounded} x {nnodes} node(s); per-node count is a multiple of "
          f"{step} so {per_node} x rollout.n {n} splits over {g} GPU(s) per node", explicit)

    mini_base = int(scaling.get("ppo_mini_batch_size_per_node", per_node) or per_node)
    mini_node = _pick_mini(mini_base, step, per_node)
    mini = mini_node * nnodes
    d.set("actor_rollout_ref.actor.ppo_mini_batch_size", mini,
          f"{mini_node} per node x {nnodes} node(s) ({per_node // mini_node} update(s) per step); multiple of {step} "
          f"dividing the per-node batch", explicit)
    mini = int(d.settings["actor_rollout_ref.actor.ppo_mini_batch_size"])
    per_gpu_mini = max(1, mini * n // n_gpus)
    cap = int(scaling.get("max_micro_batch_size_per_gpu", 4) or 4)
    micro = _largest_divisor_at_most(per_gpu_mini, cap)
    micro_rule = (f"largest divisor of the per-GPU mini-batch ({mini} x rollout.n {n} / {n_gpus} GPU(s) = "
                  f"{per_gpu_mini} samples) <= max_micro_batch_size_per_gpu {cap}")
    d.set("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu", micro, micro_rule, explicit)
    log_prob = int(scaling.get("log_prob_micro_batch_size_per_gpu", 2 * cap) or 2 * cap)
    lp_rule = "forward-only log-prob micro batch per GPU (model profile scaling; default 2 x max micro batch)"
    d.set("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu", log_prob, lp_rule, explicit)
    if ref:
        d.set("actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu", log_prob, lp_rule, explicit)
    if critic:
        d.set("critic.ppo_mini_batch_size", mini, "same prompts per update as the actor", explicit)
        d.set("critic.ppo_micro_batch_size_per_gpu", micro, micro_rule, explicit)

    # -- rollout parallelism and memory -------------------------------------------------------------
    tp, why = rollout_tp(model, hw, g)
    if tp is None:
        raise ConfigError(ROLLOUT_TP_KEY, None,
                          f"the model does not fit: {why}",
                          f"n_gpus_per_node >= {min_gpus_per_node(model, hw)} or GPUs with more memory")
    d.set(ROLLOUT_TP_KEY, tp, why, explicit)
    loras = lora_adapters(settings, model, critic=critic)
    state = train_state_gb(model, n_gpus, critic=critic, ref=ref, **loras)
    budget = TRAIN_STATE_SHARE * hw.gpu_memory_gb
    offload = state > budget
    util, why = rollout_memory_utilization(hw.gpu_memory_gb, 0.0 if offload else state)
    d.set(ROLLOUT_GPU_SHARE_KEY, util,
          why + " (verl frees the KV cache while the actor trains)", explicit)

    why = (f"estimated FSDP state {state:.1f} GB per GPU ({_state_terms(model, critic=critic, ref=ref, **loras)} / "
           f"{n_gpus} GPU(s)) {'>' if offload else '<='} {TRAIN_STATE_SHARE:.0%} of {hw.gpu_memory_gb:g} GB")
    d.set(PARAM_OFFLOAD_KEY, offload, why, explicit)
    d.set("actor_rollout_ref.actor.fsdp_config.optimizer_offload", offload, why, explicit)
    if ref:
        d.set("actor_rollout_ref.ref.fsdp_config.param_offload", offload, why, explicit)
    if critic:
        d.set("critic.fsdp.param_offload", offload, why, explicit)
        d.set("critic.fsdp.optimizer_offload", offload, why, explicit)
    return d


def kv_bytes_per_token(model: ModelFacts, tp: int) -> float:
    """One token's K and V in bf16 on one GPU of a replica (TP shards the KV heads; a head is not split)."""
    kv_heads = model.num_key_value_heads or model.num_attention_heads
    head_dim = model.hidden_size / model.num_attention_heads
    return 2 * 2 * model.num_layers * head_dim * kv_heads / min(tp, kv_heads)


def rollout_max_num_seqs(settings: dict[str, Any], model: ModelFacts, hw: Hardware, *, replicas: int,
                         tp: int) -> tuple[int | None, str]:
    """vLLM's ``max_num_seqs`` for a step's sequences in one wave per replica, as far as the KV cache holds them;
    None where verl's default already does (or the KV cache holds no more, or the rollout is not vLLM's)."""
    seqs = math.ceil(int(settings["data.train_batch_size"]) * int(settings.get("actor_rollout_ref.rollout.n", 1) or 1)
                     / max(1, replicas))
    wave = (f"{seqs} sequences per replica per step (data.train_batch_size x rollout.n / {replicas} replica(s) of tp "
            f"{tp})")
    if settings.get("actor_rollout_ref.rollout.name", "vllm") != "vllm":
        return None, "vLLM's setting; the rollout is not vLLM's"
    if seqs <= VERL_MAX_NUM_SEQS:
        return None, f"{wave} fit verl's default {VERL_MAX_NUM_SEQS}: one wave"
    length = int(settings.get("data.max_prompt_length", VERL_DEFAULT_PROMPT) or VERL_DEFAULT_PROMPT) + \
        int(settings.get("data.max_response_length", VERL_DEFAULT_RESPONSE) or VERL_DEFAULT_RESPONSE)
    util = float(settings.get(ROLLOUT_GPU_SHARE_KEY, 0.5))
    kv_gb = (util * hw.gpu_memory_gb - model.weights_gb / tp) * (1 - ROLLOUT_NON_KV_SHARE)
    per_token = kv_bytes_per_token(model, tp)
    fit = int(kv_gb * 1e9 // (per_token * length)) if kv_gb > 0 else 0
    heads = (f"{model.num_key_value_heads} KV heads" if model.num_key_value_heads else
             f"{model.num_attention_heads} KV heads assumed (set model.num_key_value_heads)")
    kv = (f"the KV cache ({1 - ROLLOUT_NON_KV_SHARE:.0%} of {util} x {hw.gpu_memory_gb:g} GB less the weights "
          f"= {kv_gb:.0f} GB; {per_token / 1024:.0f} KiB per token, {heads}) holds {fit} of "
          f"{length}-token sequences")
    if fit <= VERL_MAX_NUM_SEQS:
        return None, f"{wave}, but {kv}: verl's default {VERL_MAX_NUM_SEQS} stays"
    waves = math.ceil(seqs / min(fit, VLLM_MAX_GRAPH_BATCH))
    value = math.ceil(seqs / waves)  # waves of equal size
    if value <= VERL_MAX_NUM_SEQS:  # as many waves as verl's default gives
        return None, f"{wave}, but {kv}: {waves} wave(s) either way, verl's default {VERL_MAX_NUM_SEQS} stays"
    return value, (f"{wave} in {waves} wave(s) instead of {math.ceil(seqs / VERL_MAX_NUM_SEQS)} at verl's "
                   f"{VERL_MAX_NUM_SEQS} (with responses near the length cap each wave lasts as long as its longest); "
                   f"a wave at most {VLLM_MAX_GRAPH_BATCH}, vLLM's largest CUDA-graph batch; {kv}")


def rollout_settings(d: Derivation, model: ModelFacts, hw: Hardware, *, rollout_gpus: int, explicit: set[str]) -> None:
    """How many sequences each vLLM replica of the rollout's ``rollout_gpus`` decodes at once."""
    tp = int(d.settings.get(ROLLOUT_TP_KEY, 1) or 1)
    value, why = rollout_max_num_seqs(d.settings, model, hw, replicas=max(1, rollout_gpus // tp), tp=tp)
    if value is not None or any(sp in explicit for sp in spellings(MAX_NUM_SEQS_KEY)):
        d.set(MAX_NUM_SEQS_KEY, value if value is not None else VERL_MAX_NUM_SEQS, why, explicit)


def required_cpus(n_gpus: int, settings: dict[str, Any]) -> tuple[int, str]:
    """CPUs a verl 0.9 training job reserves on the cluster."""
    units = int(settings.get("transfer_queue.backend.SimpleStorage.num_data_storage_units",
                             TRANSFER_QUEUE_STORAGE_UNITS))
    total = CPUS_PER_GPU_BUNDLE * n_gpus + units + DRIVER_CPUS
    return total, (f"{CPUS_PER_GPU_BUNDLE} per GPU bundle x {n_gpus} GPU(s) + {units} TransferQueue storage "
                   f"actors + {DRIVER_CPUS} (TaskRunner, TransferQueue controller) = {total}")


def nccl_env(hw: Hardware, *, debug: bool) -> dict[str, str]:
    env: dict[str, str] = {}
    if hw.infiniband:
        env["NCCL_IB_HCA"] = ",".join(hw.ib_hcas)
        if hw.nccl_proto:
            env["NCCL_PROTO"] = str(hw.nccl_proto)
    if debug:
        env["NCCL_DEBUG"] = "INFO"
    return env


def parse_version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for piece in str(text).split(".")[:3]:
        m = re.match(r"\d+", piece)
        if not m:
            break
        parts.append(int(m.group()))
        if m.end() < len(piece):  # "0rc1": a pre-release suffix ends the numeric part
            break
    return tuple(parts) or None
