"""Routing replay hooks (models/routing_replay.py) on transformers' own Qwen3-MoE / Qwen2-MoE modules."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.models import routing_replay as rr
from rlfoundry.models.tiny import build_tiny_model, build_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def _model(tok, arch="qwen3_moe"):
    model = build_tiny_model(tok, arch=arch, seed=3)
    return model.eval()


def _ids(tok, rows=2, length=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, len(tok), (rows, length), generator=g)


def _record(model, ids):
    with rr.recording(model) as state:
        logits = model(input_ids=ids).logits
        return logits, state.take().view(ids.shape[0], ids.shape[1], state.num_layers, state.top_k)


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_replaying_the_recorded_routing_gives_bit_identical_logits(tok, arch):
    model = _model(tok, arch)
    ids = _ids(tok)
    with torch.no_grad():
        logits, routed = _record(model, ids)
        assert routed.shape == (2, 7, 2, 2) and int(routed.min()) >= 0 and int(routed.max()) < 8
        state = rr.attach(model)
        state.replay(routed)
        replayed = model(input_ids=ids).logits
        state.off()
    assert torch.equal(replayed, logits)


def _other_routing(routed: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's experts shifted by one (mod E): a valid top-k set that differs everywhere."""
    return (routed + 1) % experts


def test_replaying_another_routing_matches_a_hand_computed_moe_layer(tok):
    """Layer 0's MoE block under a replayed routing equals sum_e w_e · expert_e(x), with w the router's
    softmax at the replayed experts, renormalised (norm_topk_prob=True in the tiny model)."""
    model = _model(tok)
    ids = _ids(tok, rows=1, length=5)
    block = model.model.layers[0].mlp
    seen = {}
    block.register_forward_hook(lambda m, inp, out: seen.update(x=inp[0].detach(), y=out.detach()))
    with torch.no_grad():
        base_logits, routed = _record(model, ids)
        other = _other_routing(routed, 8)
        state = rr.attach(model)
        state.replay(other)
        logits = model(input_ids=ids).logits
        state.off()
    assert (logits - base_logits).abs().max() > 1e-4  # another routing is another function
    x = seen["x"].reshape(-1, 64)
    probs = torch.softmax(x @ block.gate.weight.T, dim=-1)
    experts = block.experts
    expected = torch.zeros_like(x)
    for t in range(x.shape[0]):
        chosen = other[0, t, 0]
        w = probs[t, chosen] / probs[t, chosen].sum()
        for e, weight in zip(chosen.tolist(), w):
            gate, up = (experts.gate_up_proj[e] @ x[t]).chunk(2)
            expected[t] += weight * (experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(seen["y"].reshape(-1, 64), expected, rtol=1e-5, atol=1e-6)


def test_under_replay_the_router_weights_get_gradients_and_stats_count_changed_tokens(tok):
    model = _model(tok)
    ids = _ids(tok)
    with torch.no_grad():
        _, routed = _record(model, ids)
    state = rr.attach(model)
    other = routed.clone()
    other[0, 3] = _other_routing(routed[0, 3], 8)  # one token rerouted in both layers
    other[1, 0] = rr.NO_EXPERT  # one token without a record keeps its own routing
    counted = torch.ones(2, 7, dtype=torch.bool)
    state.replay(other, counted)
    with torch.no_grad():
        model(input_ids=ids)
    stats = state.row_stats()
    # row 0: 7 tokens with a record, one rerouted; row 1: 6 with a record (one has none), none rerouted
    assert stats["routing_changed_tokens"].tolist() == [1.0, 0.0]
    assert stats["routing_counted_tokens"].tolist() == [7.0, 6.0]
    model(input_ids=ids).logits.sum().backward()
    state.off()
    grads = [r.weight.grad for r in rr.routers(model)]
    assert all(g is not None and float(g.abs().sum()) > 0 for g in grads)


def test_a_routing_of_another_shape_and_a_dense_model_are_errors(tok):
    model = _model(tok)
    state = rr.attach(model)
    with pytest.raises(ValueError, match="recorded on another model"):
        state.replay(torch.zeros(1, 4, 3, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="router_replay.mode=disabled"):
        rr.attach(build_tiny_model(tok, arch="qwen2"))
