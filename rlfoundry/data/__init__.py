"""Prompt data: verl-format parquet data sets, the resumable loader, and preprocessing scripts.

Names are imported on first use, so ``python -m rlfoundry.data.preprocess`` does not load torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DataError", "RLHFDataset", "build_dataloader", "collate_fn", "create_rl_dataset", "create_rl_sampler",
           "get_dataset_class"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from rlfoundry.data import rl_dataset

        return getattr(rl_dataset, name)
    raise AttributeError(f"module 'rlfoundry.data' has no attribute {name!r}")
