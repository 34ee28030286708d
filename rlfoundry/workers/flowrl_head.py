"""FlowRL's log-partition head on the actor's model (``policy_loss.loss_mode=flowrl``, ``algos/flowrl.py``).

The head is a submodule of the policy, ``proj_z`` (verl's name), added before the model is sharded: it is
trained by the actor's optimiser, sharded and checkpointed with the policy (so a resumed run restores it),
and listed as trainer-only (``TRAINER_ONLY_ATTR``), so weight syncs to the rollout engine leave it out.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from rlfoundry.algos.flowrl import ProjZHead, prompt_mean_hidden
from rlfoundry.config.typed import ConfigError
from rlfoundry.engines.fsdp.utils import compute_precision
from rlfoundry.models.hf import TRAINER_ONLY_ATTR
from rlfoundry.models.vision import is_vision_language

__all__ = ["HEAD", "add_log_z_head", "prompt_log_z"]

HEAD = "proj_z"
_HEAD_SEED = 0  # the head's initial weights: the same on every rank (each keeps its shard of one tensor)


def add_log_z_head(num_layers: int) -> Any:
    """The engine's ``prepare`` hook: attach a fresh ``ProjZHead`` of ``num_layers`` layers (``actor.proj_layer``)."""

    def prepare(module: nn.Module) -> None:
        if is_vision_language(module.config):  # image rows' prompts (pixels, 3-D positions): not what it reads
            raise ConfigError("actor_rollout_ref.actor.policy_loss.loss_mode=flowrl with a vision-language model is "
                              "not built (the log Z head reads text prompts); use a text model or another loss_mode.")
        dtype = next(module.parameters()).dtype
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_HEAD_SEED)
            head = ProjZHead(module.config.hidden_size, num_layers)
        module.add_module(HEAD, head.to(dtype))
        setattr(module, TRAINER_ONLY_ATTR, (*getattr(module, TRAINER_ONLY_ATTR, ()), HEAD))

    return prepare


def prompt_log_z(module: nn.Module, batch: Any, dropout_seed: int) -> torch.Tensor:
    """(b,) log Z of each row's prompt: the policy's last hidden states over the prompt columns (one forward of
    the prompt part, with gradient: the same states as in the full sequence, the model being causal), averaged
    as verl does (``prompt_mean_hidden``), through the head.

    The head's dropout draws from a generator seeded with ``dropout_seed`` (the process's own stream left as it
    was): its masks are a function of the update and micro-batch, so a resumed run draws the same ones."""
    width = batch["responses"].shape[-1]
    prompt = slice(None, batch["input_ids"].shape[-1] - width)
    with compute_precision(module, batch["input_ids"].device):  # as the engine's own forwards
        out = module(input_ids=batch["input_ids"][:, prompt], attention_mask=batch["attention_mask"][:, prompt],
                     position_ids=batch["position_ids"][:, prompt], output_hidden_states=True, use_cache=False,
                     logits_to_keep=1)
        # the prompt alone: response_length 0 still leaves out its last column, as verl's slice does
        mean = prompt_mean_hidden(out.hidden_states[-1], batch["attention_mask"][:, prompt], response_length=0)
        cuda = [mean.device] if mean.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda):
            torch.manual_seed(dropout_seed)
            return getattr(module, HEAD)(mean).squeeze(-1).float()
