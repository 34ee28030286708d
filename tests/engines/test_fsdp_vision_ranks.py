"""The FSDP engine on a vision-language model over two gloo ranks (CPU) against one rank: the same
log-probs for an image batch (each rank forwards its rows with their own pixel inputs) and the same
update. The same for a vision-language critic's values (``models/vision_value.py``). One two-rank job per role
computes both batches' numbers; it runs once per module."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import (
    LogProbs,
    LossOutput,
    MicroBatching,
    UpdatePlan,
    Values,
)
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.protocol import DataProto
from tests import rank_server
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.engines.test_fsdp_vision import image_batch  # noqa: F401 - fixture
from tests.workers import assert_same_gradients, first_step_gradients, reassociation_bound, vocab_rows
from tests.workers.test_critic_vision import vlm_critic_dir  # noqa: F401 - fixture


def _nll(outputs, batch, info) -> LossOutput:
    """Token-mean NLL over the mini-batch (divided by the mini-batch-wide count, times dp_size)."""
    loss = -(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"] * info["dp_size"]
    return LossOutput(loss, {"actor/loss": float(loss.detach())}, {})


def _squared_error(outputs, batch, info) -> LossOutput:
    """A critic's token-mean squared error to fixed targets (the mini-batch-wide count, times dp_size)."""
    err = (outputs["values"] - batch["response_mask"].float()) ** 2 * batch["response_mask"]
    loss = err.sum() / info["batch_num_tokens"] * info["dp_size"]
    return LossOutput(loss, {"actor/loss": float(loss.detach())}, {})


# the actor's log-probs, or a vision-language critic's values (models/vision_value.py)
ROLES = {"actor": ("causal_lm", LogProbs(entropy=True), _nll, ("log_probs", "entropy")),
         "critic": ("token_classification", Values(), _squared_error, ("values",))}


def _compute(model_dir, batches: dict[str, DataProto], role: str = "actor") -> dict:
    """Per batch (this rank's rows): outputs at micro-batch 1 and 2, then one update's metrics and weights."""
    kind, output, loss_fn, keys = ROLES[role]
    out = {}
    for name, data in batches.items():
        engine = FSDPEngine.build(FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0,
                                                   cpu_kernels="off", optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                                                   model_kind=kind), "cpu", role="actor")
        got = {mb: engine.infer_batch(data, output, MicroBatching(mb)) for mb in (1, 2)}
        metrics = engine.train_batch(data, output, loss_fn, UpdatePlan(mini_batch_size=len(data),
                                                                       micro=MicroBatching(1)))
        out[name] = {**{k: got[1][k] for k in keys}, f"{keys[0]}_mb2": got[2][keys[0]], "metrics": dict(metrics),
                     "grads": first_step_gradients(engine.optimizer, engine.module),  # gathered on every rank
                     "tokens": int(data.batch["attention_mask"].numel())}
    return out


def _rank_main(rank: int, store: str, result: str, model_dir, batches: dict[str, DataProto], role: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.save(_compute(model_dir, {name: data.chunk(2)[rank] for name, data in batches.items()}, role),
               f"{result}.{rank}")  # each rank its own rows' numbers and the (gathered) weights
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


def _one_and_two_ranks(model_dir, image_batch, tmp, role: str):
    # "images": rank 0 a one- and a two-image row, rank 1 two one-image rows of other sizes. "mixed":
    # rank 1's first micro-batch is the text row while rank 0's holds an image: the tower must still run
    # there (idle_vision_tower), or the ranks' collectives part and gloo aborts
    batches = {"images": image_batch.select_idxs([0, 1, 3, 0]), "mixed": image_batch.select_idxs([0, 1, 2, 3])}
    rank_server.run(_rank_main, args=(str(tmp / "store"), str(tmp / "out.pt"), model_dir, batches, role), nprocs=2)
    return _compute(model_dir, batches, role), [torch.load(f"{tmp / 'out.pt'}.{r}") for r in (0, 1)]


@pytest.fixture(scope="module")
def both(tiny_vlm_dir, image_batch, tmp_path_factory, process_group):  # noqa: F811
    return _one_and_two_ranks(tiny_vlm_dir, image_batch, tmp_path_factory.mktemp("vision-ranks"), "actor")


@pytest.fixture(scope="module")
def both_critic(vlm_critic_dir, image_batch, tmp_path_factory, process_group):  # noqa: F811
    return _one_and_two_ranks(vlm_critic_dir, image_batch, tmp_path_factory.mktemp("vision-critic-ranks"), "critic")


@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("name", ["images", "mixed"])
@pytest.mark.numerics
def test_two_ranks_give_the_outputs_and_update_of_one(request, role, name):
    """The actor's log-probs and entropies, or a vision-language critic's values (its own idle tower for a
    text micro-batch), and one update: two ranks give one rank's numbers."""
    both = request.getfixturevalue("both" if role == "actor" else "both_critic")
    keys = ROLES[role][3]
    single, ranks = both[0][name], [part[name] for part in both[1]]
    for key in (*keys, f"{keys[0]}_mb2"):  # fp32 rounding only
        torch.testing.assert_close(torch.cat([p[key] for p in ranks]), single[key], atol=1e-5, rtol=0, msg=key)
    assert single[keys[0]].abs().sum() > 0
    for part in ranks:  # both ranks report the group's numbers
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert part["metrics"]["actor/loss"] == pytest.approx(single["metrics"]["actor/loss"], rel=1e-5)
        assert part["metrics"]["actor/grad_norm"] == pytest.approx(single["metrics"]["actor/grad_norm"], rel=1e-4)
    # The gradients of the one Adam step, not the weights after it: Adam moves each weight by ~lr = 1e-2
    # whatever its gradient's size, so a gradient at fp32 rounding level may move it anywhere in [-lr, lr]
    # (#51; as in tests/engines/test_ulysses.py); a wrongly reduced one (a rank's rows lost, an idle tower
    # skipped) is off by O(1) normwise
    vocab = vocab_rows(single["grads"])
    bound = reassociation_bound(vocab, single["tokens"])
    assert_same_gradients(ranks[0]["grads"], single["grads"], bound, f"{role} {name}")
    for k, g in ranks[0]["grads"].items():
        assert torch.equal(ranks[1]["grads"][k], g), k  # one optimiser state, gathered on both
