"""Mixture-of-experts on the Megatron engine (``engines/megatron/moe.py``): the tiny Qwen3-MoE (8 experts,
top-2) built from megatron-core's MoE layers (router, all-to-all token dispatcher, SequentialMLP
experts) on CPU processes over gloo, fp32.

- log-probs at EP=1 and at EP=2 (each rank holds 4 experts; the tokens of both data-parallel ranks
  travel to their experts' ranks and back) equal HF's forward;
- the HF -> megatron-core -> HF round trip is exact, in HF's in-memory (fused 3-D) expert layout;
- one actor update (two optimiser steps) at EP=2 × DP=2 gives the FSDP2 engine's weights.

The aux (load-balancing) loss is off on both sides (megatron-core's moe_aux_loss_coeff=0, the
engine's default; HF's output_router_logits=False): the FSDP engine's MoE aux loss is other work.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)


@pytest.fixture(scope="module")
def tiny_moe_4kv_dir(tmp_path_factory):
    """The tiny Qwen3-MoE with 4 key-value heads: megatron-core splits the attention's key-value heads over
    the tensor-parallel ranks without replicating them, so TP=4 needs 4 of them (the shared model has 2)."""
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe-4kv"), arch="qwen3_moe", num_kv_heads=4)


def _log_probs_and_export(rank: int, path: str, batch: dict):
    from rlfoundry.engines.megatron import bridge as mb
    from rlfoundry.engines.megatron.forward import response_logits, run_schedule, vocab_parallel_log_probs

    bridge = mb.build_bridge(path, torch.float32)
    chunks = mb.build_model(bridge)
    mb.load_hf_weights(bridge, chunks, path)
    for chunk in chunks:  # megatron-core's MoE layer refuses TP > 1 without sequence parallelism in training mode
        chunk.eval()

    def outputs(logits, micro):
        log_probs, _, _ = vocab_parallel_log_probs(response_logits(logits, micro["responses"].shape[1]),
                                                   micro["responses"])
        return {"log_probs": log_probs}

    with torch.no_grad():
        [out] = run_schedule(chunks, [batch], outputs, None)
    local_experts = len(chunks[0].decoder.layers[0].mlp.experts.local_experts)
    return {"log_probs": out["log_probs"], "local_experts": local_experts,
            "weights": {k: v.clone() for k, v in mb.export_hf_weights(bridge, chunks)}}


# CI time: one rank (EP=1) is heavy; EP=2 × DP=2 checks the same equality across the expert split. Heavy:
# TP=4 with each expert split over a TP pair (expert_tensor_parallel_size=2), the export gathering the pair
@pytest.mark.parametrize("world, ep, tp, etp", [pytest.param(1, 1, 1, None, marks=pytest.mark.heavy), (2, 2, 1, None),
                                                 pytest.param(4, 1, 4, 2, marks=pytest.mark.heavy)],
                         ids=["ep1", "ep2", "tp4-etp2"])
def test_log_probs_equal_hf_and_export_round_trips(tiny_moe_dir, tiny_moe_4kv_dir, tmp_path, world, ep, tp, etp):
    from transformers import AutoModelForCausalLM

    from tests.engines.test_megatron_model import _batch, _hf_log_probs

    path = str(tiny_moe_4kv_dir if tp == 4 else tiny_moe_dir)
    batch = _batch()
    results = run_ranks(_log_probs_and_export, world, tmp_path, ep=ep, tp=tp, etp=etp, args=(path, batch))
    expected = _hf_log_probs(path, batch)[0]
    real = batch["attention_mask"][:, -batch["responses"].shape[1]:].bool()
    hf = {k: v.detach() for k, v in AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).named_parameters()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in hf  # transformers' fused layout, what the rollout holds
    for r in results:
        assert r["local_experts"] == 8 // ep
        # the same sums in another order (attention, router softmax, expert MLPs): fp32 rounding only; a
        # wrongly routed or weighted token moves its log-prob by ~1e-2
        torch.testing.assert_close(r["log_probs"][real], expected[real], atol=1e-5, rtol=0)
        assert set(r["weights"]) == set(hf)
        for name, tensor in hf.items():  # a copy in and out: bit for bit
            assert torch.equal(r["weights"][name], tensor), name


def _megatron_moe_update(rank: int, model_dir: str, data, ep: int, distributed_optimizer: bool,
                         overrides: dict | None = None, tp: int = 1, etp: int | None = None):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(expert_model_parallel_size=ep, dtype="float32", use_distributed_optimizer=distributed_optimizer,
                              override_transformer_config=dict(overrides or {}), tensor_model_parallel_size=tp,
                              expert_tensor_parallel_size=etp)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]  # what the worker's dispatch hands this data-parallel rank
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO))
    log_probs = actor.compute_log_prob_outputs(mine)["log_probs"]
    metrics = actor.update_policy(mine)
    return {"dp": dp, "dp_rank": dp_rank, "log_probs": log_probs, "metrics": metrics,
            "weights": dict(engine.iter_hf_weights()), "sequence_parallel": engine.sequence_parallel}


def _fsdp_reference(model_dir: str, data, dp: int, tmp_path):
    """The 1-rank FSDP2 engine's log-probs (in ``data``'s row order) and weights after the update that
    ``dp`` data-parallel ranks make: rank r takes rows [r·8/dp, (r+1)·8/dp) and steps on its own
    mini-batches of 4/dp rows (verl's semantics), which one rank does on the rows in this order."""
    from tests.engines.test_megatron_engine import MINI, ROWS, _fsdp_update

    order = torch.arange(ROWS).view(dp, ROWS // MINI, MINI // dp).transpose(0, 1).reshape(-1)
    [(log_probs, metrics, weights, _)] = run_ranks(_fsdp_update, 1, tmp_path, args=(model_dir, data[order]))
    return log_probs[torch.argsort(order)], metrics, weights


# CI time: the distributed optimiser's variant is heavy; the EP=2 resume test runs with it
@pytest.mark.parametrize("distributed_optimizer", [False, pytest.param(True, marks=pytest.mark.heavy)])
def test_actor_update_at_ep2_equals_fsdp(tiny_moe_dir, tmp_path, distributed_optimizer):
    """EP=2 × DP=2: each rank's 4 experts see both ranks' tokens; their gradients stay on their rank
    (expert data parallelism 1), the dense weights' are averaged over the two data-parallel ranks."""
    _check_update_equals_fsdp(str(tiny_moe_dir), tmp_path, ep=2, tp=1, distributed_optimizer=distributed_optimizer)


def test_actor_update_at_tp2_equals_fsdp(tiny_moe_dir, tmp_path):
    """TP=2 (EP=1, expert tensor parallelism = TP), with sequence parallelism (megatron-core's MoE layer
    trains at TP > 1 only with it): each rank routes its half of the positions, the all-to-all dispatcher
    gathers the tokens over the TP group, every expert's MLP is split over the two ranks like the dense
    ones; the router and the norms see half the tokens each, their gradients summed over the ranks."""
    _check_update_equals_fsdp(str(tiny_moe_dir), tmp_path, ep=1, tp=2, distributed_optimizer=False)


@pytest.mark.heavy  # 4 ranks; CI runs TP=2 and EP=2 apart, and ETP=1 with TP=2 on two ranks
@pytest.mark.parametrize("distributed_optimizer", [False, True])
def test_actor_update_at_tp2_ep2_equals_fsdp(tiny_moe_dir, tmp_path, distributed_optimizer):
    """TP=2 × EP=2 on 4 ranks (DP=2; expert tensor parallelism = TP): megatron-core lays the expert
    groups over the dense ones, so each expert-parallel pair spans the two data-parallel ranks and each
    expert is split over the tensor-parallel pair, whose sequence slices the dispatcher gathers."""
    _check_update_equals_fsdp(str(tiny_moe_dir), tmp_path, ep=2, tp=2, world=4,
                              distributed_optimizer=distributed_optimizer)


def test_actor_update_at_tp2_with_whole_experts_equals_fsdp(tiny_moe_dir, tmp_path):
    """TP=2 with expert_tensor_parallel_size=1 (EP=1): the attention and the head are split over the two
    ranks, every expert is whole on both; each rank runs its sequence-parallel slice of the tokens
    through the experts, whose gradients are then summed over the two ranks (the expert data-parallel
    group: dense DP 1, expert DP 2)."""
    _check_update_equals_fsdp(str(tiny_moe_dir), tmp_path, ep=1, tp=2, etp=1, distributed_optimizer=False)


@pytest.mark.heavy  # 4 ranks
def test_actor_update_at_tp2_ep2_with_whole_experts_equals_fsdp(tiny_moe_dir, tmp_path):
    """TP=2, EP=2, expert_tensor_parallel_size=1 on 4 ranks (verl's Qwen3-30B-A3B layout in small): each
    rank holds 4 whole experts; the expert-parallel pair is a tensor-parallel pair."""
    _check_update_equals_fsdp(str(tiny_moe_dir), tmp_path, ep=2, tp=2, etp=1, world=4, distributed_optimizer=True)


@pytest.mark.heavy  # 4 ranks
@pytest.mark.parametrize("ep", [1, 2])
def test_actor_update_at_tp4_with_experts_split_over_tp_pairs_equals_fsdp(tiny_moe_4kv_dir, tmp_path, ep):
    """TP=4 with expert_tensor_parallel_size=2: the attention is split over the four ranks, each expert
    over a pair of them (ranks 0-1 and 2-3, megatron-core's layout), which gathers its two sequence
    slices for it. EP=1: the two pairs' copies of an expert half see different tokens, so their
    gradients are summed over ranks {0, 2} and {1, 3} (expert data parallelism 2, dense 1). EP=2: each
    pair holds 4 of the experts, the tokens of all four slices travel to them (expert data parallelism 1)."""
    _check_update_equals_fsdp(str(tiny_moe_4kv_dir), tmp_path, ep=ep, tp=4, etp=2, world=4, distributed_optimizer=True)


def _check_update_equals_fsdp(model_dir: str, tmp_path, ep: int, tp: int, distributed_optimizer: bool,
                              world: int = 2, etp: int | None = None) -> None:
    from tests.engines.test_megatron_engine import ROWS, _scored_batch

    data = _scored_batch(model_dir)
    dp = world // tp
    ref_lp, ref_metrics, ref_weights = _fsdp_reference(model_dir, data, dp, tmp_path)
    results = run_ranks(_megatron_moe_update, world, tmp_path, tp=tp, ep=ep, etp=etp,
                        args=(model_dir, data, ep, distributed_optimizer, None, tp, etp))
    initial = _hf_parameters(model_dir)
    # the update moved the weights, the experts' included: equality below is not vacuous
    assert (ref_weights["model.layers.0.mlp.experts.gate_up_proj"] - initial["model.layers.0.mlp.experts.gate_up_proj"]
            ).abs().max() > 1e-3
    for r in results:
        assert r["dp"] == dp and r["sequence_parallel"] == (tp > 1)
        rows = ROWS // dp
        torch.testing.assert_close(r["log_probs"], ref_lp[r["dp_rank"] * rows:(r["dp_rank"] + 1) * rows],
                                   atol=1e-5, rtol=0)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        # the tolerance of test_megatron_engine.py (ACTOR's optim.eps bounds a step's change by 10x its
        # gradient's); an expert's gradient on the wrong rank, or scaled by 1/EP, moves its weights ~lr
        assert set(r["weights"]) == set(ref_weights)
        for name, tensor in ref_weights.items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _hf_parameters(model_dir: str) -> dict[str, torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return {k: v.detach() for k, v in model.named_parameters()}


@pytest.mark.parametrize("overrides, message", [
    (["{r}.megatron.expert_model_parallel_size=4"], None),
    (["{r}.megatron.expert_model_parallel_size=3"], "expert_model_parallel_size=3 does not divide the model's 8 experts"),
    (["{r}.megatron.expert_model_parallel_size=2", "{r}.megatron.tensor_model_parallel_size=2",
      "{r}.megatron.expert_tensor_parallel_size=1"], None),
    (["{r}.megatron.tensor_model_parallel_size=4", "{r}.megatron.expert_tensor_parallel_size=2"], None),
    (["{r}.megatron.expert_model_parallel_size=2", "{r}.megatron.expert_tensor_parallel_size=2"],
     "expert_tensor_parallel_size=2 does not divide tensor_model_parallel_size=1"),
    (["{r}.megatron.expert_model_parallel_size=2", "+{r}.megatron.override_transformer_config.moe_token_dispatcher_type=allgather"],
     "allgather dispatcher needs every micro-batch the same length"),
    (["+{r}.megatron.override_transformer_config.moe_token_dispatcher_type=a2a"],
     "megatron-core's dispatchers are ['alltoall', 'allgather', 'flex']"),
    (["{r}.megatron.tensor_model_parallel_size=2", "{r}.megatron.sequence_parallel=false"],
     "sequence_parallel=False at tensor_model_parallel_size=2: megatron-core trains MoE layers"),
])
def test_start_up_checks_name_the_expert_layout_key(tiny_moe_dir, overrides, message):
    """What the MoE model cannot run with is a start-up error naming the key (read from the model's
    config.json at load, before any worker starts); a layout it can run with loads."""
    from rlfoundry.trainer.config import ConfigError, load_config

    argv = ["actor_rollout_ref.actor.strategy=megatron", "trainer.save_freq=-1", "trainer.n_gpus_per_node=8",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", f"actor_rollout_ref.model.path={tiny_moe_dir}",
            *(o.format(r=r) for r in ("actor_rollout_ref.actor", "actor_rollout_ref.ref") for o in overrides)]
    if message is None:
        loaded = load_config(argv).actor_rollout_ref.actor.megatron
        assert (loaded.expert_model_parallel_size, loaded.expert_tensor_parallel_size) in ((4, None), (2, 1), (1, 2))
        return
    with pytest.raises(ConfigError) as e:
        load_config(argv)
    assert "actor_rollout_ref.actor.megatron" in str(e.value) and message in str(e.value)


def _one_step_weights(rank: int, model_dir: str, data, aux_coeffs: tuple[float, ...]):
    """HF-named weights after one optimiser step (all 8 rows, no gradient clipping) per aux-loss coefficient."""
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from tests.engines.test_megatron_engine import MICRO, ROWS, _actor_config

    cfg = _actor_config(model_dir)
    out = []
    for coeff in aux_coeffs:
        megatron = MegatronConfig(dtype="float32", use_distributed_optimizer=False,
                                  override_transformer_config={"moe_aux_loss_coeff": coeff})
        engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, grad_clip=0.0), "cpu")
        DataParallelPPOActor(cfg, engine, ActorBatchSizes(ROWS, MICRO)).update_policy(data)
        out.append(dict(engine.iter_hf_weights()))
    return out


def test_aux_loss_coefficient_reaches_the_router_only_through_the_routing(tiny_moe_dir, tmp_path):
    """override_transformer_config.moe_aux_loss_coeff > 0 turns on megatron-core's load-balancing loss
    (a function of each router's probabilities). After one Adam step without clipping (each element's
    step depends on its own gradient only), both routers' weights differ from the coefficient-0
    update, and the weights after the last router, whose gradients never pass through a router (the
    last layer's experts, the final norm, the LM head), are the same. (The first layer's experts do
    change: the second router's input is their output.)"""
    from tests.engines.test_megatron_engine import _scored_batch

    model_dir = str(tiny_moe_dir)
    [(plain, balanced)] = run_ranks(_one_step_weights, 1, tmp_path, args=(model_dir, _scored_batch(model_dir), (0.0, 0.1)))
    for layer in (0, 1):
        router = f"model.layers.{layer}.mlp.gate.weight"
        assert (plain[router] - balanced[router]).abs().max() > 1e-4, router
    after = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj", "model.norm.weight",
             "lm_head.weight")
    for name in after:
        torch.testing.assert_close(balanced[name], plain[name], atol=1e-6, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def _weights_from_dist_checkpoint(rank: int, model_dir: str, checkpoint: str, ep: int):
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    megatron = MegatronConfig(expert_model_parallel_size=ep, dtype="float32", use_distributed_optimizer=False,
                              use_dist_checkpointing=True, dist_checkpointing_path=checkpoint)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron), "cpu", role="ref")
    return {k: v.clone() for k, v in engine.iter_hf_weights()}


