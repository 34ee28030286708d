"""Tests of rlfoundry.checkpoint. Shared builders: a tiny FSDP2 policy with its optimiser and schedule,
a linear model with optimiser state, and the file a test damages."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from rlfoundry.config.schema import OptimConfig
from rlfoundry.engines.fsdp import utils as fsdp_utils
from rlfoundry.models.hf import load_hf_model


def _fsdp_policy(model_dir: Path):
    model = load_hf_model(model_dir, "causal_lm")
    fsdp_utils.apply_fsdp2(model, "cpu")
    optim = fsdp_utils.build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=0.1))
    sched = fsdp_utils.build_lr_scheduler(optim, OptimConfig(lr_warmup_steps=4, warmup_style="cosine"),
                                          total_training_steps=20)
    return model, optim, sched


def _train_step(model, optim, sched, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (2, 10), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()


def _logits(model: nn.Module) -> torch.Tensor:
    ids = torch.arange(5, 25).view(2, 10)
    with torch.no_grad():
        return model(input_ids=ids).logits


def _linear(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Linear(4, 3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 4)).sum().backward()
    optim.step()
    return model, optim


def _shard(path: Path) -> Path:
    return next((path / "dcp").glob("*.distcp"))


def _flip_byte(file: Path, offset: int = -5) -> None:
    raw = bytearray(file.read_bytes())
    raw[offset] ^= 0xFF
    file.write_bytes(bytes(raw))
