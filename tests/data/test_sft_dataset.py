"""SFT pairs: the loss mask (response and EOS only), truncation, and the RL batch layout."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.data.sft_dataset import SFTDataError, collate_sft, encode_pair
from rlfoundry.models.tiny import build_tokenizer


def test_loss_mask_covers_response_and_eos_only():
    tok = build_tokenizer()
    ex = encode_pair(tok, [{"role": "user", "content": "1+1="}], "2", max_length=64)
    # "<|im_start|>" "user\n"(5) "1+1="(4) "<|im_end|>" "\n" "<|im_start|>" "assistant\n"(10) = 23 prompt tokens,
    # then "2" and EOS: the two tokens the model must learn to produce.
    assert ex["loss_mask"].tolist() == [0] * 23 + [1, 1]
    assert tok.decode(ex["input_ids"][23:24]) == "2" and ex["input_ids"][-1].item() == tok.eos_token_id
    assert tok.decode(ex["input_ids"][:23]) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"


def test_truncation_modes():
    tok = build_tokenizer()
    msgs = [{"role": "user", "content": "1+1="}]
    with pytest.raises(SFTDataError, match="data.max_length=10"):
        encode_pair(tok, msgs, "2", max_length=10)
    left = encode_pair(tok, msgs, "2", max_length=10, truncation="left")
    assert left["loss_mask"].tolist() == [0] * 8 + [1, 1]  # response kept whole
    right = encode_pair(tok, msgs, "2", max_length=10, truncation="right")
    assert right["loss_mask"].sum() == 0  # only prompt left: nothing to learn from this row


def test_batch_is_the_rl_layout():
    tok, pad = build_tokenizer(), 0
    rows = [encode_pair(tok, [{"role": "user", "content": "1+1="}], "2", 64),   # 23 prompt + 2 response tokens
            encode_pair(tok, [{"role": "user", "content": "10+10="}], "20", 64)]  # 25 prompt + 3 response tokens
    # a row that is all response (left truncation ate the prompt): its first token becomes the
    # prompt, since nothing predicts it (the loss it replaced skipped token 0 as well)
    rows.append({"input_ids": torch.tensor([7, 8, 9]), "loss_mask": torch.tensor([1, 1, 1])})
    b = collate_sft(rows, pad)
    assert b["input_ids"].shape == (3, 25 + 3) and b["responses"].shape == (3, 3)
    assert b["attention_mask"][:, :25].sum(-1).tolist() == [23, 25, 1]  # prompts end at column 25 ...
    assert b["attention_mask"][0, :2].tolist() == [0, 0]  # ... left-padded
    assert b["response_mask"].tolist() == [[1, 1, 0], [1, 1, 1], [1, 1, 0]]  # responses right-padded
    assert b["responses"][2].tolist() == [8, 9, pad] and b["input_ids"][2, 24].item() == 7
    assert b["position_ids"][1].tolist() == list(range(28))  # the full row: 0 .. 27
    assert b["position_ids"][0, 2:27].tolist() == list(range(25)) and b["position_ids"][0, :2].tolist() == [0, 0]
