"""rlfoundry.algos: the algorithm math (advantage estimators, losses, KL control) as pure tensor functions.

Also importable under verl's path, ``rlfoundry.trainer.ppo.core_algos``.
"""

from rlfoundry.algos.core_algos import *  # noqa: F403
from rlfoundry.algos.core_algos import __all__  # noqa: F401
from rlfoundry.algos import sppo  # noqa: E402,F401  registers adv_estimator / policy loss "sppo" wherever algos loads
