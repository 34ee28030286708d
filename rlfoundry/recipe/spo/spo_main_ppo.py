"""``python -m rlfoundry.recipe.spo.spo_main_ppo [key=value ...]``: verl's SPO recipe entry point
(``recipe.spo.spo_main_ppo``, Single-stream Policy Optimization, arXiv:2509.13232).

verl's recipe forks the trainer to replace the group baseline by a per-prompt Beta tracker and to draw
prompts by priority. Here the math is ``algos/spo.py`` (the ``spo`` advantage estimator among others),
the tracker and the prioritised draw are ``trainer/ppo/spo.py``, switched on by ``trainer.spo.enable`` in
the main trainer; this module names the packaged ``spo_trainer`` config and runs it. ``--cfg job`` prints
the config and exits.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="spo_trainer")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
