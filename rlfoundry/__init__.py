"""rlfoundry: reinforcement-learning post-training for language models (verl-compatible)."""

from rlfoundry.utils import verl_imports as _verl_imports

__version__ = "0.1.0"

# User code written against verl (``from verl.utils.reward_score import gsm8k``) imports rlfoundry's
# modules when verl is not installed; see rlfoundry/utils/verl_imports.py for why at start-up.
_verl_imports.install()
