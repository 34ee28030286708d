"""Temporary: moved to ``rlfoundry.engines.fsdp.utils`` (removed once the rollouts import it there)."""
from rlfoundry.engines.fsdp.utils import *  # noqa: F401,F403
from rlfoundry.engines.fsdp.utils import cfg_get, inference_unsharded, unsharded  # noqa: F401
