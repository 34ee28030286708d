"""How a role's ranks split the data: every rank is a data-parallel rank under FSDP; under Megatron
the ranks of one model-parallel group (tensor × pipeline) compute on the same rows."""

from __future__ import annotations

from typing import Any

from rlfoundry.config.schema import model_parallel_size
from rlfoundry.protocol import DataProto

__all__ = ["data_parallel_size", "pooled_rows"]


def data_parallel_size(world_size: int, strategy: str, megatron: Any) -> int:
    """Data-parallel ranks of a role: all of them, or under Megatron the world over its tensor ×
    pipeline × context layout (``megatron``: the role's ``megatron`` subtree)."""
    return world_size if strategy != "megatron" else world_size // model_parallel_size(megatron)


def pooled_rows(engine: Any, data: DataProto) -> tuple[DataProto, slice]:
    """The rows ``engine`` computes on and this rank's part of them: the rank's own rows, or under
    Megatron the rows of its whole model-parallel group (``MegatronEngine.model_parallel_rows``)."""
    pool = getattr(engine, "model_parallel_rows", None)
    return pool(data) if pool is not None else (data, slice(0, len(data)))
