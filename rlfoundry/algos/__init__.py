"""rlfoundry.algos: the algorithm math (advantage estimators, losses, KL control) as pure tensor functions.

Also importable under verl's path, ``rlfoundry.trainer.ppo.core_algos``.
"""

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401
# registers policy_loss.loss_mode=flowrl wherever the algorithms load (also under plain main_ppo)
from rlfoundry.algos.flowrl import compute_policy_loss_flowrl

__all__ = [*__all__, "compute_policy_loss_flowrl"]
