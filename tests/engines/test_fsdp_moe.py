"""Mixture-of-experts models through the FSDP engine (``engines/fsdp/moe.py``, ``models/moe.py``): the router
losses join the update the same whatever the micro-batches, the layout (padding never counts) and the
ranks; the metrics come from the update's own forward; the experts run as grouped matrix products;
DeepSeek-V3 (shared experts, grouped routing) and GPT-OSS train."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.tiny import save_tiny_model
from rlfoundry.protocol import DataProto
from tests import rank_server
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.workers import first_step_gradients

# large coefficients, so that a wrongly scaled router loss shows in the gradients
LOSSES_ON = {"output_router_logits": True, "router_aux_loss_coef": 0.5, "router_z_loss_coef": 0.1}


def _batch(rows: int = 4, tp: int = 5, tr: int = 6) -> DataProto:
    """Left-padded prompts, right-padded responses of several lengths (padding in both places)."""
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, 200, (rows, tp), generator=gen)
    responses = torch.randint(3, 200, (rows, tr), generator=gen)
    mask = torch.ones(rows, tp + tr, dtype=torch.long)
    mask[0, tp + 3:] = 0
    mask[1, :2] = 0
    mask[2, tp + 1:] = 0
    return DataProto.from_dict(tensors={
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": mask,
        "position_ids": (mask.cumsum(-1) - 1).clamp(min=0), "responses": responses,
        "response_mask": mask[:, tp:].clone(),
    })


def _nll(outputs, batch, info) -> LossOutput:
    loss = -(outputs["log_probs"] * batch["response_mask"]).sum() / info["batch_num_tokens"] * info["dp_size"]
    return LossOutput(loss, {"sft/loss": loss.detach()}, {})


def _engine(model_dir, override=None, **fields) -> FSDPEngine:
    config = FSDPEngineConfig(path=str(model_dir), fsdp=fields.pop("fsdp", FSDPConfig()), grad_clip=1e9,
                              cpu_kernels="off", optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                              override_config=dict(override or {}), **fields)
    return FSDPEngine.build(config, "cpu", role="sft")


def _step(model_dir, data: DataProto, micro: int | MicroBatching, override=None, **fields) -> tuple[dict, dict]:
    """One update: its metrics and the gradients it took."""
    engine = _engine(model_dir, override, **fields)
    micro = micro if isinstance(micro, MicroBatching) else MicroBatching(micro)
    metrics = engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=len(data), micro=micro))
    return metrics, first_step_gradients(engine.optimizer, engine.module)


def _router_grads(grads: dict) -> dict:
    return {k: v for k, v in grads.items() if k.endswith("mlp.gate.weight") or k.endswith("mlp.router.weight")}


@pytest.mark.numerics
def test_router_losses_give_the_same_update_for_any_micro_batch_size(process_group, tiny_moe_dir):
    """Per-sequence losses summed over the mini-batch's sequences: micro-batches of 1 and 2 rows take the
    same gradient (1e-6: fp32 rounding of sums in another order) and report the same losses; the losses
    do move the routers (their gradient is far from the one without them)."""
    data = _batch()
    m1, g1 = _step(tiny_moe_dir, data, 1, LOSSES_ON)
    m2, g2 = _step(tiny_moe_dir, data, 2, LOSSES_ON)
    for key in ("moe/aux_loss", "moe/z_loss", "sft/loss"):
        assert m1[key] == pytest.approx(m2[key], abs=1e-6), key
    for name, grad in g2.items():
        torch.testing.assert_close(g1[name], grad, atol=1e-6, rtol=0, msg=name)
    _, plain = _step(tiny_moe_dir, data, 2)
    routers = _router_grads(g2)
    assert len(routers) == 2
    for name, grad in routers.items():  # 0.5 × the balance loss + 0.1 × z: an O(1) change of the router's gradient
        assert (grad - plain[name]).norm() > 0.1 * plain[name].norm(), name


@pytest.mark.numerics
def test_gradient_checkpointing_and_token_budgets_take_the_same_update(process_group, tiny_moe_dir):
    """The router losses' gradient reaches the routers through checkpointed layers (recomputed in backward,
    where the hooks record nothing), and token-budget micro-batches (rows regrouped by length) give the
    same update as fixed ones."""
    data = _batch()
    want, g_want = _step(tiny_moe_dir, data, 2, LOSSES_ON)
    for fields, micro in (({"gradient_checkpointing": True}, 2), ({}, MicroBatching(max_token_len=24))):
        got, g_got = _step(tiny_moe_dir, data, micro, LOSSES_ON, **fields)
        for key in ("moe/aux_loss", "moe/z_loss", "moe/layer0/load_max"):
            assert got[key] == pytest.approx(want[key], abs=1e-6), (fields, micro, key)
        for name, grad in g_want.items():
            torch.testing.assert_close(g_got[name], grad, atol=1e-6, rtol=0, msg=f"{fields} {micro} {name}")


@pytest.mark.numerics
def test_padding_does_not_count_padded_and_packed_forwards_agree(process_group, tiny_moe_dir):
    """The padded forward routes every padding slot too, the packed one only real tokens: the losses,
    the router metrics and the update are the same, so the padding is left out."""
    data = _batch()
    padded, g_padded = _step(tiny_moe_dir, data, 2, LOSSES_ON)
    packed, g_packed = _step(tiny_moe_dir, data, 2, LOSSES_ON, use_remove_padding=True)
    moe_keys = [k for k in padded if k.startswith("moe/")]
    assert "moe/layer1/load_cv" in moe_keys and len(moe_keys) == 2 + 2 * 4
    for key in moe_keys:
        assert padded[key] == pytest.approx(packed[key], abs=1e-5), key
    for name, grad in _router_grads(g_padded).items():
        torch.testing.assert_close(g_packed[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.numerics
def test_rows_sharing_a_prompt_take_the_update_of_rows_run_apart(process_group, tiny_moe_dir):
    """Two prompts of 12 tokens, two short responses each: the shared-prompt forward runs each prompt once
    (two router calls per layer: the prompts, then the responses from their KV cache) and its losses,
    metrics and gradients are those of every row run on its own."""
    data = _batch(rows=3, tp=12, tr=4).select_idxs([0, 0, 1, 1])
    data.batch["response_mask"][1, 2:] = 0  # the two samples of a prompt differ in length
    data.batch["attention_mask"][1, 14:] = 0
    apart, g_apart = _step(tiny_moe_dir, data, 4, LOSSES_ON)
    engine = _engine(tiny_moe_dir, LOSSES_ON, use_shared_prompt=True)
    calls = []
    engine.module.model.layers[0].mlp.gate.register_forward_hook(lambda _m, _a, out: calls.append(out[0].shape[0]))
    shared = engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=4, micro=MicroBatching(4)))
    assert calls == [2 * 12, 4 * 4]  # the path taken: each prompt's 12 columns once, then the 4 responses
    g_shared = first_step_gradients(engine.optimizer, engine.module)
    for key in [k for k in apart if k.startswith("moe/")]:
        assert shared[key] == pytest.approx(apart[key], abs=1e-5), key
    for name, grad in g_apart.items():
        torch.testing.assert_close(g_shared[name], grad, atol=1e-5, rtol=0, msg=name)


def test_the_update_runs_the_experts_as_grouped_matrix_products(process_group, tiny_moe_dir):
    """Built with transformers' eager loop asked for, the engine's update still calls the grouped kernel
    (aten::_grouped_mm: 2 per layer forward (up and down projections), more in backward)."""
    engine = _engine(tiny_moe_dir, {"_experts_implementation": "eager"})
    assert engine.module.config._experts_implementation == "grouped_mm"
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        engine.train_batch(_batch(), LogProbs(), _nll, UpdatePlan(mini_batch_size=4, micro=MicroBatching(4)))
    calls = {e.key: e.count for e in prof.key_averages() if "grouped_mm" in e.key}
    assert calls.get("aten::_grouped_mm", 0) >= 4, calls  # torch's own kernel, not transformers' fallback


def _moe_dir(tmp_path_factory, arch: str):
    return save_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch=arch)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_other_families_train_one_update_with_router_losses(process_group, tmp_path_factory, arch):
    """Qwen2-MoE (a gated shared expert), DeepSeek-V3 (MLA, a dense first layer, a shared expert, grouped
    routing) and GPT-OSS (sliding windows, sinks, biased experts): one update moves the routed experts, and
    the metrics cover exactly the routed layers (DeepSeek-V3's layer 0 is dense)."""
    model_dir = _moe_dir(tmp_path_factory, arch)
    metrics, grads = _step(model_dir, _batch(), 2, LOSSES_ON)
    layers = sorted({k.split("/")[1] for k in metrics if k.startswith("moe/layer")})
    assert layers == (["layer1"] if arch == "deepseek_v3" else ["layer0", "layer1"])
    experts = [g for k, g in grads.items() if "experts" in k and "shared" not in k]
    assert experts and all(g.abs().sum() > 0 for g in experts)
    assert metrics["moe/aux_loss"][0] > 0 and metrics["sft/nan_skipped"] == [0.0]


def test_router_metrics_of_a_router_set_by_hand(process_group, tmp_path_factory):
    """GPT-OSS's router has a bias: with its weights 0 every token's logits are the bias, here
    log(0.4, 0.3, 0.05 × 6), so every real token takes experts 0 and 1 and the update's metrics are
    known by hand: shares (1/2, 1/2, 0 × 6) × N=8 → load_max 4, load_min 0; cv = std/mean =
    sqrt(2·(1/2)²/8 − (1/8)²) / (1/8) = sqrt(3); routing entropy −(0.4 ln 0.4 + 0.3 ln 0.3 + 0.3 ln 0.05)."""
    import math

    from transformers import AutoModelForCausalLM

    model_dir = _moe_dir(tmp_path_factory, "gpt_oss")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    probs = torch.tensor([0.4, 0.3] + [0.05] * 6)
    for layer in model.model.layers:
        layer.mlp.router.weight.data.zero_()
        layer.mlp.router.bias.data.copy_(probs.log())
    model.save_pretrained(model_dir)
    metrics, _ = _step(model_dir, _batch(), 2)
    entropy = -(0.4 * math.log(0.4) + 0.3 * math.log(0.3) + 0.3 * math.log(0.05))
    for i in (0, 1):
        assert metrics[f"moe/layer{i}/load_max"][0] == pytest.approx(4.0, abs=1e-6)
        assert metrics[f"moe/layer{i}/load_min"][0] == pytest.approx(0.0, abs=1e-6)
        assert metrics[f"moe/layer{i}/load_cv"][0] == pytest.approx(math.sqrt(3), abs=1e-6)
        assert metrics[f"moe/layer{i}/routing_entropy"][0] == pytest.approx(entropy, abs=1e-5)


def test_router_loss_keys_that_would_do_nothing_are_start_up_errors(process_group, tiny_moe_dir, tiny_model_dir):
    with pytest.raises(ValueError, match="ulysses_sequence_parallel_size"):
        _engine(tiny_moe_dir, LOSSES_ON, use_remove_padding=True, ulysses_sequence_parallel_size=2)
    with pytest.raises(ValueError, match="no routed experts"):
        _engine(tiny_model_dir, {"output_router_logits": True})  # a dense Qwen2
    with pytest.raises(ValueError, match="output_router_logits=true"):
        _engine(tiny_moe_dir, {"router_z_loss_coef": 0.1})


# ---- two ranks -------------------------------------------------------------------------------

def _rank_main(rank: int, store: str, result: str, model_dir, data: DataProto) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    metrics, grads = _step(model_dir, data.chunk(2)[rank], 1, LOSSES_ON)
    params = _engine(model_dir).module.named_parameters()
    experts = {n: (tuple(p.to_local().shape), tuple(p.placements)) for n, p in params if ".experts." in n}
    torch.save((metrics, grads, experts), f"{result}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


@pytest.mark.numerics
def test_two_ranks_take_the_update_of_one(process_group, tiny_moe_dir, tmp_path):
    """FSDP2 over two gloo ranks (each half the rows, the experts' 3-D weights sharded on the expert dim)
    against one rank wrapped in FSDP2: the same router losses and gradients (1e-5: the ranks' sums
    reduced in another order)."""
    data = _batch()
    rank_server.run(_rank_main, args=(str(tmp_path / "store"), str(tmp_path / "out.pt"), tiny_moe_dir, data),
                    nprocs=2)
    ranks = [torch.load(f"{tmp_path / 'out.pt'}.{r}") for r in (0, 1)]
    single, grads = _step(tiny_moe_dir, data, 2, LOSSES_ON, fsdp=FSDPConfig(single_rank="fsdp"))
    for metrics, rank_grads, experts in ranks:
        # FSDP2's dim-0 sharding of a (N, 2I, H) expert weight is a split by expert: 4 of the 8 at rest per rank
        # (a forward still gathers all 8: docs/moe.md, expert parallelism)
        assert experts and all(shape[0] == 4 and placements == (Shard(0),) for shape, placements in experts.values())
        for key in ("moe/aux_loss", "moe/z_loss", "sft/loss"):
            assert metrics[key] == pytest.approx(single[key], abs=1e-5), key
        for name, grad in grads.items():
            torch.testing.assert_close(rank_grads[name], grad, atol=1e-5, rtol=0, msg=name)
