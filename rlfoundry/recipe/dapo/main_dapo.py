"""``python -m rlfoundry.recipe.dapo.main_dapo [--config-name NAME] [key=value ...]``: verl's DAPO recipe
entry point (``recipe.dapo.main_dapo``).

verl's recipe runs its own trainer class over the main one with the recipe's config,
``dapo_trainer`` (``--config-name dapo_megatron_trainer`` for the Megatron engine). Both are packaged
here (``rlfoundry/config``), and what the recipe's trainer adds — dynamic sampling
(``algorithm.filter_groups``), the DAPO reward manager with its overlong penalty — is the main trainer's
(docs/rewards.md, ``trainer/ppo/ray_trainer.py``), so this module names the config and runs it.
``--cfg job`` prints the config and exits.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="dapo_trainer")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