def test_converter_checkpoint_loads_at_ep2(tiny_moe_dir, tmp_path):
    """``converter_hf_to_mcore`` on one process (every expert on it) writes a dist checkpoint whose experts
    two expert-parallel ranks each take their half of: the weights they export are HF's, bit for bit."""
    from tests.engines.test_megatron_dist_weights import _convert

    run = _convert(tiny_moe_dir, tmp_path / "mcore", "--dtype", "float32", "--ep_size", "1", "--test")
    assert run.returncode == 0 and "every tensor of" in run.stdout, run.stderr[-3000:]
    hf = _hf_parameters(str(tiny_moe_dir))
    for weights in run_ranks(_weights_from_dist_checkpoint, 2, tmp_path, ep=2,
                             args=(str(tiny_moe_dir), str(tmp_path / "mcore"), 2)):
        assert set(weights) == set(hf)
        for name, tensor in hf.items():
            assert torch.equal(weights[name], tensor), name


def test_tensor_parallel_moe_without_sequence_parallelism_is_a_start_up_error_for_a_trained_model(tiny_moe_dir):
    """megatron-core's MoE layer refuses to train at TP > 1 without sequence parallelism (on any device):
    a trained role with sequence_parallel=False says so at start-up, naming the key; with it (the default),
    or for the frozen reference, TP=2 loads."""
    from transformers import AutoConfig

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.moe import layout_problems

    hf_config = AutoConfig.from_pretrained(tiny_moe_dir)
    off = MegatronConfig(tensor_model_parallel_size=2, sequence_parallel=False)
    [problem] = layout_problems("actor_rollout_ref.actor.megatron", hf_config, off, on_cpu=True)
    assert problem.startswith("actor_rollout_ref.actor.megatron.sequence_parallel=False at tensor_model_parallel_size=2")
    assert "set actor_rollout_ref.actor.megatron.sequence_parallel=True" in problem
    assert layout_problems("k", hf_config, off, on_cpu=True, trains=False) == []
    for on_cpu in (True, False):
        assert layout_problems("k", hf_config, MegatronConfig(tensor_model_parallel_size=2), on_cpu=on_cpu) == []


