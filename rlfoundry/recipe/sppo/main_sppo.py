"""``python -m rlfoundry.recipe.sppo.main_sppo [key=value ...]``: verl's SPPO recipe entry point
(``recipe.sppo.main_sppo``, arXiv:2405.00675).

verl's recipe runs its own trainer (rewards centred by a soft mean over the batch) and actor (the squared
sequence log-ratio regression) with its config ``sppo_trainer``. Both halves are the main trainer's here:
the advantage estimator and policy loss ``sppo`` (``algos/sppo.py``), on any training engine. This module
runs the packaged ``sppo_trainer`` config, and sets both halves under the user's overrides whatever the
config file: verl's recipe trainer runs SPPO whatever its file's ``algorithm.adv_estimator`` (its own YAML
has null, which here would mean GRPO). ``--cfg job`` prints the config and exits.
"""

import sys
from collections.abc import Sequence

from rlfoundry.trainer.main_ppo import Entry, main

SPPO_HALVES = ("algorithm.adv_estimator=sppo", "actor_rollout_ref.actor.policy_loss.loss_mode=sppo")


def sppo_overrides(overrides: Sequence[str]) -> list[str]:
    """Both SPPO halves, then the user's overrides (one of which naming another estimator or loss is then a
    start-up error: verl's recipe would ignore it)."""
    return [*SPPO_HALVES, *overrides]


ENTRY = Entry(config_name="sppo_trainer", spell=sppo_overrides)

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
