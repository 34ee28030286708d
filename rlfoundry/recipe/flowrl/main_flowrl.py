"""``python -m rlfoundry.recipe.flowrl.main_flowrl [key=value ...]``: verl's FlowRL recipe entry point
(``recipe.flowrl.main_flowrl``, arXiv:2509.15207).

verl's recipe swaps in its own FSDP worker and actor (a log Z head on the policy, FlowRL's loss) over the main
trainer; here both are the main trainer's (``actor.policy_loss.loss_mode=flowrl``: ``algos/flowrl.py``,
``workers/flowrl_head.py``), so this module names the packaged ``flowrl_trainer`` config, which turns them
on, and runs it. ``--cfg job`` prints the config and exits.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="flowrl_trainer")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
