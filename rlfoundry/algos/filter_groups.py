"""DAPO's dynamic sampling (Yu et al. 2025; verl's ``algorithm.filter_groups``), as pure functions.

A group — the n samples of one prompt, one ``uid`` — whose ``metric`` is the same for every sample
gives every sample the same advantage under a group baseline (GRPO: zero), so it only dilutes the
batch. Such groups are dropped and the trainer generates further batches until it holds
``data.train_batch_size`` informative groups. A group of one sample is kept (nothing to compare).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import numpy as np

__all__ = ["first_groups", "informative_rows"]


def informative_rows(uids: Sequence, values: Sequence[float]) -> np.ndarray:
    """Per row: does its group's metric vary (or is the group a single sample)?"""
    by_group: dict = defaultdict(list)
    for uid, value in zip(uids, values):
        by_group[uid].append(float(value))
    keep = {uid: len(v) == 1 or float(np.std(v)) > 0 for uid, v in by_group.items()}
    return np.array([keep[uid] for uid in uids], dtype=bool)


def first_groups(uids: Sequence, count: int) -> np.ndarray:
    """Per row: does it belong to one of the first ``count`` groups, in order of first appearance?"""
    chosen = set(list(dict.fromkeys(uids))[:count])  # dict keys keep first-appearance order
    return np.array([uid in chosen for uid in uids], dtype=bool)
