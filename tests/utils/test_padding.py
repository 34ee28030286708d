"""Padding removal gives the same per-token outputs as the padded forward."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.utils.torch_functional import logprobs_from_logits
from rlfoundry.models.hf import load_hf_model
from rlfoundry.utils.padding import (
    forward_logits,
    pack_padded_batch,
    packed_next_token_ids,
    unpack_to_padded,
)


def _mixed_padding_batch(lengths: list[int], width: int, seed: int = 0):
    """Even rows right-padded, odd rows left-padded; positions = cumsum(mask) - 1 as the rollout makes."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (len(lengths), width), generator=g)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if i % 2:
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, pos


@pytest.fixture(scope="module")
def models(tiny_model_dir, tiny_critic_dir):
    return {
        ("causal_lm", impl): load_hf_model(tiny_model_dir, "causal_lm", attn_implementation=impl).eval()
        for impl in ("sdpa", "eager")
    } | {("token_classification", "sdpa"): load_hf_model(tiny_critic_dir, "token_classification").eval()}


@pytest.mark.parametrize("kind, impl", [("causal_lm", "sdpa"), ("causal_lm", "eager"), ("token_classification", "sdpa")])
def test_packed_forward_matches_padded(models, kind, impl):
    # A full row, a one-token row, and rows of other lengths, mixing left and right padding: a
    # token attending across a row boundary would change the outputs far beyond 1e-5.
    ids, mask, pos = _mixed_padding_batch([12, 5, 1, 8, 3], width=12)
    model = models[(kind, impl)]
    with torch.no_grad():
        padded = forward_logits(model, ids, mask, pos, use_remove_padding=False)
        packed = forward_logits(model, ids, mask, pos, use_remove_padding=True)
    valid = mask.bool()
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=1e-5)
    assert (packed[~valid] == 0).all()


def test_log_probs_in_packed_space_match_padded(models):
    # The actor may score tokens without unpacking (B, T, vocab) logits: roll the packed ids by one.
    ids, mask, pos = _mixed_padding_batch([9, 4, 7], width=9, seed=1)
    model = models[("causal_lm", "sdpa")]
    with torch.no_grad():
        padded_logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
        packed = pack_padded_batch(ids, mask, pos)
        packed_logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids).logits
    lp_packed = unpack_to_padded(logprobs_from_logits(packed_logits, packed_next_token_ids(packed)), packed)
    lp_padded = logprobs_from_logits(padded_logits[:, :-1], ids[:, 1:])
    # position t predicts token t+1; compare where both t and t+1 are real tokens
    both = (mask[:, :-1] * mask[:, 1:]).bool()
    torch.testing.assert_close(lp_packed[:, :-1][both], lp_padded[both], atol=1e-5, rtol=1e-5)


def test_pack_unpack_round_trip_and_cu_seqlens():
    ids, mask, pos = _mixed_padding_batch([3, 1, 4], width=4)
    packed = pack_padded_batch(ids, mask, pos)
    assert packed.input_ids.shape == (1, 8)
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3]]
    assert packed.cu_seqlens.tolist() == [0, 3, 4, 8]
    restored = unpack_to_padded(packed.input_ids.unsqueeze(-1), packed, pad_value=-1).squeeze(-1)
    assert torch.equal(restored, torch.where(mask.bool(), ids, -1))


def test_positions_that_do_not_restart_at_zero_are_rejected():
    ids, mask, _ = _mixed_padding_batch([3, 2], width=4)
    arange_pos = torch.arange(4).expand(2, 4)  # left-padded row 1 would start at position 2
    with pytest.raises(ValueError, match="use_remove_padding"):
        pack_padded_batch(ids, mask, arange_pos)