def test_an_moe_family_not_built_here_is_a_start_up_error(tmp_path):
    """Qwen2-MoE (shared experts) converts through mbridge but is not built on this engine: the error
    names the family and the way out, whatever the layout."""
    from transformers import AutoConfig

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.moe import is_moe, layout_problems
    from rlfoundry.models.tiny import save_tiny_model

    hf_config = AutoConfig.from_pretrained(save_tiny_model(tmp_path / "qwen2-moe", arch="qwen2_moe"))
    assert is_moe(hf_config)
    [problem] = layout_problems("critic.megatron", hf_config, MegatronConfig(), on_cpu=True)
    assert "critic.megatron: the model is a qwen2_moe mixture of experts" in problem and "strategy=fsdp" in problem


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str, tp: int, ep: int, etp: int | None):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config

    cfg = _actor_config(model_dir)

    def actor():
        megatron = MegatronConfig(expert_model_parallel_size=ep, dtype="float32", use_distributed_optimizer=True,
                                  tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
        engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip), "cpu")
        return DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO))

    dp = ps.get_data_parallel_world_size()
    mine = data.chunk(dp)[ps.get_data_parallel_rank()]
    first = actor()
    first.update_policy(mine)
    first.engine.step_lr_scheduler()
    first.engine.save_checkpoint(ckpt, {"global_step": 1})
    first.update_policy(mine)
    resumed = actor()
    resumed.engine.load_checkpoint(ckpt)
    resumed.update_policy(mine)
    return dict(first.engine.iter_hf_weights()), dict(resumed.engine.iter_hf_weights())


