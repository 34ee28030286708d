"""Scorer of ``hiyouga/geometry3k`` (verl's ``reward_score/geo3k.py`` rule): 0.9 for the right
``\\boxed{}`` answer (mathematically equal, ``rewards/math.py``) plus 0.1 for the format
``<think>...</think> ... \\boxed{...}``."""

from __future__ import annotations

import re

from rlfoundry.rewards import math as math_scorer

_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def format_reward(solution_str: str) -> float:
    return 1.0 if _FORMAT.fullmatch(solution_str.strip()) else 0.0


def acc_reward(solution_str: str, ground_truth: str) -> float:
    if math_scorer.last_boxed_only_string(solution_str) is None:
        return 0.0
    return math_scorer.compute_score(solution_str, ground_truth)


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.1) -> float:
    return (1.0 - format_score) * acc_reward(solution_str, ground_truth) + format_score * format_reward(solution_str)
