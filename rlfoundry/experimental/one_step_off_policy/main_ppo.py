"""``python -m rlfoundry.experimental.one_step_off_policy.main_ppo [--config-name NAME] [key=value ...]``:
verl's one-step-off-policy entry point (``verl.experimental.one_step_off_policy.main_ppo``).

The default config is ``one_step_off_ppo_trainer`` (``--config-name one_step_off_ppo_megatron_trainer``
for the Megatron engine); whatever config is named, the pipeline is one-step-off
(``async_training.mode=one_step_off``, ``trainer/ppo/one_step_off.py``). verl's keys for it are the
main trainer's plus the rollout's own pool, ``rollout.nnodes`` / ``rollout.n_gpus_per_node``.
``--cfg job`` prints the config and exits. See docs/async.md.
"""

import sys

from rlfoundry.trainer.main_ppo import Entry, main

ENTRY = Entry(config_name="one_step_off_ppo_trainer", mode="one_step_off")

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
