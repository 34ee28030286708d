"""Expert parallelism on the FSDP2 engine (``engines/fsdp/expert_parallel.py``, ``fsdp_config.expert_parallel_size``):
EP=2 over two gloo ranks takes the update of one rank (losses, router losses, grad norm, gradients, the
weights after the step), each rank holds only its experts, a checkpoint resumes the next step bit for bit,
the HF export and the weight-sync stream carry the full experts, and the gathered model (the HF rollout's)
decodes on each rank alone. Layouts it cannot take are start-up errors."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard
from transformers import AutoModelForCausalLM

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp import expert_parallel as ep
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.tiny import save_tiny_model
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from rlfoundry.workers.weight_sync import checkpoint_named
from tests import rank_server
from tests.engines.test_fsdp_moe import LOSSES_ON, _batch, _nll
from tests.engines.test_fsdp_routing_replay import EOS_THIRD, TEXTS, rollout_batch  # noqa: F401 - fixture
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.workers import first_step_gradients, make_prompts, worker_config

KEYS = ("sft/loss", "moe/aux_loss", "moe/z_loss", "sft/grad_norm")


def _engine(model_dir, override=None, fsdp: FSDPConfig | None = None, grad_clip: float = 1e9, **fields) -> FSDPEngine:
    """test_fsdp_moe's engine with Adam's eps at 1e-6: at the default 1e-8 an expert weight whose gradient is
    ~5e-9 (a token's faint share) moves by lr · g / (|g| + eps), which fp32 rounding of g in another sum order
    shifts by 5e-5; the weights after a step are then compared to 1e-5 like the gradients."""
    fields = {"cpu_kernels": "off", **fields}
    config = FSDPEngineConfig(path=str(model_dir), fsdp=fsdp or FSDPConfig(), grad_clip=grad_clip,
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0, eps=1e-6),
                              override_config=dict(override or {}), **fields)
    return FSDPEngine.build(config, "cpu", role="sft")


def _train(engine, data, rows_per_micro: int = 1) -> dict:
    return engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=len(data),
                                                                 micro=MicroBatching(rows_per_micro)))


def _weights(engine) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in engine.iter_hf_weights()}  # collective


def _synced(engine) -> dict[str, torch.Tensor]:
    """The rollout weight-sync stream under the checkpoint's names (each expert its own tensors)."""
    return {name: t.clone() for name, t in checkpoint_named(lambda: engine.module, engine.iter_hf_weights())}


def _gathered_logits(engine, ids: torch.Tensor, calls: int) -> torch.Tensor:
    """``calls`` no-grad forwards inside the rollout's gathered context: each rank a different number, as
    ranks decoding different prompts do (a collective in the forward would hang)."""
    with torch.no_grad(), fu.unsharded(engine.module):
        return [engine.module(input_ids=ids).logits for _ in range(calls)][-1]


def _rank_main(rank: int, world: int, store: str, out: str, model_dir, data, data2, ckpt: str, hf: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    fsdp = FSDPConfig(expert_parallel_size=2)
    engine = _engine(model_dir, LOSSES_ON, fsdp=fsdp)
    rows = data.chunk(world)[rank]
    metrics = _train(engine, rows)
    grads = first_step_gradients(engine.optimizer, engine.module)
    layout = {n: (tuple(p.to_local().shape), tuple(p.shape), p.device_mesh.mesh_dim_names, tuple(p.placements))
              for n, p in engine.module.named_parameters() if ".experts." in n}
    after = _weights(engine)
    synced = _synced(engine)
    engine.save_hf_model(hf)
    engine.save_checkpoint(ckpt, extra={})
    second = _train(engine, data2.chunk(world)[rank])
    continued = _weights(engine)
    resumed_engine = _engine(model_dir, LOSSES_ON, fsdp=fsdp)
    resumed_engine.load_checkpoint(ckpt)
    resumed = _train(resumed_engine, data2.chunk(world)[rank])
    bit_equal = all(torch.equal(t, continued[n]) for n, t in _weights(resumed_engine).items())
    # the checkpoint holds global tensors: a run without EP resumes from it with the same weights
    plain = _engine(model_dir, LOSSES_ON)
    plain.load_checkpoint(ckpt)
    across = all(torch.equal(t, after[n]) for n, t in _weights(plain).items())
    logits = _gathered_logits(engine, data.batch["input_ids"][:2], calls=1 + rank)
    torch.save(dict(metrics=metrics, grads=grads, layout=layout, after=after, synced=synced, second=second,
                    resumed=resumed, bit_equal=bit_equal, across=across, logits=logits, continued=continued),
               f"{out}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


def _run_ranks(tmp_path, model_dir, world: int) -> list[dict]:
    data, data2 = _batch(), _batch(rows=4, tp=4, tr=7)
    rank_server.run(_rank_main, args=(world, str(tmp_path / "store"), str(tmp_path / "out.pt"), model_dir, data, data2,
                                      str(tmp_path / "ckpt"), str(tmp_path / "hf")), nprocs=world)
    return [torch.load(f"{tmp_path / 'out.pt'}.{r}", weights_only=False) for r in range(world)]


def _one_rank(model_dir) -> dict:
    """The same two steps on one rank wrapped in FSDP2 (all the rows, two per micro-batch)."""
    data, data2 = _batch(), _batch(rows=4, tp=4, tr=7)
    engine = _engine(model_dir, LOSSES_ON, fsdp=FSDPConfig(single_rank="fsdp"))
    metrics = _train(engine, data, 2)
    grads = first_step_gradients(engine.optimizer, engine.module)
    after, synced = _weights(engine), _synced(engine)
    second = _train(engine, data2, 2)
    with torch.no_grad():  # after the second step, as the ranks' gathered forward
        logits = engine.module(input_ids=data.batch["input_ids"][:2]).logits
    return dict(metrics=metrics, grads=grads, after=after, synced=synced, second=second, logits=logits,
                continued=_weights(engine))


def _check_against_one_rank(ranks: list[dict], single: dict, tmp_path, world: int) -> None:
    from safetensors.torch import load_file

    exported = {}
    for f in sorted((tmp_path / "hf").glob("*.safetensors")):
        exported.update(load_file(str(f)))
    for r, got in enumerate(ranks):
        moe = [k for k in single["metrics"] if k.startswith("moe/layer")]  # router metrics: the update's forward's
        assert moe
        for key in (*KEYS, *moe):
            assert got["metrics"][key] == pytest.approx(single["metrics"][key], abs=1e-5), (r, key)
            assert got["second"][key] == pytest.approx(single["second"][key], abs=1e-5), (r, key)
        # the next step after a resume is the uninterrupted one, bit for bit
        assert got["bit_equal"] and got["across"]
        for key in KEYS:
            assert got["resumed"][key] == got["second"][key], (r, key)
        for name, grad in single["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=0, msg=name)
        for name in ("after", "continued", "synced"):
            assert got[name].keys() == single[name].keys(), name
            for k, v in single[name].items():
                torch.testing.assert_close(got[name][k], v, atol=1e-5, rtol=0, msg=f"{name} {k}")
        torch.testing.assert_close(got["logits"], single["logits"], atol=1e-5, rtol=0)
    # the export: the experts in the checkpoint's own names and shapes, the one-rank model's values
    synced = single["synced"]
    assert any(".experts.0." in k for k in exported) and exported.keys() == synced.keys()
    for k, v in synced.items():
        torch.testing.assert_close(exported[k], v, atol=1e-5, rtol=0, msg=k)


def _check_layout(ranks: list[dict], world: int, size: int) -> None:
    """8 experts, EP=size: each rank holds 8/size of them (its expert dim's local size), a Shard(0) DTensor on
    the ep mesh dim, and FSDP2 shards them further over the world/size ranks holding the same experts."""
    for got in ranks:
        assert got["layout"], "no expert parameters"
        for name, (local, full, dims, placements) in got["layout"].items():
            assert full[0] == 8 and dims == ("efsdp", "ep"), name
            assert placements[1] == Shard(0), (name, placements)
            assert local[0] * world == 8 if world // size > 1 else local[0] == 8 // size, (name, local)


@pytest.mark.numerics
def test_expert_parallel_two_ranks_take_the_update_of_one(process_group, tiny_moe_dir, tmp_path):
    """EP=2 over two ranks against one rank wrapped in FSDP2: the same losses, router losses, grad norm and
    gradients, and the same weights after each of two optimiser steps (1e-5: sums in another order); the
    experts live 4 per rank; resume, export, weight sync and the gathered forward as in the module docstring."""
    ranks = _run_ranks(tmp_path, tiny_moe_dir, 2)
    _check_layout(ranks, 2, 2)
    _check_against_one_rank(ranks, _one_rank(tiny_moe_dir), tmp_path, 2)


@pytest.mark.heavy
@pytest.mark.numerics
def test_expert_parallel_two_over_four_ranks_takes_the_update_of_one(process_group, tiny_moe_dir, tmp_path):
    """EP=2 over four ranks: two EP groups, each expert FSDP'd over the two ranks that hold it."""
    ranks = _run_ranks(tmp_path, tiny_moe_dir, 4)
    _check_layout(ranks, 4, 2)
    _check_against_one_rank(ranks, _one_rank(tiny_moe_dir), tmp_path, 4)


def test_layouts_expert_parallelism_cannot_take_are_start_up_errors(process_group, tiny_moe_dir, tmp_path_factory):
    from rlfoundry.models.hf import load_hf_model

    module = load_hf_model(str(tiny_moe_dir))
    with pytest.raises(ValueError, match="does not divide the model's 8 experts"):
        ep.check_expert_parallel(3, module, world=3)
    with pytest.raises(ValueError, match="does not divide the 2 ranks"):
        ep.check_expert_parallel(4, module, world=2)
    with pytest.raises(ValueError, match="LoRA"):
        ep.check_expert_parallel(2, module, world=2, lora=True)
    with pytest.raises(ValueError, match="fsdp_size=1"):
        ep.check_expert_parallel(2, module, world=4, fsdp_size=1)
    dense = load_hf_model(str(save_tiny_model(tmp_path_factory.mktemp("dense"))))
    with pytest.raises(ValueError, match="no routed experts"):
        ep.check_expert_parallel(2, dense, world=2)
    ep.check_expert_parallel(2, module, world=4)  # a layout it takes
    # through the engine: one rank cannot hold half of the experts' groups
    with pytest.raises(ValueError, match="expert_parallel_size=2.*does not divide the 1 ranks"):
        _engine(tiny_moe_dir, fsdp=FSDPConfig(expert_parallel_size=2))


# ---- routing replay (R3) and the HF rollout under expert parallelism ------------------------------------------

def _greedy(module, rollout_cfg, ids: tuple[int, int], prompts) -> torch.Tensor:
    """The HF rollout's greedy responses from ``module`` (the EP engine's own, or a plain one)."""
    engine = HFRollout(module, rollout_cfg, *ids, static_decode=False)
    prompts.meta_info.update(do_sample=False, eos_token_id=EOS_THIRD)
    return engine.generate_sequences(prompts).batch["responses"]


def _replay_rank_main(rank: int, store: str, out: str, model_dir, perturbed, rollout) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    engine = _engine(model_dir, fsdp=FSDPConfig(expert_parallel_size=2))
    # each rank samples other prompts, ending at other lengths: no collective may run inside a decode step
    responses = _greedy(engine.rollout_module(), rollout["cfg"], rollout["ids"], rollout["prompts"][rank])
    torch.save((_log_probs(engine, perturbed.chunk(2)[rank]), responses), f"{out}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _log_probs(engine, data) -> dict[str, torch.Tensor]:
    keys = ["input_ids", "attention_mask", "position_ids", "responses", "routed_experts"]
    return engine.infer_batch(data.select(batch_keys=keys), LogProbs(), MicroBatching(size=2))


@pytest.mark.numerics
def test_expert_parallel_log_probs_replay_the_batch_routing_and_the_rollout_decodes(process_group, tiny_moe_dir,
                                                                                   rollout_batch, tokenizer, tmp_path):
    """R3 with EP=2: the routers' replay hooks act before the dispatch, so each rank's log-probs on a batch whose
    recorded routing was moved equal one rank's replayed ones (1e-5), and the routing-change counts are the same.
    The HF rollout on the EP engine's module, each rank its own prompts (1 and 3) ending at other lengths,
    samples greedily what the plain model samples."""
    _, perturbed = rollout_batch
    cfg = worker_config(tiny_moe_dir, ["rollout.response_length=10"])["rollout"]
    ids = (tokenizer.pad_token_id, tokenizer.eos_token_id)
    prompts = [make_prompts(tokenizer, TEXTS[:1]), make_prompts(tokenizer, TEXTS[1:])]
    rollout = {"cfg": cfg, "ids": ids, "prompts": prompts}
    rank_server.run(_replay_rank_main, args=(str(tmp_path / "store"), str(tmp_path / "lp.pt"), tiny_moe_dir, perturbed,
                                             rollout), nprocs=2)
    loaded = [torch.load(f"{tmp_path / 'lp.pt'}.{r}", weights_only=False) for r in (0, 1)]
    got = [lp for lp, _ in loaded]
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_dir, dtype=torch.float32)
    for (_, responses), rank_prompts in zip(loaded, prompts):
        assert torch.equal(responses, _greedy(model, cfg, ids, rank_prompts))
    single = _log_probs(_engine(tiny_moe_dir, fsdp=FSDPConfig(single_rank="fsdp")), perturbed)
    plain = _engine(tiny_moe_dir, fsdp=FSDPConfig(single_rank="fsdp"))
    unreplayed = plain.infer_batch(perturbed.select(batch_keys=["input_ids", "attention_mask", "position_ids",
                                                                "responses"]), LogProbs(), MicroBatching(size=2))
    mask = perturbed.batch["response_mask"].bool()
    for key in ("log_probs", "routing_changed_tokens"):
        joined = torch.cat([g[key] for g in got])
        torch.testing.assert_close(joined, single[key], atol=1e-5, rtol=0, msg=key)
    assert float((single["log_probs"] - unreplayed["log_probs"])[mask].abs().max()) > 1e-3  # the replay was used


# ---- one update against one rank's: with Ulysses, and the other MoE families -------------------------------

def _update_rank_main(rank: int, store: str, out: str, model_dir, data, override, fields) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    engine = _engine(model_dir, override, fsdp=FSDPConfig(expert_parallel_size=2), **fields)
    rows, _ = engine.model_parallel_rows(data.chunk(2)[rank])  # under Ulysses the SP group pools its rows
    metrics = _train(engine, rows)
    torch.save((metrics, first_step_gradients(engine.optimizer, engine.module)), f"{out}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def _check_update_against_one_rank(tmp_path, model_dir, keys: tuple[str, ...], override=None, **fields) -> None:
    """EP=2 over two ranks (each half the rows) against one rank wrapped in FSDP2 with the same ``fields``:
    the metrics ``keys`` and every gradient within 1e-5."""
    data = _batch()
    rank_server.run(_update_rank_main, args=(str(tmp_path / "store"), str(tmp_path / "u.pt"), model_dir, data,
                                             override, fields), nprocs=2)
    plain = {k: v for k, v in fields.items() if k != "ulysses_sequence_parallel_size"}
    single = _engine(model_dir, override, fsdp=FSDPConfig(single_rank="fsdp"), **plain)
    metrics = _train(single, data, 2)
    grads = first_step_gradients(single.optimizer, single.module)
    for got_metrics, got_grads in (torch.load(f"{tmp_path / 'u.pt'}.{r}") for r in (0, 1)):
        for key in keys:
            assert got_metrics[key] == pytest.approx(metrics[key], abs=1e-5), key
        for name, grad in grads.items():
            torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=0, msg=name)


@pytest.mark.numerics
def test_expert_parallel_with_ulysses_takes_the_update_of_one_rank(process_group, tiny_moe_dir, tmp_path):
    """EP=2 and Ulysses SP=2 on two ranks: each rank dispatches the tokens of its slice of the packed sequence;
    the loss, grad norm and gradients equal one rank's packed update (1e-5). No router losses: under Ulysses
    they are a start-up error with or without EP."""
    _check_update_against_one_rank(tmp_path, tiny_moe_dir, ("sft/loss", "sft/grad_norm"), use_remove_padding=True,
                                   ulysses_sequence_parallel_size=2)


@pytest.mark.numerics
@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_expert_parallel_other_families_take_the_update_of_one_rank(process_group, tmp_path_factory, tmp_path, arch):
    """Qwen2-MoE (a gated shared expert, outside the dispatch), DeepSeek-V3 (a dense first layer, grouped
    routing) and GPT-OSS (biased experts: the biases shard by expert too) under EP=2, with gradient
    checkpointing (the backward recomputes each layer's forward, its two all-to-alls included): one rank's
    losses, grad norm and gradients (1e-5), the gradients clipped to norm 0.05 (far below the norm): the experts'
    and the dense parameters' norms, on two meshes, make one norm and one clipping factor."""
    model_dir = save_tiny_model(tmp_path_factory.mktemp(f"ep-{arch}"), arch=arch)
    _check_update_against_one_rank(tmp_path, model_dir, KEYS, LOSSES_ON, gradient_checkpointing=True, grad_clip=0.05)


@pytest.mark.numerics
def test_expert_parallel_with_the_cpu_kernels_takes_the_update_of_one_rank(process_group, tiny_moe_dir, tmp_path):
    """The CPU's default path (model.cpu_kernels=auto: oneDNN linears around the experts): EP=2 takes one rank's
    update (1e-5)."""
    _check_update_against_one_rank(tmp_path, tiny_moe_dir, KEYS, LOSSES_ON, cpu_kernels="auto")
