"""Did the run learn? One verdict from verl's per-step metrics, in numbers and in a sentence (pure).

:func:`judge` compares the train reward of the first steps with that of the last steps, checks the
validation reward did not fall from the first validation (step 0 with ``trainer.val_before_train``)
to the last, and that the actor's entropy did not collapse; it also reports the KL to the reference
policy and, for PPO, the critic's explained variance. The ends of each metric are means of a few
steps (:data:`END_STEPS`), so one lucky or unlucky batch does not decide the verdict.

Besides the names of :mod:`verl_pipeline.trainer.metrics`, it reads these of verl 0.9.1:
``critic/rewards/mean`` (``compute_data_metrics`` in ``trainer/ppo/metric_utils.py``: the reward
function's score plus the KL penalty when ``algorithm.use_kl_in_reward``), ``actor/entropy`` (the
trainers' ``compute_log_prob``), ``actor/kl_loss`` (``workers/utils/losses.py`` with
``actor.use_kl_loss``, prefixed ``actor/`` by the trainers), ``actor/reward_kl_penalty``
(``apply_kl_penalty`` in ``trainer/ppo/ray_trainer.py``) and ``actor/ppo_kl`` (the policy losses of
``trainer/ppo/core_algos.py``: the KL between the rollout's policy and the updated one, not the
reference).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from typing import Protocol

from verl_pipeline.trainer import metrics as m

#: The train reward: the reward function's score, else the reward the advantages were computed from.
TRAIN_REWARD_NAMES = (m.SCORE, m.REWARDS)
ENTROPY = m.ENTROPY
PPO_KL = m.PPO_KL
#: The KL to the reference policy (a loss term, or a penalty in the reward), else the update's own KL.
KL_NAMES = (m.KL_LOSS, m.REWARD_KL_PENALTY, m.PPO_KL)
#: ``val-core/<data_source>/<reward|acc>/mean@<n>``: verl's core validation score of each data source
#: (``_val_metrics_update``: ``acc`` where the reward function returns one, else ``reward``).
VALIDATION_MEAN = re.compile(rf"^{re.escape(m.VAL_CORE_PREFIX)}.+/(reward|acc)/mean@\d+$")

#: Steps averaged at each end of a metric (the first k and the last k); a shorter run averages half
#: its steps at each end, so the two ends never share a step.
END_STEPS = 3
#: Fewer training steps with a reward than this: too few to tell a trend from batch-to-batch noise.
MIN_STEPS = 4
#: The rise of the train reward (last steps' mean minus the first steps'), on the reward's own scale,
#: that counts as learning. Rule rewards (GSM8K's) are 0 or 1 per response, so a step's mean over a
#: batch of 256 responses varies by about 0.03 from batch to batch at p = 0.5 (sqrt(p(1-p)/n)), and a
#: mean of 3 steps by about 0.02: a rise of 0.05 is more than twice what noise alone gives.
REWARD_RISE_MARGIN = 0.05
#: The last steps' entropy under this share of the first steps': the policy stopped exploring (it
#: puts nearly all its probability on one continuation), and a reward that rose with it is a
#: collapse onto one answer form rather than learning to answer.
ENTROPY_COLLAPSE_RATIO = 0.1


class StepRow(Protocol):
    """What is read of a report row (:class:`verl_pipeline.report.build.StepRow`, which builds on this module)."""

    @property
    def step(self) -> int: ...

    @property
    def metrics(self) -> Mapping[str, float]: ...


class Reason(str, Enum):
    """Why the run did not learn, or why it could not be judged."""

    NO_REWARD = "no_reward"
    TOO_FEW_STEPS = "too_few_steps"
    REWARD_ALL_ZERO = "reward_all_zero"
    RISE_UNDER_MARGIN = "rise_under_margin"
    VALIDATION_FELL = "validation_fell"
    ENTROPY_COLLAPSED = "entropy_collapsed"


@dataclass(frozen=True)
class LearningVerdict:
    """Whether the run learned (None: not judged), the numbers it was judged on, and the sentence."""

    learned: bool | None
    words: str
    #: Why it did not learn (each failed criterion), or why it was not judged; empty when it learned.
    reasons: tuple[Reason, ...] = ()
    #: The train reward's metric name, and the training steps that logged it.
    reward_metric: str | None = None
    steps: int = 0
    #: Steps averaged at each end (:data:`END_STEPS`, fewer for a short run).
    end_steps: int = 0
    reward_first: float | None = None
    reward_last: float | None = None
    reward_rise: float | None = None
    #: Least-squares slope of the train reward over the steps, per step.
    reward_slope_per_step: float | None = None
    margin: float = REWARD_RISE_MARGIN
    #: The ``val-core/…/mean@n`` metrics averaged (unweighted, over data sources) into the validation reward.
    validation_metrics: tuple[str, ...] = ()
    validation_first: float | None = None
    validation_first_step: int | None = None
    validation_last: float | None = None
    validation_last_step: int | None = None
    kl_metric: str | None = None
    kl_first: float | None = None
    kl_last: float | None = None
    entropy_first: float | None = None
    entropy_last: float | None = None
    #: PPO's critic (``critic/vf_explained_var``); None: the run had no critic.
    explained_var_first: float | None = None
    explained_var_last: float | None = None


def _points(rows: Sequence[StepRow], name: str) -> list[tuple[int, float]]:
    """``name`` by step over the rows that report it (NaN, which verl logs for a step without valid
    tokens, skipped)."""
    return [(r.step, r.metrics[name]) for r in rows if name in r.metrics and not math.isnan(r.metrics[name])]


def _k(n: int) -> int:
    return max(1, min(END_STEPS, n // 2))


def _ends(points: list[tuple[int, float]]) -> tuple[float | None, float | None]:
    """The mean of the first k values and of the last k (None, None for no value)."""
    if not points:
        return None, None
    k = _k(len(points))
    return statistics.fmean(v for _, v in points[:k]), statistics.fmean(v for _, v in points[-k:])


def _slope(points: list[tuple[int, float]]) -> float | None:
    if len(points) < 2:
        return None
    mean_x = statistics.fmean(s for s, _ in points)
    mean_y = statistics.fmean(v for _, v in points)
    sxx = sum((s - mean_x) ** 2 for s, _ in points)
    return sum((s - mean_x) * (v - mean_y) for s, v in points) / sxx if sxx else None


@dataclass(frozen=True)
class _Validation:
    names: tuple[str, ...] = ()
    first: float | None = None
    first_step: int | None = None
    last: float | None = None
    last_step: int | None = None


def _validation(rows: Sequence[StepRow]) -> _Validation:
    """verl's core validation means, averaged over data sources, at the first step and the last that validated."""
    names = tuple(sorted({k for r in rows for k in r.metrics if VALIDATION_MEAN.match(k)}))
    points = []
    for r in rows:
        values = [r.metrics[k] for k in names if k in r.metrics and not math.isnan(r.metrics[k])]
        if values:
            points.append((r.step, statistics.fmean(values)))
    if not points:
        return _Validation(names)
    return _Validation(names, points[0][1], points[0][0], points[-1][1], points[-1][0])


