"""The batch, parallelism and memory rules verl enforces only once GPUs are up (or never), for a run's
target shape: checked when the run's spec is built, so a bad shape fails in seconds, before any cluster.
"""

from __future__ import annotations

import math

from verl_pipeline.constants import Mode
from verl_pipeline.exceptions import ConfigError
from verl_pipeline.spec import RunSpec
from verl_pipeline.trainer import scaling


def check_shape(spec: RunSpec) -> None:
    """The batch/parallelism/memory rules verl enforces only once GPUs are up (or never), for the target shape."""
    tbs, n = _check_batch(spec)
    _check_mini_and_micro_batches(spec, tbs, n)
    _check_rollout(spec)
    _check_cpus(spec)


def _check_batch(spec: RunSpec) -> tuple[int, int]:
    """The global batch and the responses per prompt (returned: ``(train_batch_size, rollout.n)``), and the
    estimator's needs (a group for GRPO-like ones, a critic for GAE)."""
    s = spec.verl
    gpus = spec.train_gpus  # the GPUs that train (all, unless rollout has a pool)
    tbs = int(s.get("data.train_batch_size", 0) or 0)
    n = int(s.get("actor_rollout_ref.rollout.n", 1) or 1)
    if tbs <= 0:
        step = scaling.batch_step(spec.train_gpus_per_node, n)
        raise ConfigError("data.train_batch_size", tbs, "must be a positive number of prompts",
                          f"data.train_batch_size={step * spec.train_nnodes}")
    if n < 1:
        raise ConfigError("actor_rollout_ref.rollout.n", n, "must be >= 1", "actor_rollout_ref.rollout.n=1")
    if (tbs * n) % gpus:
        good = _round_up(tbs, max(1, gpus // math.gcd(gpus, n)))
        raise ConfigError(
            "data.train_batch_size", tbs,
            f"train_batch_size x rollout.n ({tbs} x {n}) must be divisible by nnodes x n_gpus_per_node ({gpus})",
            f"data.train_batch_size={good}",
        )
    estimator = str(s.get("algorithm.adv_estimator", "gae"))
    if estimator in ("grpo", "rloo", "grpo_passk") and n < 2:
        raise ConfigError("actor_rollout_ref.rollout.n", n,
                          f"{estimator} normalises rewards within a group of responses per prompt: needs n >= 2",
                          "actor_rollout_ref.rollout.n=5")
    if estimator == "gae" and s.get("critic.enable") is False:
        raise ConfigError("critic.enable", False, "gae advantages need a critic", "critic.enable=true "
                          "(or algorithm.adv_estimator=grpo with rollout.n >= 2)")
    return tbs, n


def _check_mini_and_micro_batches(spec: RunSpec, tbs: int, n: int) -> None:
    """The actor's (and the critic's) mini-batch within the batch and split evenly over the training GPUs,
    and its micro batch dividing the per-GPU share."""
    s = spec.verl
    gpus = spec.train_gpus
    roles = ["actor_rollout_ref.actor"] + (["critic"] if scaling.uses_critic(s) else [])
    for prefix in roles:
        mini_key = f"{prefix}.ppo_mini_batch_size"
        mini = int(s.get(mini_key, s.get("actor_rollout_ref.actor.ppo_mini_batch_size", tbs)) or 0)
        if mini < 1 or mini > tbs:
            raise ConfigError(mini_key, mini, f"must be between 1 and data.train_batch_size ({tbs})",
                              f"{mini_key}={tbs}")
        if (mini * n) % gpus:
            good = _round_up(mini, max(1, gpus // math.gcd(gpus, n)))
            raise ConfigError(mini_key, mini,
                              f"ppo_mini_batch_size x rollout.n ({mini} x {n}) must split evenly over {gpus} GPU(s) "
                              "(verl divides it per GPU when the workers start)",
                              f"{mini_key}={min(good, tbs) if (min(good, tbs) * n) % gpus == 0 else good}")
        per_gpu = mini * n // gpus
        micro_key = f"{prefix}.ppo_micro_batch_size_per_gpu"
        micro = s.get(micro_key)
        if micro is not None and not s.get(f"{prefix}.use_dynamic_bsz"):
            micro = int(micro)
            if micro < 1 or per_gpu % micro:
                good = max(d for d in range(1, min(per_gpu, max(micro, 1)) + 1) if per_gpu % d == 0)
                raise ConfigError(micro_key, micro,
                                  f"must divide the per-GPU mini-batch ({mini} x rollout.n {n} / {gpus} GPU(s) = "
                                  f"{per_gpu} samples)", f"{micro_key}={good}")


def _check_rollout(spec: RunSpec) -> None:
    """Rollout tensor parallelism (dividing the node's GPUs and the model's heads, small enough shards for
    vLLM's share of a GPU) and vLLM's memory utilisation."""
    s = spec.verl
    g = spec.train_gpus_per_node
    tp_key = scaling.ROLLOUT_TP_KEY
    tp = int(s.get(tp_key, 1) or 1)
    divisors = [d for d in range(1, g + 1) if g % d == 0]
    if tp < 1 or g % tp:
        raise ConfigError(tp_key, tp, f"must divide n_gpus_per_node ({g})", f"one of {divisors}")
    facts, hw = spec.model_facts, spec.hardware
    if facts is not None:
        if facts.num_attention_heads % tp:
            ok = [d for d in divisors if facts.num_attention_heads % d == 0]
            raise ConfigError(tp_key, tp, f"must divide the model's num_attention_heads ({facts.num_attention_heads})",
                              f"one of {ok}")
        util_now = float(s.get(scaling.ROLLOUT_GPU_SHARE_KEY, 0.9) or 0.9)
        limit = scaling.ROLLOUT_WEIGHT_LIMIT * util_now * hw.gpu_memory_gb if hw else 0.0
        if hw is not None and facts.weights_gb / tp > limit:
            best, _why = scaling.rollout_tp(facts, hw, g)
            raise ConfigError(tp_key, tp,
                              f"bf16 weights {facts.weights_gb:.1f} GB / tp {tp} do not fit: vLLM's share of a "
                              f"{hw.gpu_memory_gb:g} GB GPU ({util_now}) must keep half for the KV cache "
                              f"(limit {limit:.1f} GB)", f"{tp_key}={best}" if best else
                              f"n_gpus_per_node >= {scaling.min_gpus_per_node(facts, hw)}")
    util_key = scaling.ROLLOUT_GPU_SHARE_KEY
    util = s.get(util_key)
    if util is not None and not 0.1 <= float(util) <= 0.95:
        util_ok = scaling.memory_utilization(hw.gpu_memory_gb)[0] if hw else 0.85
        raise ConfigError(util_key, util, "must be between 0.1 and 0.95 (vLLM needs headroom for CUDA graphs)",
                          f"{util_key}={util_ok}")


def _check_cpus(spec: RunSpec) -> None:
    """The CPUs verl reserves per GPU, and in all, against the cluster profile's ``cpus_per_node`` (training only)."""
    hw = spec.hardware
    if hw is None or hw.cpus_per_node is None or spec.mode is Mode.PREFLIGHT:
        return
    per_node = scaling.CPUS_PER_GPU_BUNDLE * spec.n_gpus_per_node  # both pools' GPUs hold a bundle
    if hw.cpus_per_node < per_node:
        raise ConfigError(f"clusters/{spec.cluster_profile}.hardware.cpus_per_node", hw.cpus_per_node,
                          f"verl reserves {scaling.CPUS_PER_GPU_BUNDLE} CPUs per GPU: {spec.n_gpus_per_node} "
                          "GPU(s) per node need "
                          f"{per_node}", f"n_gpus_per_node <= {max(1, hw.cpus_per_node // 3)} or more CPUs")
    need, why = scaling.required_cpus(spec.n_gpus, spec.verl)
    if hw.cpus_per_node * spec.nnodes < need:
        raise ConfigError(f"clusters/{spec.cluster_profile}.hardware.cpus_per_node", hw.cpus_per_node,
                          f"{spec.nnodes} node(s) give {hw.cpus_per_node * spec.nnodes} CPUs; verl needs {why}",
                          f"cpus_per_node >= {-(-need // spec.nnodes)}")


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple
