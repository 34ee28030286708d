"""MoE routing replay on the Megatron engine (``engines/megatron/routing.py``): megatron-core's RouterReplay
routes each token to the batch's ``routed_experts`` in the log-prob and update forwards, as the FSDP engine's
hooks do, at EP=1, EP=2, PP=2 and TP=2 (with sequence parallelism: each TP rank routes its slice of the
positions); R2's record comes back on the batch grid and the update replays it.

The routing replayed is a real one moved: the tiny Qwen3-MoE's own (recorded by the FSDP engine), with the
first three response tokens of every row sent to the next experts (mod 8) in every layer, so a replay that
is ignored, or given to the wrong tokens or layers, moves log-probs by ~1e-2 (asserted > 1e-3)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

KEYS = ["input_ids", "attention_mask", "position_ids", "responses"]
MICRO = 2  # rows per micro-batch: the 4 rows of a rank go through two model calls


def _batch(routing=None):
    from rlfoundry.protocol import DataProto
    from tests.engines.test_megatron_model import _batch as padded_rows

    parts = [padded_rows(seed=s) for s in (0, 1)]
    tensors = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    if routing is not None:
        tensors["routed_experts"] = routing
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


def _moved(routing: torch.Tensor, width: int) -> torch.Tensor:
    """The first three response tokens with a record routed to the next experts in every layer."""
    start = routing.shape[1] - width
    moved = routing.clone()
    part = routing[:, start:start + 3]
    moved[:, start:start + 3] = torch.where(part >= 0, (part + 1) % 8, part)
    return moved


def _passes(engine, data, moved):
    """Own, recorded (R2) and replayed log-probs of one engine, in ``data``'s rows."""
    from rlfoundry.engines.base import LogProbs, MicroBatching

    micro = MicroBatching(size=MICRO)
    recorded = engine.infer_batch(data.select(batch_keys=KEYS), LogProbs(routed_experts=True), micro)
    replayed = engine.infer_batch(moved.select(batch_keys=[*KEYS, "routed_experts"]), LogProbs(), micro)
    return {"own": recorded["log_probs"], "recorded": recorded["routed_experts"], **replayed}


def _fsdp(rank: int, model_dir: str):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.base import LogProbs, MicroBatching
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig

    engine = FSDPEngine.build(FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=None, grad_clip=None,
                                               cpu_kernels="off"), "cpu")
    data = _batch()

    routing = engine.infer_batch(data.select(batch_keys=KEYS), LogProbs(routed_experts=True),
                                 MicroBatching(size=MICRO))["routed_experts"]
    moved = _batch(_moved(routing, data.batch["responses"].shape[1]))
    return {**_passes(engine, data, moved), "moved": moved.batch["routed_experts"]}


def _megatron(rank: int, model_dir: str, moved: torch.Tensor, ep: int, pp: int, tp: int = 1):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig, OptimConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    megatron = MegatronConfig(expert_model_parallel_size=ep, pipeline_model_parallel_size=pp, dtype="float32",
                              tensor_model_parallel_size=tp)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, OptimConfig(lr=1e-2, weight_decay=0.0), None), "cpu")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    data, replay = _batch(), _batch(moved)
    out = _passes(engine, data.chunk(dp)[dp_rank], replay.chunk(dp)[dp_rank])
    r2 = _r2_update(engine, data, out["recorded"]) if dp == 1 and pp == 1 else {}
    return {**out, "dp": dp, "dp_rank": dp_rank, "r2": r2, "sequence_parallel": engine.sequence_parallel}


def _r2_update(engine, data, recorded):
    """R2: the routers are moved after the record (as an update would move them); the update's forward
    still routes by the record. Returns what its loss saw, the replayed and the router's own log-probs."""
    from megatron.core.transformer.moe.router import TopKRouter

    from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan

    g = torch.Generator().manual_seed(5)
    for module in engine.module.modules():
        if isinstance(module, TopKRouter):
            module.weight.data.add_(torch.randn(module.weight.shape, generator=g))
    width = data.batch["responses"].shape[1]
    batch = _batch(recorded)
    batch.batch["response_mask"] = batch.batch["attention_mask"][:, -width:]
    own = engine.infer_batch(data.select(batch_keys=KEYS), LogProbs(), MicroBatching(size=MICRO))["log_probs"]
    replayed = engine.infer_batch(batch.select(batch_keys=[*KEYS, "routed_experts"]), LogProbs(), MicroBatching(size=MICRO))
    seen = []

    def loss(outputs, micro, info):
        seen.append(outputs["log_probs"].detach())
        return LossOutput(-(outputs["log_probs"] * micro["response_mask"]).sum() / info["batch_num_tokens"], {}, {})

    engine.train_batch(batch.select(batch_keys=[*KEYS, "routed_experts", "response_mask"]), LogProbs(), loss,
                       UpdatePlan(mini_batch_size=8, micro=MicroBatching(size=MICRO)))
    return {"seen": torch.cat(seen), "own": own, **replayed}


@pytest.fixture(scope="module")
def fsdp(tiny_moe_dir, tmp_path_factory):
    [out] = run_ranks(_fsdp, 1, tmp_path_factory.mktemp("fsdp"), args=(str(tiny_moe_dir),))
    return out


def _check_equals_fsdp(results, fsdp):
    data = _batch()
    mask = data.batch["attention_mask"][:, -data.batch["responses"].shape[1]:].bool()
    # the replayed routing was used: it moves the log-probs of the rerouted tokens and those after them
    assert float((fsdp["log_probs"] - fsdp["own"])[mask].abs().max()) > 1e-3
    for r in results:
        rows = slice(r["dp_rank"] * 8 // r["dp"], (r["dp_rank"] + 1) * 8 // r["dp"])
        # fp32 rounding of the same sums in another order (the tolerance of test_megatron_moe.py)
        torch.testing.assert_close(r["log_probs"][mask[rows]], fsdp["log_probs"][rows][mask[rows]], atol=1e-5, rtol=0)
        torch.testing.assert_close(r["own"][mask[rows]], fsdp["own"][rows][mask[rows]], atol=1e-5, rtol=0)
        # the record: the same experts at every real token (order within top-k aside), -1 at padding
        assert torch.equal(r["recorded"].sort(-1).values, fsdp["recorded"][rows].long().sort(-1).values)
        assert torch.equal(r["routing_changed_tokens"], fsdp["routing_changed_tokens"][rows])
        assert torch.equal(r["routing_counted_tokens"], fsdp["routing_counted_tokens"][rows])


def test_replay_equals_fsdp(tiny_moe_dir, tmp_path, fsdp):
    """EP=1, one rank: log-probs under the moved routing equal the FSDP engine's under it; the record and the
    routing-change counts too (3 rerouted tokens in each row whose response has 3 with a record)."""
    assert fsdp["routing_changed_tokens"].tolist() == [3.0] * 8
    results = run_ranks(_megatron, 1, tmp_path, args=(str(tiny_moe_dir), fsdp["moved"], 1, 1))
    _check_equals_fsdp(results, fsdp)
    _check_r2(results[0]["r2"])


def _check_r2(r2):
    """R2 (the same run): the routers moved after the record would reroute some response tokens; the
    update's forward saw the record's routing, not theirs."""
    mask = _batch().batch["attention_mask"][:, -5:].bool()
    assert float(r2["routing_changed_tokens"].sum()) > 0
    torch.testing.assert_close(r2["seen"][mask], r2["log_probs"][mask], atol=1e-5, rtol=0)
    assert float((r2["log_probs"] - r2["own"])[mask].abs().max()) > 1e-3


@pytest.mark.parametrize("ep, pp", [(2, 1), (1, 2)], ids=["ep2", "pp2"])
def test_replay_at_ep2_and_pp2_equals_fsdp(tiny_moe_dir, tmp_path, fsdp, ep, pp):
    """EP=2 × DP=2: each rank replays its own rows' routing before the dispatch sends tokens to the other
    rank's experts; PP=2: each stage its own layer of the two, the record and counts joined over the stages."""
    results = run_ranks(_megatron, 2, tmp_path, ep=ep, pp=pp, args=(str(tiny_moe_dir), fsdp["moved"], ep, pp))
    assert [r["dp"] for r in results] == [ep, ep]
    _check_equals_fsdp(results, fsdp)


def test_replay_at_tp2_with_sequence_parallelism_equals_fsdp(tiny_moe_dir, tmp_path, fsdp):
    """TP=2 with sequence parallelism (11-token rows padded to 12): each TP rank's routers see its 6 positions
    of every row, the replay hands each its slice of the record and the record comes back whole; R2's update
    at TP=2 routes by the record."""
    results = run_ranks(_megatron, 2, tmp_path, tp=2, args=(str(tiny_moe_dir), fsdp["moved"], 1, 1, 2))
    assert [(r["dp"], r["sequence_parallel"]) for r in results] == [(1, True), (1, True)]
    _check_equals_fsdp(results, fsdp)
    for r in results:
        _check_r2(r["r2"])


@pytest.mark.heavy  # 4 ranks; CI runs TP=2 and EP=2 apart
def test_replay_at_tp2_ep2_equals_fsdp(tiny_moe_dir, tmp_path, fsdp):
    """TP=2 × EP=2 × DP=2 on 4 ranks: each TP rank replays its sequence slice of its data-parallel rank's
    rows, before the dispatcher sends the tokens over the expert-parallel pair (the two DP ranks)."""
    results = run_ranks(_megatron, 4, tmp_path, tp=2, ep=2, args=(str(tiny_moe_dir), fsdp["moved"], 2, 1, 2))
    assert [(r["dp"], r["sequence_parallel"]) for r in results] == [(2, True)] * 4
    _check_equals_fsdp(results, fsdp)


FULL = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
SELECTIVE = {"recompute_granularity": "selective", "recompute_modules": ["moe"]}  # the whole MoE layer


def _update(rank: int, model_dir: str, moved: torch.Tensor, replay: bool, recompute: dict, pp: int):
    """One update of the Megatron engine on the moved routing (replayed or not), with or without full
    activation recompute: the grad norm and the weights after the step, by name."""
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig, OptimConfig
    from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    megatron = MegatronConfig(pipeline_model_parallel_size=pp, dtype="float32",
                              override_transformer_config=recompute)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, OptimConfig(lr=1e-2, weight_decay=0.0), None), "cpu")
    batch = _batch(moved)
    batch.batch["response_mask"] = batch.batch["attention_mask"][:, -batch.batch["responses"].shape[1]:]
    keys = [*KEYS, "response_mask", *(["routed_experts"] if replay else [])]

    def loss(outputs, micro, info):
        return LossOutput(-(outputs["log_probs"] * micro["response_mask"]).sum() / info["batch_num_tokens"], {}, {})

    metrics = engine.train_batch(batch.select(batch_keys=keys), LogProbs(), loss,
                                 UpdatePlan(mini_batch_size=8, micro=MicroBatching(size=MICRO)))
    left = sum(len(r.recompute) for _, r in engine._routing.layers)
    weights = {f"{ps.get_pipeline_model_parallel_rank()}.{n}": p.detach().clone()
               for n, p in engine.chunks[0].named_parameters()}
    return {"grad_norm": metrics["actor/grad_norm"][0], "weights": weights, "left": left}


