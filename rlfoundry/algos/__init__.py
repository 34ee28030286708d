"""rlfoundry.algos: the algorithm math (advantage estimators, losses, KL control) as pure tensor functions.

Also importable under verl's path, ``rlfoundry.trainer.ppo.core_algos``.
"""

import importlib

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401

# algorithms in their own modules register under the registries above wherever the algorithms load (plain
# main_ppo too): SPPO's estimator and loss (sppo), FlowRL's loss (flowrl), GVPO's loss (gvpo), SPIN's pairing
# and DPO loss (spin), SPO's estimator (spo)
for _name in ("flowrl", "gvpo", "spin", "spo", "sppo"):
    importlib.import_module(f"rlfoundry.algos.{_name}")
