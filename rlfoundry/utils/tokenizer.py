"""Tokenizer helpers shared by the data, reward, rollout and trainer code (verl: ``utils/tokenizer.py``)."""

from __future__ import annotations

from typing import Any

__all__ = ["pad_id"]


def pad_id(tokenizer: Any) -> int:
    """The id that fills padded positions: the tokenizer's pad token, else its EOS token.

    The convention of verl (``set_pad_token_id``) and of HF ``generate`` for models that ship without a
    pad token (Llama, Mistral): padding is always masked, so the id only has to be a real token that the
    rollout, the driver and the reward models agree on, and EOS is one every causal LM has. Not ``or``:
    a pad id of 0 is a real id (Qwen2-style byte vocabularies put ``<|endoftext|>`` there), and not a
    silent 0 when both are missing, since 0 is an ordinary token in most vocabularies.
    """
    for name in ("pad_token_id", "eos_token_id"):
        token_id = getattr(tokenizer, name, None)
        if token_id is not None:
            return int(token_id)
    raise ValueError(f"{type(tokenizer).__name__} {getattr(tokenizer, 'name_or_path', '')!r} has neither a pad nor "
                     "an EOS token, so padded batches have no id to fill with; set pad_token (or eos_token) in "
                     "its tokenizer_config.json")
