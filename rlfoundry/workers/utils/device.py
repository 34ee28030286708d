"""Moving a driver's batch onto a worker's device without touching the driver's object."""

from __future__ import annotations

import torch

from rlfoundry.protocol import DataProto

__all__ = ["on_device"]


def on_device(data: DataProto, device: torch.device) -> DataProto:
    """A shallow copy of ``data`` on ``device`` with its own meta_info.

    ``DataProto.to`` moves in place, and with the in-process back end ``data`` is the driver's own
    object: a worker must neither move nor annotate it.
    """
    batch = data.batch.to(device) if data.batch is not None else None
    return DataProto(batch=batch, non_tensor_batch=dict(data.non_tensor_batch), meta_info=dict(data.meta_info))
