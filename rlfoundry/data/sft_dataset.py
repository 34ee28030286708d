"""Prompt/response pairs for supervised fine-tuning (``rlfoundry sft``), laid out as verl's RL batch.

Pairs come from parquet / jsonl / json files (``data.prompt_key`` / ``data.response_key``, with
verl's ``prompt_dict_keys`` / ``response_dict_keys`` for nested columns; a prompt is a string or a
list of chat messages, so verl's RL parquet serves SFT too) or from the built-in arithmetic task.
The prompt goes through the tokenizer's chat template (with the generation prompt); the response
gets EOS appended; ``loss_mask`` is 1 on the response tokens. ``collate_sft`` makes the rows the
engine's causal-LM layout: left-padded prompt | right-padded response, with ``response_mask``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from rlfoundry.data.rl_dataset import position_ids_from_mask

__all__ = ["Pair", "SFTDataError", "SFTDataset", "collate_sft", "encode_pair", "load_pairs", "synthetic_pairs"]

Pair = tuple[list[dict], str]  # (chat messages of the prompt, response text)


class SFTDataError(ValueError):
    """A data file or row the SFT trainer cannot use; the message names the file/row and the fix."""


def _read_rows(path: Path) -> list[dict]:
    """Rows of a parquet, jsonl or json (list of objects) file."""
    from rlfoundry.data.preprocess.common import read_records

    if not path.is_file():
        raise SFTDataError(f"data file {str(path)!r} does not exist; check data.train_files / data.val_files")
    return read_records(path, error=SFTDataError)


def _field(row: Mapping, key: str, dict_keys: Sequence[str] | None, where: str, config_key: str) -> Any:
    """``row[key]``, then down through ``dict_keys`` (verl's prompt_dict_keys for nested columns)."""
    if key not in row:
        raise SFTDataError(f"{where}: no column {key!r} (columns: {sorted(row)}); set {config_key}")
    value = row[key]
    for sub in dict_keys or ():
        if not isinstance(value, Mapping) or sub not in value:
            raise SFTDataError(f"{where}: column {key!r} has no field {sub!r} (set {config_key.replace('key', 'dict_keys')})")
        value = value[sub]
    return value


def _as_messages(prompt: Any, where: str) -> list[dict]:
    """A plain string is one user turn; a list of ``{"role", "content"}`` is used as it is (verl's
    RL parquet stores prompts that way, so the same files serve SFT and RL)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "content" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise SFTDataError(f"{where}: the prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def load_pairs(files: str | Sequence[str], data_cfg: Any) -> list[Pair]:
    """(messages, response) pairs from the files named by ``data.train_files`` / ``data.val_files``."""
    pairs: list[Pair] = []
    for file in [files] if isinstance(files, str) else list(files):
        path = Path(os.path.expanduser(str(file)))
        for i, row in enumerate(_read_rows(path)):
            where = f"{path}, row {i}"
            prompt = _field(row, data_cfg.prompt_key, data_cfg.prompt_dict_keys, where, "data.prompt_key")
            response = _field(row, data_cfg.response_key, data_cfg.response_dict_keys, where, "data.response_key")
            pairs.append((_as_messages(prompt, where), str(response)))
    if not pairs:
        raise SFTDataError(f"no rows in {files}")
    return pairs


def synthetic_pairs(syn: Any) -> tuple[list[Pair], list[Pair]]:
    """(train, val) pairs of the built-in arithmetic task; validation is drawn first and excluded
    from training, so with the RL demo's seed and size it is exactly the RL validation set."""
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits

    spec = ArithmeticSpec(digits=syn.digits, ops=syn.ops, num_operands=syn.num_operands)
    splits = generate_splits(syn.train_size, syn.val_size, seed=syn.seed, spec=spec)
    return tuple([([{"role": "user", "content": p}], a) for p, a in splits[s]] for s in ("train", "test"))


def _truncate(ids: list[int], mask: list[int], max_length: int, truncation: str, where: str) -> tuple[list[int], list[int]]:
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "left":  # keeps the response (and its EOS) whole; loses the start of the prompt
        return ids[-max_length:], mask[-max_length:]
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    raise SFTDataError(f"{where}: {len(ids)} tokens (prompt + response + EOS) > data.max_length={max_length}; "
                       "raise data.max_length or set data.truncation=left|right")


def encode_pair(tokenizer: Any, messages: list[dict], response: str, max_length: int,
                truncation: str = "error", where: str = "example") -> dict[str, torch.Tensor]:
    """Token ids of chat-templated prompt + response + EOS, and ``loss_mask`` (1 on every response
    token, EOS included: those are the tokens the model must learn to produce; 0 on the prompt)."""
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids, mask = _truncate(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids),
                          max_length, truncation, where)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


class SFTDataset(Dataset):
    """Pairs tokenised once up front (SFT sets for this trainer are small; it keeps epochs cheap)."""

    def __init__(self, pairs: Sequence[Pair], tokenizer: Any, max_length: int, truncation: str = "error") -> None:
        self.examples = [encode_pair(tokenizer, m, r, max_length, truncation, where=f"example {i}")
                         for i, (m, r) in enumerate(pairs)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


def _response_start(loss_mask: torch.Tensor) -> int:
    """Where the targets begin: the first loss-mask token, but never token 0 (nothing predicts it)."""
    targets = loss_mask.nonzero()
    return max(1, int(targets[0]) if len(targets) else len(loss_mask))


def collate_sft(examples: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """verl's RL batch layout: ``input_ids``/``attention_mask``/``position_ids`` (B, Tp+Tr) =
    left-padded prompt | right-padded response, ``responses`` (B, Tr), and ``response_mask`` (B, Tr)
    = the loss mask over the response (padding is never a target)."""
    starts = [_response_start(e["loss_mask"]) for e in examples]
    tp = max(starts)
    tr = max([1] + [len(e["input_ids"]) - s for e, s in zip(examples, starts)])
    ids = torch.full((len(examples), tp + tr), pad_token_id, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (e, s) in enumerate(zip(examples, starts)):
        n = len(e["input_ids"])
        cols = slice(tp - s, tp - s + n)  # the prompt ends at column tp, the response starts there
        ids[i, cols], attention[i, cols], loss[i, cols] = e["input_ids"], 1, e["loss_mask"]
    return {"input_ids": ids, "attention_mask": attention, "position_ids": position_ids_from_mask(attention),
            "responses": ids[:, tp:], "response_mask": loss[:, tp:]}
