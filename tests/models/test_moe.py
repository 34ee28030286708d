"""The router losses and metrics of ``models/moe.py`` against hand-derived numbers and transformers' own
load-balancing loss, and the grouped experts (``grouped_mm``) against transformers' loop over experts."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from rlfoundry.models import moe
from rlfoundry.models.tiny import build_tiny_model, build_tokenizer

# Three real tokens of one sequence over N=4 experts, top-2, as router probabilities; a fourth token is
# padding with logits that would dominate every share if it counted.
PROBS = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4], [0.1, 0.6, 0.2, 0.1]])
CHOSEN = torch.tensor([[0, 1], [3, 2], [1, 2]])  # each token's top 2
PAD_LOGITS, PAD_CHOSEN = torch.tensor([[30.0, 0.0, 0.0, 0.0]]), torch.tensor([[0, 1]])
# logits = log p + c: the softmax is p whatever c, and logsumexp(logits) = log(sum p) + c = c
SHIFT = torch.tensor([1.0, 2.0, 3.0])
# f (share of the 3 tokens whose top 2 has e): e0 1/3, e1 2/3, e2 2/3, e3 1/3 (sum k = 2)
# P (mean probability): e0 0.6/3 = 0.2, e1 1.1/3, e2 0.7/3, e3 0.6/3 = 0.2
# N * sum f P = 4 * (0.2/3 + 2.2/9 + 1.4/9 + 0.2/3) = 4 * (0.4/3 + 3.6/9) = 4 * 8/15 = 32/15
AUX = 32 / 15
Z = (1 + 4 + 9) / 3  # mean of logsumexp^2 = c^2 over the 3 real tokens


def _record(shift: torch.Tensor = SHIFT) -> moe.RouterRecord:
    logits = torch.cat([PROBS.log() + shift[:, None], PAD_LOGITS])
    return moe.RouterRecord((1, 4), logits, torch.cat([CHOSEN, PAD_CHOSEN]))


def _layer(index: int = 0) -> moe.MoELayer:
    return moe.MoELayer(index, torch.nn.Identity(), torch.nn.Identity(), num_experts=4, top_k=2)


def test_balance_and_z_loss_of_one_sequence_by_hand_and_as_transformers_computes_it():
    mask = torch.tensor([[1, 1, 1, 0]])
    aux, z = moe.router_losses({0: [_record()]}, [_layer()], mask, packed=False)
    assert aux.tolist() == pytest.approx([AUX], abs=1e-6) and z.tolist() == pytest.approx([Z], abs=1e-5)
    hf = load_balancing_loss_func((_record().logits,), num_experts=4, top_k=2, attention_mask=mask)
    assert float(hf) == pytest.approx(AUX, abs=1e-6)  # transformers' form: the same number for one sequence


def test_losses_are_per_sequence_and_averaged_over_layers():
    """Two sequences packed end to end (3 + 1 real tokens): the first keeps its own numbers; the second
    is one token whose top 2 are experts 0 and 1 with p = (0.7, 0.1, 0.1, 0.1): N·Σ f P = 4·(0.7 + 0.1)
    = 3.2, z = (log 1 + 0.5)^2 = 0.25. A second layer seeing all four tokens with the same logits but
    shifted by 1 (z: mean of (c+1)^2 = (4+9+16)/3 and 2.25) averages with the first."""
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 1, 0]])  # lengths 3 and 1: the pack is 4 tokens
    second = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    logits = torch.cat([PROBS.log() + SHIFT[:, None], second.log() + 0.5])
    chosen = torch.cat([CHOSEN, torch.tensor([[0, 1]])])
    layer0 = moe.RouterRecord((1, 4), logits, chosen)
    layer1 = moe.RouterRecord((1, 4), logits + 1.0, chosen)
    aux, z = moe.router_losses({0: [layer0], 3: [layer1]}, [_layer(0), _layer(3)], mask, packed=True)
    assert aux.tolist() == pytest.approx([AUX, 3.2], abs=1e-5)
    assert z.tolist() == pytest.approx([(Z + 29 / 3) / 2, (0.25 + 2.25) / 2], abs=1e-5)


def test_router_metrics_of_one_layer_by_hand():
    """The 3 real tokens' 6 assignments: e0 1, e1 2, e2 2, e3 1 → shares 1/6, 1/3, 1/3, 1/6; × N=4:
    max 4/3, min 2/3; cv = std/mean = sqrt(mean((s - 1/4)^2)) / (1/4) = (1/12) / (1/4) = 1/3. Entropy:
    the mean over the 3 tokens of -Σ p ln p (the padding token's near-one-hot distribution left out)."""
    tallies = moe.router_tallies({2: [_record()]}, [_layer(2)], torch.tensor([[1, 1, 1, 0]]), packed=False)
    assert tallies[0, :4].tolist() == [1, 2, 2, 1] and tallies[0, 5] == 3  # assignments per expert, real tokens
    got = moe.router_metrics(tallies, [_layer(2)])
    entropy = sum(-sum(p * math.log(p) for p in row) for row in PROBS.tolist()) / 3
    assert got["moe/layer2/load_max"] == pytest.approx(4 / 3, abs=1e-6)
    assert got["moe/layer2/load_min"] == pytest.approx(2 / 3, abs=1e-6)
    assert got["moe/layer2/load_cv"] == pytest.approx(1 / 3, abs=1e-6)
    assert got["moe/layer2/routing_entropy"] == pytest.approx(entropy, abs=1e-6)


def test_a_router_record_that_does_not_fit_the_micro_batch_is_an_error():
    with pytest.raises(ValueError, match="token grid"):
        moe.router_losses({0: [_record()]}, [_layer()], torch.ones(2, 4, dtype=torch.long), packed=False)
    with pytest.raises(RuntimeError, match="ran 2 times"):
        moe.router_losses({0: [_record(), _record()]}, [_layer()], torch.ones(1, 4, dtype=torch.long), packed=False)


def test_moe_layers_finds_the_routed_blocks_only():
    tok = build_tokenizer()
    assert moe.moe_layers(build_tiny_model(tok, arch="qwen2")) == []
    found = moe.moe_layers(build_tiny_model(tok, arch="deepseek_v3", num_layers=3))
    assert [layer.index for layer in found] == [1, 2]  # layer 0 is DeepSeek-V3's dense first layer
    assert all((layer.num_experts, layer.top_k) == (8, 2) for layer in found)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
@pytest.mark.numerics
def test_grouped_experts_equal_the_loop_over_experts_forward_and_gradients(arch):
    """transformers' ``grouped_mm`` experts against its eager loop over experts, same weights, a padded
    batch: logits and every parameter's gradient agree to fp32 rounding (1e-5)."""
    torch.manual_seed(0)
    model = build_tiny_model(build_tokenizer(), arch=arch)
    for p in model.parameters():  # transformers initialises the router weights to 0: every token ties
        torch.nn.init.normal_(p, std=0.2) if p.dim() > 1 else None
    grouped, eager = model, copy.deepcopy(model)
    assert moe.use_grouped_experts(grouped) is not None
    eager.set_experts_implementation("eager")
    assert (grouped.config._experts_implementation, eager.config._experts_implementation) == ("grouped_mm", "eager")
    ids = torch.randint(4, 250, (3, 12))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    outs = []
    for m in (grouped, eager):
        logits = m(input_ids=ids, attention_mask=mask).logits
        (logits.square().mean()).backward()
        outs.append((logits, {n: p.grad for n, p in m.named_parameters() if p.grad is not None}))
    torch.testing.assert_close(outs[0][0], outs[1][0], atol=1e-5, rtol=1e-5)
    assert outs[0][1].keys() == outs[1][1].keys() and any("experts" in n for n in outs[0][1])
    for name, grad in outs[1][1].items():
        torch.testing.assert_close(outs[0][1][name], grad, atol=1e-5, rtol=1e-5, msg=name)
