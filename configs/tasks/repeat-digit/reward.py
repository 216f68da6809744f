"""The reward of the example task ``repeat-digit`` (``builtin:repeat-digit`` data, profile ``repeat-digit``).

Each prompt is ``Repeat: 7``; the ground truth is the digit. A response scores the share of its
characters (spaces aside) that are that digit: ``7`` and ``7 7 7`` score 1.0, ``7 or 3`` 0.25, no
character 0.0. Partial answers score between, so the answers a random model gives to one prompt differ
in reward, and GRPO's group comparison has a signal from the first step. verl's reward managers call it
with keyword arguments, as any custom reward function (``reward.custom_reward_function.path``).
"""

from __future__ import annotations


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    digit = str(ground_truth).strip()
    chars = [c for c in solution_str if not c.isspace()]
    if not chars:
        return 0.0
    return sum(c == digit for c in chars) / len(chars)
