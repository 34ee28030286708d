"""``python -m rlfoundry.recipe.gvpo.gvpo_main_ppo [key=value ...]``: verl's GVPO recipe entry point
(``recipe.gvpo.gvpo_main_ppo``, Group Variance Policy Optimization, arXiv:2504.19599).

verl's recipe forks the trainer, the FSDP workers and the actor to add one loss and keep each prompt's
samples together. Here the loss is a policy loss of the main trainer (``actor.policy_loss.loss_mode=gvpo``
with ``actor.gvpo_beta``, ``algos/gvpo.py``), and the trainer and actor keep the groups whole when that
loss is chosen (``ray_trainer.order_groups``, ``config/gvpo.py``), so this module names the packaged
``gvpo_trainer`` config and runs it. ``--cfg job`` prints the config and exits.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="gvpo_trainer")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