@pytest.mark.parametrize("world, tp, ep, etp", [(2, 1, 2, None), pytest.param(4, 2, 2, None, marks=pytest.mark.heavy),
                                                 pytest.param(4, 2, 2, 1, marks=pytest.mark.heavy),
                                                 pytest.param(4, 4, 1, 2, marks=pytest.mark.heavy)],
                         ids=["ep2", "tp2-ep2", "tp2-ep2-etp1", "tp4-etp2"])
def test_moe_resume_takes_exactly_the_next_update(tiny_moe_dir, tiny_moe_4kv_dir, tmp_path, world, tp, ep, etp):
    """A checkpoint at EP=2 × DP=2 with the distributed optimiser (the experts' Adam state in an optimiser
    of its own, sharded over the expert data-parallel ranks): the resumed engine's next update gives the
    uninterrupted engine's weights, bit for bit. Heavy: the same at TP=2 × EP=2 on 4 ranks, the experts
    split over the TP pair or whole (expert_tensor_parallel_size=1; the layout records both), and at
    TP=4 with each expert split over a TP pair (expert_tensor_parallel_size=2, EP=1: the experts' state
    sharded over ranks {0, 2} and {1, 3})."""
    from tests.engines.test_megatron_engine import _scored_batch

    model_dir = str(tiny_moe_4kv_dir if tp == 4 else tiny_moe_dir)
    for uninterrupted, resumed in run_ranks(_save_then_resume, world, tmp_path, tp=tp, ep=ep, etp=etp,
                                            args=(model_dir, _scored_batch(model_dir), str(tmp_path / "ckpt"), tp, ep,
                                                  etp)):
        assert set(resumed) == set(uninterrupted)
        for name, tensor in uninterrupted.items():
            assert torch.equal(resumed[name], tensor), name
