"""Rule-based rewards: scorers per data set, custom reward files, and reward managers.

The scorer modules import nothing heavy, so reward pool worker processes (which unpickle a scorer)
start fast; the reward managers (torch, DataProto) are imported on first use.
"""

from __future__ import annotations

from typing import Any

from rlfoundry.rewards.custom import FileRewardFunction, RewardFunctionError, load_custom_reward_fn
from rlfoundry.rewards.default import SCORERS, UnknownDataSourceError, default_compute_score

_MANAGER_NAMES = {
    "BatchRewardManager",
    "DAPORewardManager",
    "NaiveRewardManager",
    "RuleRewardManager",
    "get_reward_manager_cls",
    "load_reward_manager",
    "register_reward_manager",
}

__all__ = [
    "SCORERS",
    "FileRewardFunction",
    "RewardFunctionError",
    "UnknownDataSourceError",
    "default_compute_score",
    "load_custom_reward_fn",
    *sorted(_MANAGER_NAMES),
]


def __getattr__(name: str) -> Any:
    if name in _MANAGER_NAMES:
        from rlfoundry.rewards import reward_manager

        return getattr(reward_manager, name)
    raise AttributeError(f"module 'rlfoundry.rewards' has no attribute {name!r}")