def _f(value: float | None, sign: str = "") -> str:
    """Two decimals, and two significant digits below 0.1 (a KL of 0.012 is not 0.01)."""
    if value is None:
        return "—"
    return f"{value:{sign}.2g}" if 0 < abs(value) < 0.1 else f"{value:{sign}.2f}"


def _arrow(first: float | None, last: float | None) -> str:
    return f"{_f(first)} -> {_f(last)}"


def judge(rows: Sequence[StepRow]) -> LearningVerdict:
    """The learning verdict of a run's merged rows (one per step, training and validation-only rows).

    Learned: at least :data:`MIN_STEPS` training steps logged a train reward, not every one of them
    0, its last steps' mean rose at least :data:`REWARD_RISE_MARGIN` over its first steps', the last
    validation is not below the first (where the run validated twice or more) and the entropy did not
    fall under :data:`ENTROPY_COLLAPSE_RATIO` of its start (where verl logged it).
    """
    training = [r for r in rows if not m.is_validation_only(r.metrics)]
    metric = next((n for n in TRAIN_REWARD_NAMES if _points(training, n)), None)
    reward = _points(training, metric) if metric else []
    val = _validation(rows)
    verdict = LearningVerdict(None, "", reward_metric=metric, steps=len(reward), validation_metrics=val.names,
                              validation_first=val.first, validation_first_step=val.first_step,
                              validation_last=val.last, validation_last_step=val.last_step)
    if metric is None:
        return replace(verdict, reasons=(Reason.NO_REWARD,), words=(
            f"Learning not judged: verl logged no train reward ({' or '.join(TRAIN_REWARD_NAMES)}) at any "
            "training step."))
    if len(reward) < MIN_STEPS:
        return replace(verdict, reasons=(Reason.TOO_FEW_STEPS,), words=(
            f"Learning not judged: {len(reward)} training step(s) logged a train reward ({metric}), fewer than "
            f"the {MIN_STEPS} needed to compare the first steps with the last."))
    first, last = _ends(reward)
    kl_metric = next((n for n in KL_NAMES if _points(training, n)), None)
    kl_first, kl_last = _ends(_points(training, kl_metric)) if kl_metric else (None, None)
    ent_first, ent_last = _ends(_points(training, ENTROPY))
    ev_first, ev_last = _ends(_points(training, m.CRITIC_EXPLAINED_VAR))
    verdict = replace(
        verdict, end_steps=_k(len(reward)), reward_first=first, reward_last=last,
        reward_rise=None if first is None or last is None else last - first, reward_slope_per_step=_slope(reward),
        kl_metric=kl_metric, kl_first=kl_first, kl_last=kl_last, entropy_first=ent_first, entropy_last=ent_last,
        explained_var_first=ev_first, explained_var_last=ev_last)
    return _with_words(verdict, _failed(verdict, all_zero=all(v == 0 for _, v in reward)))