@pytest.mark.parametrize("pp, recompute", [(1, [FULL, SELECTIVE]), (2, [FULL])], ids=["pp1", "pp2"])
def test_replay_under_recompute_equals_no_recompute(tiny_moe_dir, tmp_path, fsdp, pp, recompute):
    """Activation recompute (full, or selective over the MoE layer) runs each MoE layer again in the backward,
    after the micro-batch's forward (and its replay) has ended: the recomputed routers route as the forward
    did, so the update equals the one without recompute; the replay moves the update (without it the test
    could not tell)."""
    def run(replay, overrides, name):
        return run_ranks(_update, pp, tmp_path / name, pp=pp,
                         args=(str(tiny_moe_dir), fsdp["moved"], replay, overrides, pp))

    plain, own = run(True, {}, "plain"), run(False, {}, "own")
    for i, overrides in enumerate(recompute):
        for a, b, c in zip(plain, run(True, overrides, f"recompute{i}"), own):
            assert b["left"] == 0  # every recorded routing was taken by its backward
            assert abs(a["grad_norm"] - b["grad_norm"]) <= 1e-6 * a["grad_norm"], (overrides, a["grad_norm"], b["grad_norm"])
            assert abs(a["grad_norm"] - c["grad_norm"]) > 1e-4 * a["grad_norm"], (a["grad_norm"], c["grad_norm"])
            for name, w in a["weights"].items():
                torch.testing.assert_close(b["weights"][name], w, atol=1e-6, rtol=0, msg=name)
