"""rlfoundry.algos: the algorithm math (advantage estimators, losses, KL control) as pure tensor functions.

Also importable under verl's path, ``rlfoundry.trainer.ppo.core_algos``.
"""

import importlib

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401

# algorithms in their own modules that register under the registries above, wherever the algorithms load
# (plain main_ppo too): GVPO's policy loss (loss_mode=gvpo)
importlib.import_module("rlfoundry.algos.gvpo")
