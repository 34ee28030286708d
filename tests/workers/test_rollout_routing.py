"""The HF rollout records the MoE routing of every prompt and sampled token (``routed_experts``), on the
dynamic loop and the static-shape decode alike, aligned with the batch it returns."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.models import routing_replay as rr
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from rlfoundry.workers.rollout.static_decode import StaticDecoder
from tests.workers import make_prompts, worker_config

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
EOS_THIRD = list(range(0, 260, 3))  # a third of the vocabulary: samples end at assorted lengths


@pytest.fixture(scope="module")
def moe(tiny_moe_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)


def _rollout(model, model_dir, tokenizer, static: bool):
    cfg = worker_config(model_dir, ["rollout.response_length=10", "rollout.enable_rollout_routing_replay=true"])
    engine = HFRollout(model, cfg["rollout"], tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=static)
    if static:
        engine._static = StaticDecoder(model, sync_every=2)  # the bucket shrinks within the call
    return engine


def _generate(engine, tokenizer):
    prompts = make_prompts(tokenizer, TEXTS)
    prompts.meta_info.update(n=2, eos_token_id=EOS_THIRD)
    return engine.generate_sequences(prompts).batch


def _teacher_forced_routing(model, batch) -> torch.Tensor:
    """The routing of one full forward over the returned rows (no KV cache)."""
    with torch.no_grad(), rr.recording(model) as state:
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
        return state.take().view(*batch["input_ids"].shape, state.num_layers, state.top_k)


def test_the_rollout_records_each_fed_token_and_marks_the_rest(moe, tiny_moe_dir, tokenizer):
    batch = _generate(_rollout(moe, tiny_moe_dir, tokenizer, static=False), tokenizer)
    routed = batch["routed_experts"]
    rows, seq = batch["input_ids"].shape
    assert routed.shape == (rows, seq, 2, 2)
    lengths = batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 2  # rows ended at different steps (and left the cache)
    tp = seq - batch["responses"].shape[1]
    # fed tokens: the real prompt tokens, and each response token but its last (sampled, never fed back)
    fed = batch["attention_mask"].bool().clone()
    fed[torch.arange(rows), tp + lengths - 1] = False
    assert bool((routed[fed] >= 0).all()) and bool((routed[~fed] == rr.NO_EXPERT).all())
    # the experts the KV-cached decode chose are those a full forward over the same rows chooses (fp32)
    own = _teacher_forced_routing(moe, batch)
    same = (routed.long().sort(-1).values == own.sort(-1).values).all(-1).all(-1)[fed]
    assert float(same.float().mean()) == 1.0


def test_the_static_decode_records_what_the_dynamic_loop_records(moe, tiny_moe_dir, tokenizer):
    dynamic = _generate(_rollout(moe, tiny_moe_dir, tokenizer, static=False), tokenizer)
    static = _generate(_rollout(moe, tiny_moe_dir, tokenizer, static=True), tokenizer)
    assert torch.equal(dynamic["responses"], static["responses"])
    assert torch.equal(dynamic["routed_experts"], static["routed_experts"])


def test_no_routing_is_recorded_unless_asked(moe, tiny_moe_dir, tokenizer):
    cfg = worker_config(tiny_moe_dir, ["rollout.response_length=4"])
    engine = HFRollout(moe, cfg["rollout"], tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=False)
    assert "routed_experts" not in _generate(engine, tokenizer).keys()
    assert rr.attach(moe).mode is None  # the recorder of the other tests was switched off


def test_the_recording_decode_step_still_traces_as_one_graph(moe, tiny_moe_dir, tokenizer):
    """The router hooks inside the static step: ``fullgraph=True`` raises on a graph break (what CUDA graphs
    would need); the eager backend compiles nothing, so this runs in seconds. The record is the eager one's."""
    torch._dynamo.reset()
    eager = _generate(_rollout(moe, tiny_moe_dir, tokenizer, static=True), tokenizer)
    traced = _rollout(moe, tiny_moe_dir, tokenizer, static=True)
    decoder = traced._static
    decoder._step = torch.compile(decoder._forward, backend="eager", fullgraph=True, dynamic=False)
    out = _generate(traced, tokenizer)
    assert torch.equal(out["responses"], eager["responses"])
    assert torch.equal(out["routed_experts"], eager["routed_experts"])


def test_a_serving_engines_routing_is_laid_out_as_the_hf_engines():
    """``engine_routes`` (SGLang's per-sample routing, prompt tokens then each response token but its last):
    two left-padded prompts, n = 2, hand-placed experts; L = 1, k = 2."""
    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    lengths = torch.tensor([3, 1, 2, 0])
    samples = [torch.tensor([[[10 * i + t, 10 * i + t + 1]] for t in range(n_fed)]) for i, n_fed in
               enumerate([2 + 2, 2 + 0, 4 + 1, 4 + 0])]
    routes = rr.engine_routes(samples, mask, 2, lengths, 3, num_experts=64)
    assert routes.shape == (4, 7, 1, 2) and routes.dtype == torch.int16
    expected = torch.full((4, 7), rr.NO_EXPERT)
    expected[0, [2, 3, 4, 5]] = torch.tensor([0, 1, 2, 3])  # 2 prompt tokens, 2 fed response tokens of 3
    expected[1, [2, 3]] = torch.tensor([10, 11])  # 1 response token: sampled, never fed
    expected[2, [0, 1, 2, 3, 4]] = torch.tensor([20, 21, 22, 23, 24])
    expected[3, [0, 1, 2, 3]] = torch.tensor([30, 31, 32, 33])
    assert torch.equal(routes[..., 0, 0].long(), expected)
    assert torch.equal(routes[..., 0, 1].long(), torch.where(expected >= 0, expected + 1, rr.NO_EXPERT))
    with pytest.raises(RuntimeError, match="routing of 3 tokens for sample 0.*expected 4"):
        rr.engine_routes([samples[0][:3], *samples[1:]], mask, 2, lengths, 3, num_experts=64)
