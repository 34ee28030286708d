"""``torchrun ... -m rlfoundry.trainer.fsdp_sft_trainer [key=value ...]``: verl's older SFT module name
(``verl.trainer.fsdp_sft_trainer``); the same trainer as ``rlfoundry.trainer.sft_trainer``, verl's newer
name, with the same keys and ``--cfg job``."""

import sys

from rlfoundry.trainer.sft_trainer import main

if __name__ == "__main__":
    sys.exit(main())
