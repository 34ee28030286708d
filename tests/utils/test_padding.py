"""Padding removal gives the same per-token outputs as the padded forward."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.utils.torch_functional import logprobs_from_logits
from rlfoundry.models.hf import load_hf_model
from rlfoundry.utils.padding import (
    forward_logits,
    pack_layout,
    pack_padded_batch,
    packed_causal_mask,
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
@pytest.mark.numerics
def test_packed_forward_matches_padded(models, kind, impl):
    # A full row, a one-token row, and rows of other lengths, mixing left and right padding: a
    # token attending across a row boundary would change the outputs far beyond 1e-5.
    ids, mask, pos = _mixed_padding_batch([12, 5, 1, 8, 3], width=12)
    model = models[(kind, impl)]
    with torch.no_grad():
        padded = forward_logits(model, ids, mask, pos, use_remove_padding=False)
        packed = forward_logits(model, ids, mask, pos, use_remove_padding=True)
    valid = mask.bool()
    # packed (varlen) attention vs padded masks: fp32 rounding only: the same forward in another order (~u·sqrt(H +
    # V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(packed[valid], padded[valid], atol=1e-5, rtol=1e-5)
    assert (packed[~valid] == 0).all()


@pytest.mark.numerics
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
    # packed (varlen) attention vs padded masks: fp32 rounding only: the same forward in another order (~u·sqrt(H +
    # V)·|logit| ~ 1e-6 per log-prob)
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


def _rollout_rows(prompts: list[int], responses: list[int], tp: int = 5, tr: int = 4):
    """Rollout layout: left-padded prompts of width tp, right-padded responses of width tr."""
    rows = len(prompts)
    mask = torch.zeros(rows, tp + tr, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, tp - p: tp + r] = 1
    ids = torch.randint(5, 200, mask.shape, generator=torch.Generator().manual_seed(3))
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def test_the_host_layout_is_the_pack_the_device_makes():
    """pack_layout from per-row counts alone = pack_padded_batch's indices and positions, and its
    predictors are the real tokens just before each response slot, as the device path finds them."""
    prompts, responses, tp, tr = [3, 5, 1, 2], [4, 0, 2, 1], 5, 4
    ids, mask, pos = _rollout_rows(prompts, responses, tp, tr)
    layout = pack_layout([tp - p for p in prompts], [p + r for p, r in zip(prompts, responses)], tp + tr, tr)
    packed = pack_padded_batch(ids, mask, pos)
    assert torch.equal(layout.indices, packed.indices)
    assert torch.equal(layout.position_ids, packed.position_ids[0])
    assert layout.sequence_ids.tolist() == [0] * 7 + [1] * 5 + [2] * 3 + [3] * 3
    grid = torch.full((mask.numel(),), -1)
    grid[packed.indices] = torch.arange(packed.indices.numel())
    where = grid[(torch.arange(4) * (tp + tr))[:, None] + tp - 1 + torch.arange(tr)]  # (rows, tr) or -1
    assert torch.equal(layout.keep, where[where >= 0])
    assert torch.equal(layout.slots, (where >= 0).reshape(-1).nonzero()[:, 0])
    # hand-checked row 1 (5 prompt tokens, empty response): only its last prompt token predicts (slot 0)
    assert layout.slots.tolist()[4] == 4 and layout.keep.tolist()[4] == 7 + 4


def test_the_pack_mask_lets_each_token_see_its_own_rows_past_only():
    mask = packed_causal_mask(torch.tensor([0, 0, 1, 1, 1]))[0, 0]
    assert mask.tolist() == [[True, False, False, False, False],
                             [True, True, False, False, False],
                             [False, False, True, False, False],
                             [False, False, True, True, False],
                             [False, False, True, True, True]]


def test_the_row_summary_marks_the_rows_that_can_be_packed():
    """One run of real tokens counting 0, 1, ...: packable; a hole in the mask, or positions that do not
    restart, send the micro-batch to the device path (which names the problem)."""
    from rlfoundry.engines.fsdp.forward import row_summary

    ids, mask, pos = _rollout_rows([3, 2, 4], [2, 4, 1])
    mask[1, 4] = 0  # a hole between row 1's prompt and response
    pos[2] = torch.arange(pos.shape[1])  # row 2's positions do not start at its first real token
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, 5:]}
    assert row_summary(batch).packable == (1, 0, 0)
    del batch["position_ids"]
    assert row_summary(batch).packable == (0, 0, 0)
