"""The interfaces of a user's sampler (``data.sampler.{class_path,class_name}``), verl's
``verl.experimental.dataset.sampler`` under rlfoundry's name (verl's import of it resolves here).

The loader builds it as ``cls(data_source=dataset, data_config=config.data)``. A sampler that also
has ``state_dict()`` / ``load_state_dict()`` is saved in every checkpoint with the loader's position
(torchdata's stateful loader stores it), so a resumed run draws what the uninterrupted run would
have; it must then restore its own position in the epoch. A curriculum sampler's ``update(batch)``
is called after every training step with the batch the step trained on (scores, advantages ...).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sized
from typing import Any

from torch.utils.data import Sampler

__all__ = ["AbstractCurriculumSampler", "AbstractSampler"]


class AbstractSampler(Sampler[int]):
    """A sampler the data config names: constructed with the data set and the ``data`` config."""

    @abstractmethod
    def __init__(self, data_source: Sized, data_config: Any) -> None:
        pass


class AbstractCurriculumSampler(AbstractSampler):
    """A sampler that learns from training: ``update`` gets each step's finished batch (a DataProto)."""

    @abstractmethod
    def update(self, batch: Any) -> None:
        pass
