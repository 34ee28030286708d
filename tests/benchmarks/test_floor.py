"""The hand-written floor (benchmarks/floor_grpo.py) does exactly rlfoundry's GRPO math.

If the floor did less work or different math, "rlfoundry / floor" would not measure framework
overhead. So: its advantages, loss and log-probs agree with ``rlfoundry.algos.core_algos`` and
``torch_functional`` on fixed batches; one whole update (with pi_old = sg(pi)) moves the weights
exactly as the verl-style path does (separate no-grad old log-prob pass, then core_algos' loss);
and its KV-cached sampler with row dropping reproduces full-recompute greedy decoding.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from benchmarks.floor_grpo import grpo_advantages, left_pad, ppo_clip_loss, sample, token_log_probs, update
from rlfoundry.algos import core_algos
from rlfoundry.utils.torch_functional import logprobs_from_logits

ACTOR_CFG = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0,
                            loss_scale_factor=None, global_batch_info={})


def _fixed_batch(seed: int = 0, groups: int = 3, n: int = 4, width: int = 7):
    g = torch.Generator().manual_seed(seed)
    rows = groups * n
    lengths = torch.randint(1, width + 1, (rows,), generator=g)
    mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    scores = torch.randint(0, 2, (rows,), generator=g).float()
    scores[:n] = 1.0  # one group with zero variance: its advantages must be exactly 0
    return scores, mask, lengths, n


def test_grpo_advantages_match_core_algos():
    scores, mask, lengths, n = _fixed_batch()
    token_rewards = torch.zeros(mask.shape)
    token_rewards[torch.arange(len(scores)), lengths - 1] = scores  # score on the last valid token
    index = np.repeat(np.arange(len(scores) // n), n).astype(str)
    expected, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, mask, index, epsilon=1e-6)

    ours = grpo_advantages(scores, n, eps=1e-6)

    torch.testing.assert_close(ours.unsqueeze(1) * mask, expected, rtol=1e-6, atol=1e-7)
    assert torch.all(ours[:n] == 0)
    # hand-derived: group [1, 0, 0, 0] -> mean 1/4, unbiased std sqrt(1/4) = 1/2 -> A_0 = 1.5
    torch.testing.assert_close(grpo_advantages(torch.tensor([1.0, 0, 0, 0]), 4, eps=0.0)[0], torch.tensor(1.5))


@pytest.mark.parametrize("spread", [0.05, 2.0])  # near on-policy, and ratios beyond the dual-clip bound c = 3
def test_ppo_clip_loss_matches_core_algos_token_mean(spread):
    scores, mask, _, n = _fixed_batch(seed=1)
    g = torch.Generator().manual_seed(2)
    old = -torch.rand(mask.shape, generator=g) * 3
    new = old + spread * torch.randn(mask.shape, generator=g)
    adv = torch.randn(mask.shape, generator=g) * mask

    expected, _ = core_algos.compute_policy_loss_vanilla(old, new, adv, mask, loss_agg_mode="token-mean",
                                                         config=ACTOR_CFG)
    ours = ppo_clip_loss(new, old, adv, mask, 0.2, 0.2, 3.0)

    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-7)


def test_token_log_probs_match_torch_functional():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 5, 11, generator=g)
    tokens = torch.randint(0, 11, (4, 5), generator=g)
    torch.testing.assert_close(token_log_probs(logits, tokens), logprobs_from_logits(logits, tokens))
    torch.testing.assert_close(token_log_probs(logits, tokens, temperature=0.7),
                               logprobs_from_logits(logits / 0.7, tokens))


@pytest.fixture(scope="module")
def small_model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("floor-model"), hidden_size=32, num_layers=2, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _prompts(tokenizer, texts):
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                           tokenize=False) for t in texts]
    return left_pad(tokenizer(chats, add_special_tokens=False)["input_ids"], tokenizer.pad_token_id)


def test_one_update_equals_verl_style_update(small_model_and_tokenizer):
    """pi_old = sg(pi) in one pass gives the same step as a separate old-log-prob pass + core_algos."""
    model, tok = small_model_and_tokenizer
    ids, mask = _prompts(tok, ["12+7=", "3-45=", "99+1="])
    n, width = 2, 5
    g = torch.Generator().manual_seed(4)
    responses = torch.randint(3, 200, (ids.shape[0] * n, width), generator=g)
    lengths = torch.tensor([5, 2, 4, 5, 1, 3])
    responses[torch.arange(width).unsqueeze(0) >= lengths.unsqueeze(1)] = tok.pad_token_id
    adv = grpo_advantages(torch.tensor([1.0, 0, 0, 1, 1, 1]), n)
    p_ids, p_mask = ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0)

    floor_model = copy.deepcopy(model).train()
    # SGD, not AdamW: Adam's per-element normalisation would blow 1e-9 float noise in near-zero
    # gradients up to a full step; with SGD the weights move by exactly the (clipped) gradient.
    floor_opt = torch.optim.SGD(floor_model.parameters(), lr=1.0)
    update(floor_model, floor_opt, p_ids, p_mask, responses, lengths, adv, 0.2, 1.0, 1.0)

    ref_model = copy.deepcopy(model).train()
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=1.0)
    resp_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    full_ids, full_mask = torch.cat([p_ids, responses], 1), torch.cat([p_mask, resp_mask], 1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)

    def response_log_probs():
        logits = ref_model(input_ids=full_ids, attention_mask=full_mask, position_ids=pos).logits
        return logprobs_from_logits(logits[:, -width - 1:-1], responses)

    with torch.no_grad():
        old = response_log_probs()
    loss, _ = core_algos.compute_policy_loss_vanilla(old, response_log_probs(), adv.unsqueeze(1) * resp_mask,
                                                     resp_mask, loss_agg_mode="token-mean", config=ACTOR_CFG)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1.0)
    ref_opt.step()

    for (name, a), b in zip(floor_model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    assert any(not torch.equal(a, b) for a, b in zip(floor_model.parameters(), model.parameters()))


def test_cached_sampler_with_row_dropping_matches_full_recompute_greedy(small_model_and_tokenizer):
    """Near-zero temperature = greedy; rows stop at an 'EOS' the model does emit, so rows drop mid-way."""
    model, tok = small_model_and_tokenizer
    model.eval()
    ids, mask = _prompts(tok, ["1+1=", "23-4=", "567+89=", "0-0="])
    steps = 10

    def greedy_full_recompute(eos_id):
        outs = []
        for i in range(ids.shape[0]):
            seq = ids[i][mask[i].bool()].tolist()
            out = []
            for _ in range(steps):
                with torch.no_grad():
                    nxt = int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax())
                out.append(nxt)
                seq.append(nxt)
                if nxt == eos_id:
                    break
            outs.append(out)
        return outs

    free_run = greedy_full_recompute(eos_id=-1)
    eos_id = free_run[0][3]  # a token row 0 emits at step 4: at least one row stops early
    expected = greedy_full_recompute(eos_id)
    assert any(len(e) < steps for e in expected)

    responses, lengths = sample(model, ids, mask, n=2, max_new_tokens=steps, eos_id=eos_id,
                                pad_id=tok.pad_token_id, temperature=1e-4, generator=torch.Generator().manual_seed(0))

    for row in range(responses.shape[0]):
        want = expected[row // 2]
        assert lengths[row].item() == len(want)
        assert responses[row, : len(want)].tolist() == want
        assert torch.all(responses[row, len(want):] == tok.pad_token_id)
