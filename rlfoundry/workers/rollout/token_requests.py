"""What the engines that take token ids (vLLM, SGLang) share: a batch of left-padded prompt rows turned
into per-request token lists and budgets, and their samples put back into the HF engine's layout."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfoundry.models.vision import continued_positions
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.base import SamplingParams, resolve_sampling_params

__all__ = ["TokenRequests", "as_id_list", "assemble", "prompt_token_lists"]


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, (list, tuple, set)):
        return [int(v) for v in value]
    return [int(value)]


def prompt_token_lists(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> list[list[int]]:
    """Each row's real tokens: the attention mask, not the pad id, says where padding is."""
    rows = [ids[mask.bool()].tolist() for ids, mask in zip(input_ids.cpu(), attention_mask.cpu())]
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"prompt rows {empty[:8]} have no tokens (attention_mask all 0); a rollout engine "
                         "cannot generate from an empty prompt")
    return rows


@dataclass(frozen=True)
class TokenRequests:
    """One ``generate_sequences`` call's requests: sampling parameters, ids, rows and their budgets."""

    params: SamplingParams
    pad_id: int
    eos_ids: list[int]
    rows: list[list[int]]
    budgets: list[int]  # new tokens per row: the agent loop's rows each have their own budget left
    position_ids: torch.Tensor

    @classmethod
    def of(cls, prompts: DataProto, config: Any, pad_token_id: int, eos_token_ids: list[int]) -> TokenRequests:
        params = resolve_sampling_params(config, prompts.meta_info)
        batch, meta = prompts.batch, prompts.meta_info
        attention_mask = batch["attention_mask"]
        position_ids = batch["position_ids"] if "position_ids" in batch.keys() else None
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        rows = prompt_token_lists(batch["input_ids"], attention_mask)
        budgets = [min(int(b), params.response_length)
                   for b in meta.get("max_response_lengths") or [params.response_length] * len(rows)]
        return cls(params, int(meta.get("pad_token_id", pad_token_id)),
                   as_id_list(meta.get("eos_token_id")) or eos_token_ids, rows, budgets, position_ids)

    def check_fits(self, limit: int, what: str) -> None:
        """A clear error before the engine's own when a prompt plus its budget exceeds ``limit``."""
        longest, budget = max(((len(r), b) for r, b in zip(self.rows, self.budgets)), key=sum)
        if longest + budget > limit:
            raise ValueError(
                f"a prompt of {longest} tokens + response_length {budget} exceeds {what} {limit}; raise "
                f"actor_rollout_ref.rollout.prompt_length (or rollout.max_model_len) or shorten data.max_prompt_length")


def assemble(prompts: DataProto, n: int, responses, log_probs, lengths, position_ids) -> DataProto:
    """The HF engine's layout: prompt rows repeated n times (interleaved) and responses appended."""
    device, width = prompts.batch["input_ids"].device, responses.shape[1]
    responses, log_probs, lengths = responses.to(device), log_probs.to(device), lengths.to(device)
    prompt_ids = prompts.batch["input_ids"].repeat_interleave(n, dim=0)
    prompt_mask = prompts.batch["attention_mask"].repeat_interleave(n, dim=0)
    prompt_pos = position_ids.repeat_interleave(n, dim=0)
    steps = torch.arange(1, width + 1, device=device)
    response_mask = (steps.unsqueeze(0) <= lengths.unsqueeze(1)).long()  # 1 through EOS
    tensors = {
        "prompts": prompt_ids,
        "responses": responses,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, response_mask.to(prompt_mask.dtype)], dim=1),
        "position_ids": continued_positions(prompt_pos, width),
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
    }
    non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
    return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=dict(prompts.meta_info))
