"""``python -m rlfoundry.recipe.spin.main_spin [key=value ...]``: verl's SPIN recipe entry point
(``recipe.spin.main_spin``, Self-Play fIne-tuNing as online DPO, arXiv:2401.01335).

verl's recipe forks the trainer (pairs two samples per prompt by their reward, refreshes the reference from
the actor every ``trainer.ref_update_freq`` steps) and the actor (a DPO step on the pairs). Here the pairing
is the estimator and the DPO loss the policy loss ``spin`` of the main trainer (``algos/spin.py``), the
refresh a phase of its reference pass, on the FSDP engine. This module runs the packaged ``spin_trainer``
config and sets both halves under the user's overrides whatever the config file: verl's recipe runs SPIN
whatever its file's ``algorithm.adv_estimator`` (null in its YAML). ``--cfg job`` prints the config and exits.
"""

import sys
from collections.abc import Sequence

from rlfoundry.trainer.main_ppo import Entry, main

SPIN_HALVES = ("algorithm.adv_estimator=spin", "actor_rollout_ref.actor.policy_loss.loss_mode=spin")


def spin_overrides(overrides: Sequence[str]) -> list[str]:
    """Both SPIN halves, then the user's overrides (one naming another estimator or loss is then a start-up
    error: verl's recipe would ignore it)."""
    return [*SPIN_HALVES, *overrides]


ENTRY = Entry(config_name="spin_trainer", spell=spin_overrides)

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
