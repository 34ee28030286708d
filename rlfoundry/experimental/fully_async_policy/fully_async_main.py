"""``python -m rlfoundry.experimental.fully_async_policy.fully_async_main [--config-name NAME] [key=value ...]``:
verl's fully asynchronous entry point (``verl.experimental.fully_async_policy.fully_async_main``).

The default config is ``fully_async_ppo_trainer`` (also ``fully_async_ppo_megatron_trainer``,
``fully_async_dapo_trainer``); whatever config is named, the pipeline is fully asynchronous
(``async_training.mode=fully_async``, ``trainer/ppo/fully_async.py``). verl's keys for it:
``rollout.nnodes`` / ``n_gpus_per_node`` / ``total_rollout_steps``, ``async_training.*``, and the two
spellings of the rollouter's epochs and validation period: January's ``rollout.total_epochs`` /
``rollout.test_freq``, August's ``trainer.total_epochs`` / ``trainer.test_freq``. Under this module,
as in verl's, a validation period counts weight syncs (``trainer.test_freq=N``: every N syncs, that
is N × ``trigger_parameter_sync_step`` training steps). ``--cfg job`` prints the config and exits.
See docs/async.md.
"""

import sys
from collections.abc import Sequence

from rlfoundry.trainer.main_ppo import Entry, main

def verl_spellings(argv: Sequence[str]) -> list[str]:
    """verl's August fully-async main reads ``trainer.test_freq`` in weight syncs, the meaning of
    January's ``rollout.test_freq``: spell it that way (the loader converts syncs to steps)."""
    out = []
    for arg in argv:
        key, sep, value = arg.partition("=")
        out.append(f"rollout.test_freq={value}" if sep and key.lstrip("+") == "trainer.test_freq" else arg)
    return out


ENTRY = Entry(config_name="fully_async_ppo_trainer", mode="fully_async", spell=verl_spellings)

if __name__ == "__main__":
    sys.exit(main(entry=ENTRY))
