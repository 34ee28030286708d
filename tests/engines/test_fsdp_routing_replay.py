"""Routing replay in the FSDP engine (``forward.py``, ``models/routing_replay.py``): the log-prob and update
forwards route each token to the batch's ``routed_experts``, whatever the micro-batching, padding removal or
token budget; R2's record comes back on the batch's grid; the routing-change counts are exact."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from transformers import AutoModelForCausalLM

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models import routing_replay as rr
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.workers import make_prompts, worker_config

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
EOS_THIRD = list(range(0, 260, 3))  # samples end at assorted lengths


def _engine(model_dir, single_rank="auto", **fields) -> FSDPEngine:
    """``single_rank=fsdp``: the model wrapped by FSDP2's ``fully_shard`` even on one rank (auto: the plain module)."""
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(single_rank=single_rank), grad_clip=None,
                              cpu_kernels="off",
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0), **fields)
    return FSDPEngine.build(config, "cpu", role="actor")


@pytest.fixture(scope="module")
def rollout_batch(tiny_moe_dir, tokenizer):
    """8 sampled rows of the tiny MoE with the routing the rollout recorded, and a copy where the first
    three response tokens of every row with a record are routed to the next experts (mod 8) in every layer."""
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    cfg = worker_config(tiny_moe_dir, ["rollout.response_length=10", "rollout.enable_rollout_routing_replay=true"])
    engine = HFRollout(model, cfg["rollout"], tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=False)
    prompts = make_prompts(tokenizer, TEXTS)
    prompts.meta_info.update(n=2, eos_token_id=EOS_THIRD)
    data = engine.generate_sequences(prompts)
    routed = data.batch["routed_experts"]
    tp = data.batch["prompts"].shape[1]
    moved = routed.clone()
    moved[:, tp:tp + 3] = torch.where(routed[:, tp:tp + 3] >= 0, (routed[:, tp:tp + 3] + 1) % 8, routed[:, tp:tp + 3])
    perturbed = DataProto.from_dict(tensors={**{k: v for k, v in data.batch.items()}, "routed_experts": moved})
    return data, perturbed


def _log_probs(engine, data, micro: MicroBatching, **asked) -> dict[str, torch.Tensor]:
    keys = ["input_ids", "attention_mask", "position_ids", "responses"]
    keys += ["routed_experts"] if "routed_experts" in data.batch.keys() else []
    return engine.infer_batch(data.select(batch_keys=keys), LogProbs(**asked), micro)


MICRO_BATCHINGS = [MicroBatching(size=1), MicroBatching(size=2), MicroBatching(size=3),
                   MicroBatching(size=None, max_token_len=64)]


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_replayed_log_probs_do_not_depend_on_micro_batching_or_packing(process_group, tiny_moe_dir, rollout_batch,
                                                                       remove_padding):
    data, perturbed = rollout_batch
    engine = _engine(tiny_moe_dir, use_remove_padding=remove_padding)
    mask = data.batch["response_mask"].bool()
    own = _log_probs(engine, data.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"]),
                     MicroBatching(size=2))["log_probs"]
    # the rollout's own routing replayed: the trainer's log-probs, as the teacher-forced routing is the same in fp32
    same = _log_probs(engine, data, MicroBatching(size=2))["log_probs"]
    torch.testing.assert_close(same[mask], own[mask], atol=1e-5, rtol=0)
    outs = [_log_probs(engine, perturbed, micro) for micro in MICRO_BATCHINGS]
    for out in outs[1:]:
        torch.testing.assert_close(out["log_probs"][mask], outs[0]["log_probs"][mask], atol=1e-5, rtol=0)
        assert torch.equal(out["routing_changed_tokens"], outs[0]["routing_changed_tokens"])
    assert float((outs[0]["log_probs"] - own)[mask].abs().max()) > 1e-3  # the replayed routing was used
    # every rerouted token is a response token with a record, rerouted in every layer: counted exactly
    tp = data.batch["prompts"].shape[1]
    rerouted = (perturbed.batch["routed_experts"][:, tp:] != data.batch["routed_experts"][:, tp:]).any(-1).any(-1)
    assert outs[0]["routing_changed_tokens"].tolist() == rerouted.sum(-1).float().tolist()
    recorded = (data.batch["routed_experts"][:, tp:] >= 0).all(-1).all(-1)
    assert outs[0]["routing_counted_tokens"].tolist() == recorded.sum(-1).float().tolist()


