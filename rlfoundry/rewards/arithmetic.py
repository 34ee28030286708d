"""Scorer of the built-in ``rlfoundry/arithmetic`` task: the response must be exactly the number.

The demo policy is trained to answer ``37+48=`` with ``85`` then EOS, so verification is an exact
integer match of the whole (stripped) response: cheap, and impossible to game with extra text.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?\d+")


def compute_score(solution_str: str, ground_truth: str, format_score: float = 0.0, score: float = 1.0) -> float:
    """``score`` for the right integer, ``format_score`` for a wrong integer, 0.0 for anything else."""
    text = solution_str.strip()
    if not _INTEGER.fullmatch(text):
        return 0.0
    return score if int(text) == int(str(ground_truth).strip()) else format_score
