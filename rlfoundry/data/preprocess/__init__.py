"""Preprocessing scripts: public data sets and synthetic tasks -> verl-format parquet.

    python -m rlfoundry.data.preprocess gsm8k      --input DIR_OR_FILE --output DIR
    python -m rlfoundry.data.preprocess math       --input DIR_OR_FILE --output DIR [--data-source NAME]
    python -m rlfoundry.data.preprocess arithmetic --output DIR [--seed 0 --digits 2 --ops +- ...]
    python -m rlfoundry.data.preprocess shapes     --output DIR [--train-size 2000 --size 32]   (image rows)
    python -m rlfoundry.data.preprocess geo3k      --input DIR_OR_FILE --output DIR   (image rows)
    python -m rlfoundry.data.preprocess codecontests --input DIR_OR_FILE --output DIR [--tests public+private]

Each task module has ``add_arguments(parser)`` and ``run(args) -> {split: parquet path}``.
"""

TASKS = ("gsm8k", "math", "arithmetic", "shapes", "geo3k", "codecontests")
