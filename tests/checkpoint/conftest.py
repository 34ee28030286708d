"""Fixtures of the checkpoint tests."""

from __future__ import annotations

import socket

import pytest
import torch.distributed as dist



@pytest.fixture(scope="module")
def process_group():
    """A one-rank gloo group (FSDP2 needs one). Left up: later in-process worker groups reuse it."""
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
