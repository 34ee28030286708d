"""The training-engine contract, on the FSDP2 engine: built from an HF path, HF-named full weights,
a loss handed in, metrics that do not depend on the split, the plain path as the reference."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.engines.loop import MiniBatchStats
from rlfoundry.protocol import DataProto
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture


def _batch(rows: int = 4, tp: int = 5, tr: int = 6) -> DataProto:
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 200, (rows, tp), generator=gen)
    responses = torch.randint(3, 200, (rows, tr), generator=gen)
    mask = torch.ones(rows, tp + tr, dtype=torch.long)
    mask[0, tp + 3:] = 0  # one response ends early
    response_mask = mask[:, tp:].clone()
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses, "response_mask": response_mask,
    })


def _engine(model_dir, **overrides) -> FSDPEngine:
    trainable = overrides.pop("trainable", True)
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0) if trainable else None, **overrides)
    return FSDPEngine.build(config, "cpu", role="sft")


def _nll(outputs, batch, info) -> LossOutput:
    """Token-mean NLL over the mini-batch: each micro-batch divides by the mini-batch-wide count."""
    mask = batch["response_mask"]
    loss = -(outputs["log_probs"] * mask).sum() / info["batch_num_tokens"] * info["dp_size"]
    return LossOutput(loss, {"sft/loss": float(loss.detach())}, {"sft/mask_mean": float(mask.float().mean())})


def test_iter_hf_weights_gives_the_checkpoint_names_and_values(process_group, tiny_model_dir):
    stored = load_file(str(tiny_model_dir / "model.safetensors"))
    streamed = dict(_engine(tiny_model_dir, trainable=False).iter_hf_weights())
    tied = set(stored) ^ set(streamed)  # a tied LM head may be stored once
    assert tied <= {"lm_head.weight", "model.embed_tokens.weight"}, tied
    for name in set(stored) & set(streamed):
        torch.testing.assert_close(streamed[name], stored[name], atol=0, rtol=0, msg=name)


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.numerics
def test_train_batch_is_the_same_step_for_any_micro_batch_size(process_group, tiny_model_dir, micro):
    """A loss normalised by the engine's global counts: the same loss and gradient (its norm is taken
    before clipping, so a wrongly scaled micro-batch sum would show), whatever the split."""
    data = _batch()
    whole, split = _engine(tiny_model_dir), _engine(tiny_model_dir)
    before = {n: w.clone() for n, w in whole.iter_hf_weights()}
    plan = UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=4))
    m_whole = whole.train_batch(data, LogProbs(), _nll, plan)
    m_split = split.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=micro)))
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms; a
    # micro-batch normalised by its own count is off by >10%
    assert m_whole["sft/loss"] == pytest.approx(m_split["sft/loss"], rel=1e-5)
    assert m_whole["sft/grad_norm"] == pytest.approx(m_split["sft/grad_norm"], rel=1e-4)
    assert m_split["sft/nan_skipped"] == [0.0] and whole.update_calls == 1
    moved = max((w - before[n]).abs().max().item() for n, w in whole.iter_hf_weights())
    assert moved > 1e-3  # the optimiser stepped (Adam: ~lr per weight)


@pytest.mark.numerics
def test_a_frozen_engine_refuses_to_train_and_infers_in_input_order(process_group, tiny_model_dir):
    engine = _engine(tiny_model_dir, trainable=False)
    data = _batch()
    with pytest.raises(RuntimeError, match="without an optimiser"):
        engine.train_batch(data, LogProbs(), _nll, UpdatePlan())
    whole = engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=4))
    budget = engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(max_token_len=22))  # two rows a micro
    for key in ("log_probs", "entropy"):
        # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(budget[key], whole[key], atol=1e-5, rtol=0)
    assert torch.all(whole["log_probs"][0, 3:] == 0)  # padding after the early end


def test_mini_batch_stats_sum_losses_and_token_weight_ratios():
    """Two micro-batches of 3 and 1 counted tokens: losses add; ratios 0.5 and 1.0 weigh 3:1."""
    stats = MiniBatchStats()
    stats.add(LossOutput(torch.zeros(()), {"l": 0.25}, {"r": 0.5}), tokens=3)
    stats.add(LossOutput(torch.zeros(()), {"l": 0.5}, {"r": 1.0}), tokens=1)
    assert stats.reduce(dp_size=1, group=None) == {"l": 0.75, "r": pytest.approx(0.625)}


# ---- a checkpoint while training goes on (two ranks) ----------------------------------------

def _save_then_train_on(rank: int, store: str, out: str, model_dir, data: DataProto) -> None:
    """One update, a save, one more update: rank 0 keeps the weights of the save and of after."""
    import os
    import sys

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    engine, plan, mine = _engine(model_dir), UpdatePlan(mini_batch_size=2, micro=MicroBatching(size=2)), data.chunk(2)[rank]
    engine.train_batch(mine, LogProbs(), _nll, plan)
    engine.save_checkpoint(f"{out}/global_step_1/actor", {})
    saved = {n: w.clone() for n, w in engine.iter_hf_weights()}  # the stream's tensors may be the live parameters
    engine.train_batch(mine, LogProbs(), _nll, plan)
    later = dict(engine.iter_hf_weights())
    if rank == 0:
        torch.save((saved, later), f"{out}/weights.pt")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


def test_training_on_after_a_save_leaves_the_checkpoint_as_saved(tiny_model_dir, tmp_path):
    """DCP shards saved at two ranks, the ranks training on after: the offline export (one process,
    ``rlfoundry export``'s path) has the weights of the moment of the save, bit for bit."""
    from tests import rank_server

    from rlfoundry import checkpoint as ckpt

    rank_server.run(_save_then_train_on, args=(str(tmp_path / "store"), str(tmp_path), tiny_model_dir, _batch()),
                    nprocs=2)
    saved, later = torch.load(tmp_path / "weights.pt")
    assert any(not torch.equal(later[n], w) for n, w in saved.items())  # the later update moved them
    exported = load_file(ckpt.export_hf_from_checkpoint(tmp_path / "global_step_1" / "actor", tmp_path / "hf")
                         / "model.safetensors")
    assert [n for n, w in saved.items() if n in exported and not torch.equal(exported[n], w)] == []
    assert set(saved) - set(exported) <= {"lm_head.weight"}  # a tied head is stored once
