"""``python -m rlfoundry.recipe.entropy.main_entropy [key=value ...]``: verl's entropy recipe entry point
(``recipe.entropy.main_entropy``, arXiv:2505.22617).

verl's recipe runs the DAPO recipe's trainer with its config ``entropy_trainer``; the Clip-Cov and KL-Cov
losses it exists for are policy losses of the main trainer here (``actor.policy_loss.loss_mode=clip_cov``
/ ``kl_cov``, ``algos/core_algos.py``), so this module names the packaged ``entropy_trainer`` config and
runs it. ``--cfg job`` prints the config and exits.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="entropy_trainer")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
