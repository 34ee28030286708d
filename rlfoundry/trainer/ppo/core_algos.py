"""verl-compatible import path: ``from rlfoundry.trainer.ppo.core_algos import compute_grpo_outcome_advantage``.

Everything lives in :mod:`rlfoundry.algos.core_algos`; this module re-exports it (same objects, same
registries), so a plug-in registered through either path is visible through both.
"""

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401