@pytest.mark.parametrize("single_rank", ["auto", "fsdp"], ids=["plain", "fully_shard"])
def test_the_update_forward_replays_the_batch_routing(process_group, tiny_moe_dir, rollout_batch, single_rank):
    """The log-probs the loss sees in the first (only) mini-batch, before the optimiser step, are the replayed ones."""
    _, perturbed = rollout_batch
    engine = _engine(tiny_moe_dir, single_rank)
    assert isinstance(engine.module, FSDPModule) == (single_rank == "fsdp")
    replayed = _log_probs(engine, perturbed, MicroBatching(size=8))["log_probs"]
    seen = []

    def loss(outputs, batch, info):
        seen.append(outputs["log_probs"].detach())
        return LossOutput(-(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"], {}, {})

    keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "routed_experts"]
    engine.train_batch(perturbed.select(batch_keys=keys), LogProbs(), loss,
                       UpdatePlan(mini_batch_size=8, micro=MicroBatching(size=2)))
    mask = perturbed.batch["response_mask"].bool()
    torch.testing.assert_close(torch.cat(seen)[mask], replayed[mask], atol=1e-5, rtol=0)
    assert rr.routing_replay_of(engine.module).mode is None  # the replay ends with the call


def _gradients(engine, data) -> dict[str, torch.Tensor]:
    """The gradients of one update (read in the optimiser's pre-step hook)."""
    grads = {}

    def keep(optimizer, *_):
        grads.update({n: p.grad.detach().clone() for n, p in engine.module.named_parameters() if p.grad is not None})

    handle = engine.optimizer.register_step_pre_hook(keep)
    keys = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask", "routed_experts"]
    nll = lambda out, batch, info: LossOutput(  # noqa: E731
        -(out["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"], {}, {})
    engine.train_batch(data.select(batch_keys=keys), LogProbs(), nll, UpdatePlan(mini_batch_size=8, micro=MicroBatching(size=4)))
    handle.remove()
    return grads


def test_gradient_checkpointing_recomputes_with_the_replayed_routing(process_group, tiny_moe_dir, rollout_batch):
    """A checkpointed layer's forward runs again in backward: it must route as the forward did, or the
    gradients would be those of another function (the replay stays set until the call ends)."""
    _, perturbed = rollout_batch
    plain = _gradients(_engine(tiny_moe_dir), perturbed)
    checkpointed = _gradients(_engine(tiny_moe_dir, gradient_checkpointing=True), perturbed)
    routers = [n for n in plain if n.endswith("gate.weight")]
    assert routers and all(float(plain[n].abs().sum()) > 0 for n in routers)
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("remove_padding", [False, True], ids=["padded", "packed"])
def test_r2_records_the_routing_on_the_batch_grid(process_group, tiny_moe_dir, rollout_batch, remove_padding):
    data, _ = rollout_batch
    engine = _engine(tiny_moe_dir, use_remove_padding=remove_padding)
    plain = data.select(batch_keys=["input_ids", "attention_mask", "position_ids", "responses"])
    recorded = _log_probs(engine, plain, MicroBatching(size=3), routed_experts=True)["routed_experts"]
    rollout = data.batch["routed_experts"]
    assert recorded.shape == rollout.shape
    real = data.batch["attention_mask"].bool()
    assert bool((recorded[~real] == rr.NO_EXPERT).all())
    # where the rollout fed the token, the trainer's fp32 forward chose the same experts
    fed = (rollout >= 0).all(-1).all(-1)
    assert torch.equal(recorded[fed].long().sort(-1).values, rollout[fed].long().sort(-1).values)
    assert bool((recorded[real] >= 0).all())  # the trainer routes every real token, the last response one too