def _failed(v: LearningVerdict, *, all_zero: bool) -> tuple[Reason, ...]:
    reasons = []
    if all_zero:
        reasons.append(Reason.REWARD_ALL_ZERO)
    elif v.reward_rise is not None and v.reward_rise < REWARD_RISE_MARGIN:
        reasons.append(Reason.RISE_UNDER_MARGIN)
    # Validation decodes greedily (verl's val_kwargs.do_sample=false) on the same prompts each time, so
    # any fall is a fall on that set, not sampling noise.
    if (v.validation_first is not None and v.validation_last is not None
            and v.validation_last_step != v.validation_first_step and v.validation_last < v.validation_first):
        reasons.append(Reason.VALIDATION_FELL)
    if (v.entropy_first is not None and v.entropy_last is not None and v.entropy_first > 0
            and v.entropy_last < ENTROPY_COLLAPSE_RATIO * v.entropy_first):
        reasons.append(Reason.ENTROPY_COLLAPSED)
    return tuple(reasons)


def _with_words(v: LearningVerdict, reasons: tuple[Reason, ...]) -> LearningVerdict:
    slope = "" if v.reward_slope_per_step is None else f", slope {v.reward_slope_per_step:+.2g}/step"
    reward = (f"train reward ({v.reward_metric}, mean of the first and last {v.end_steps} steps) "
              f"{_arrow(v.reward_first, v.reward_last)} over {v.steps} steps ({_f(v.reward_rise, '+')}{slope})")
    if v.validation_first_step is not None and v.validation_first_step != v.validation_last_step:
        reward += (f", validation {_arrow(v.validation_first, v.validation_last)} (step {v.validation_first_step} "
                   f"-> {v.validation_last_step})")
    elif v.validation_first_step is not None:
        reward += f", validation {_f(v.validation_first)} (once, at step {v.validation_first_step})"
    else:
        reward += ", no validation logged"
    extra = []
    if v.kl_metric is not None:
        kind = "KL to the reference" if v.kl_metric != PPO_KL else "KL of each update to the rollout's policy"
        extra.append(f"{kind} ({v.kl_metric}) {_arrow(v.kl_first, v.kl_last)}")
    if v.entropy_first is not None and Reason.ENTROPY_COLLAPSED not in reasons:  # else said in the reasons
        extra.append(f"entropy {_arrow(v.entropy_first, v.entropy_last)}")
    if v.explained_var_first is not None:
        extra.append(f"critic's explained variance {_arrow(v.explained_var_first, v.explained_var_last)}")
    tail = "; " + ", ".join(extra) if extra else ""
    if not reasons:
        return replace(v, learned=True, words=f"The run learned: {reward}{tail}.")
    why = "; ".join(_reason_words(v, r) for r in reasons)
    return replace(v, learned=False, reasons=reasons,
                   words=f"The run did not learn: {why}. {reward[0].upper()}{reward[1:]}{tail}.")


def _reason_words(v: LearningVerdict, reason: Reason) -> str:
    if reason is Reason.REWARD_ALL_ZERO:
        return (f"the train reward was 0 at every one of its {v.steps} steps (the reward function never rewarded "
                "an answer: check its answer format against what the model writes)")
    if reason is Reason.RISE_UNDER_MARGIN:
        return (f"the train reward changed {_f(v.reward_rise, '+')}, under the {_f(REWARD_RISE_MARGIN, '+')} rise "
                "that counts as learning")
    if reason is Reason.VALIDATION_FELL:
        return f"validation fell {_arrow(v.validation_first, v.validation_last)}"
    return (f"entropy collapsed {_arrow(v.entropy_first, v.entropy_last)} (under {ENTROPY_COLLAPSE_RATIO:.0%} "
            "of its start: the policy stopped exploring)")
