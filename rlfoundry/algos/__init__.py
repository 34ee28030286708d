"""rlfoundry.algos: the algorithm math (advantage estimators, losses, KL control) as pure tensor functions.

Also importable under verl's path, ``rlfoundry.trainer.ppo.core_algos``.
"""

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401
# the recipes' algorithms register themselves wherever the algorithms load (also under plain main_ppo):
# adv_estimator / loss_mode "sppo", loss_mode "flowrl"
from rlfoundry.algos import flowrl, sppo  # noqa: E402,F401
