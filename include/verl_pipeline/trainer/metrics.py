"""The verl 0.9.1 metric names the pipeline reads, each named once: the run report, the job's progress
line and the exported model's final reward all use these.

From verl's ``trainer/ppo/metric_utils.py`` (``compute_data_metrics``, ``compute_timing_metrics``,
``compute_throughout_metrics``), its trainers (``perf/mfu/*``, ``val-core/…``) and
``workers/engine_workers.py`` (peak memory). ``perf/throughput`` is tokens per second **per GPU**
(``perf/total_num_tokens / (perf/time_per_step * n_gpus)``, the GPUs of every resource pool).
"""

from __future__ import annotations

from collections.abc import Mapping

STEP = "training/global_step"
SCORE = "critic/score/mean"
RESPONSE_LENGTH = "response_length/mean"
RESPONSE_LENGTH_MAX = "response_length/max"
#: The prompts' mean length in tokens (``compute_data_metrics``).
PROMPT_LENGTH = "prompt_length/mean"
#: Tokens (prompt + response) per second per GPU.
THROUGHPUT_PER_GPU = "perf/throughput"
#: Tokens (prompt + response) of the step's batch.
TOTAL_TOKENS = "perf/total_num_tokens"
TIME_PER_STEP = "perf/time_per_step"
MFU_ACTOR = "perf/mfu/actor"
MFU_CRITIC = "perf/mfu/critic"
#: Peak GPU memory of each worker role, in GB. The workers log ``perf/max_memory_*_gb``
#: (``workers/engine_workers.py`` ``_postprocess_output``); both trainers prefix them with the role
#: (``rename_dict(…, "actor/")`` / ``"critic/"`` in ``trainer/ppo/ray_trainer.py`` and
#: ``trainer/ppo/v1/trainer_base.py``), so no verl 0.9.1 trainer logs the bare name.
MEMORY_ROLES = ("actor", "critic")
MAX_MEMORY_ALLOCATED = tuple(f"{role}/perf/max_memory_allocated_gb" for role in MEMORY_ROLES)
MAX_MEMORY_RESERVED = tuple(f"{role}/perf/max_memory_reserved_gb" for role in MEMORY_ROLES)
#: The actor's gradient norm of a step, before clipping (the worker logs ``grad_norm``, the trainers
#: prefix the role: ``rename_dict(…, "actor/")``); 0 at every step: the update changed no weight.
GRAD_NORM = "actor/grad_norm"
#: The step's smallest and largest advantage (``compute_data_metrics``); both 0: nothing to learn from.
ADVANTAGES_MIN = "critic/advantages/min"
ADVANTAGES_MAX = "critic/advantages/max"
#: ``timing_s/<phase>``: seconds of each phase of a step (``marked_timer`` in verl's trainers).
TIMING_PREFIX = "timing_s/"
#: The whole step; every other ``timing_s/*`` is a part of it, except :data:`TIMING_OUTSIDE_STEP`.
TIMING_STEP = "timing_s/step"
#: Phases verl times apart from the step (``timing_s/<phase>`` beside ``timing_s/step``, not in it):
#: validation (``testing``, after the step's timer in ``trainer/ppo/ray_trainer.py`` and
#: ``trainer/ppo/v1/trainer_base.py``), the profiler's start and stop (``ray_trainer.py``), and the
#: rollout dump (after the step in the v1 trainer; inside it in the legacy one, so left out of the
#: step's shares either way).
TIMING_OUTSIDE_STEP = frozenset({"testing", "start_profile", "stop_profile", "dump_rollout_generations"})
#: Rollout (generation), the phase the scaling rules watch.
TIMING_GEN = "timing_s/gen"
#: The checkpoint save, in the steps that save (``trainer.save_freq``, and the last step).
TIMING_SAVE_CHECKPOINT = "timing_s/save_checkpoint"
#: ``val-core/<data_source>/<var>/<metric>``: the validation metrics verl calls core (mean@N of reward or acc).
VAL_CORE_PREFIX = "val-core/"
#: Every validation metric (``_validate`` in ``trainer/ppo/ray_trainer.py`` and ``v1/trainer_base.py``).
VAL_PREFIXES = (VAL_CORE_PREFIX, "val-aux/")


def is_validation_only(metrics: Mapping[str, float]) -> bool:
    """A row verl logged for validation alone, not a training step: ``val_before_train`` logs one at
    step 0, and a resumed run one at the step it resumed from, before its first step."""
    return bool(metrics) and all(k.startswith(VAL_PREFIXES) for k in metrics)

#: The critic (PPO with GAE): its value loss (``workers/utils/losses.py``, prefixed ``critic/`` by the
#: trainers), how much of the returns' variance its values explain and their mean (``compute_data_metrics``),
#: and the two phases of a step it costs: computing values for the batch and its own update.
CRITIC_VF_LOSS = "critic/vf_loss"
#: The reward the advantages were computed from (the score less a KL penalty where it is in the reward).
REWARDS = "critic/rewards/mean"
#: The actor's entropy over the batch's response tokens, and the KL terms verl logs: to the reference
#: as a loss (``use_kl_loss``) or as a penalty in the reward (``use_kl_in_reward``), and each update's own.
ENTROPY = "actor/entropy"
KL_LOSS = "actor/kl_loss"
REWARD_KL_PENALTY = "actor/reward_kl_penalty"
PPO_KL = "actor/ppo_kl"
CRITIC_EXPLAINED_VAR = "critic/vf_explained_var"
CRITIC_VALUES_MEAN = "critic/values/mean"
CRITIC_SERIES = (CRITIC_VF_LOSS, CRITIC_EXPLAINED_VAR, CRITIC_VALUES_MEAN)
TIMING_VALUES = "timing_s/values"
TIMING_UPDATE_CRITIC = "timing_s/update_critic"
CRITIC_TIMINGS = (TIMING_VALUES, TIMING_UPDATE_CRITIC)

#: The rollout against the actor (``calculate_debug_metrics`` in verl's ``utils/debug/metrics.py``, logged at
#: every step while ``actor_rollout_ref.rollout.calculate_log_probs`` is on, its default): the correlation of
#: the probabilities the rollout and the actor give the same sampled tokens, and their mean difference. A
#: rollout that generates with weights other than the actor's (a weight sync that did not happen, a resumed
#: rollout left on its dummy start-up weights) shows as a low correlation.
ROLLOUT_ACTOR_CORR = "training/rollout_actor_probs_pearson_corr"
ROLLOUT_PROBS_DIFF = "training/rollout_probs_diff_mean"
ROLLOUT_VS_ACTOR = (ROLLOUT_ACTOR_CORR, ROLLOUT_PROBS_DIFF)
