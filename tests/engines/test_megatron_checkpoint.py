"""Megatron engine checkpoints (megatron-core dist-checkpointing inside the project's role
directory): a resumed engine takes exactly the update the uninterrupted one took, at TP=2 and at
DP=2 and CP=2 with the distributed optimiser; the model saved at TP=2 loads on one rank (resharded) with the
same weights; a damaged shard is refused before anything loads; ``rlfoundry export``'s offline path
turns an actor saved at TP=2 and a critic saved at PP=2 into HF directories with the saved weights; a
checkpoint keeps the weights of its save while the process trains on (TP=2; DP=2 distributed optimiser)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks
from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config, _scored_batch

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = pytest.mark.slow


def _actor(model_dir: str, tp: int, distributed_optimizer: bool, trainable: bool = True, cp: int = 1,
           dtype: str = "float32"):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg = _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, dtype=dtype, use_distributed_optimizer=distributed_optimizer,
                              context_parallel_size=cp)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim if trainable else None, cfg.grad_clip), "cpu")
    dp = ps.get_data_parallel_world_size()
    return DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO)), dp, ps.get_data_parallel_rank()


def _save_then_resume(rank: int, model_dir: str, data, ckpt: str, tp: int, distributed_optimizer: bool, cp: int,
                      dtype: str):
    actor, dp, dp_rank = _actor(model_dir, tp, distributed_optimizer, cp=cp, dtype=dtype)
    mine = data.chunk(dp)[dp_rank]
    actor.update_policy(mine)
    actor.engine.step_lr_scheduler()
    actor.engine.save_checkpoint(ckpt, {"global_step": 1})
    uninterrupted = actor.update_policy(mine)
    weights = dict(actor.engine.iter_hf_weights())

    resumed, _, _ = _actor(model_dir, tp, distributed_optimizer, cp=cp, dtype=dtype)
    extra = resumed.engine.load_checkpoint(ckpt)
    again = resumed.update_policy(mine)
    return {"extra": extra, "uninterrupted": uninterrupted, "again": again, "weights": weights,
            "resumed_weights": dict(resumed.engine.iter_hf_weights()), "calls": resumed.engine.update_calls}


@pytest.mark.parametrize("tp, distributed_optimizer, cp, dtype", [(2, False, 1, "float32"), (1, True, 1, "bfloat16"),
                                                                  (1, True, 2, "float32")])
@pytest.mark.numerics
def test_resume_takes_exactly_the_next_update(tiny_model_dir, tmp_path, tp, distributed_optimizer, cp, dtype):
    """(CP=2: the distributed optimiser's state sharded over the two context-parallel ranks. bf16: the
    16-bit weights with fp32 main copies in the distributed optimiser, norms included.)"""
    data = _scored_batch(str(tiny_model_dir))
    ckpt = str(tmp_path / "global_step_1" / "actor")
    results = run_ranks(_save_then_resume, 2, tmp_path, tp=tp, cp=cp,
                        args=(str(tiny_model_dir), data, ckpt, tp, distributed_optimizer, cp, dtype))
    for r in results:
        assert r["extra"]["global_step"] == 1 and r["calls"] == 2
        assert r["again"] == r["uninterrupted"]  # losses, clip fractions, grad norms: bit for bit
        for name, tensor in r["weights"].items():
            assert torch.equal(r["resumed_weights"][name], tensor), name


def _export_after_update(rank: int, model_dir: str, data, ckpt: str, tp: int = 2, cp: int = 1,
                         distributed_optimizer: bool = False):
    actor, _, _ = _actor(model_dir, tp, distributed_optimizer, cp=cp)
    actor.update_policy(data)
    actor.engine.save_checkpoint(ckpt, {})
    return dict(actor.engine.iter_hf_weights())


def _load_on_one_rank(rank: int, model_dir: str, ckpt: str):
    actor, _, _ = _actor(model_dir, 1, False, trainable=False)
    actor.engine.load_checkpoint(ckpt)
    return dict(actor.engine.iter_hf_weights())


def check_loads_on_one_rank(model_dir: str, tmp_path, tp: int = 2, cp: int = 1, distributed_optimizer: bool = False):
    """An actor updated and saved on tp × cp ranks loads on one rank with the same weights; its directory."""
    data = _scored_batch(model_dir)
    ckpt = tmp_path / "global_step_1" / "actor"
    saved = run_ranks(_export_after_update, tp * cp, tmp_path, tp=tp, cp=cp,
                      args=(model_dir, data, str(ckpt), tp, cp, distributed_optimizer))[0]
    [loaded] = run_ranks(_load_on_one_rank, 1, tmp_path, args=(model_dir, str(ckpt)))
    assert set(loaded) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(loaded[name], tensor), name
    return ckpt


def test_the_model_saved_at_tp2_loads_on_one_rank_and_damage_is_refused(tiny_model_dir, tmp_path):
    ckpt = check_loads_on_one_rank(str(tiny_model_dir), tmp_path)
    shard = sorted((ckpt / "mcore").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:-8] + b"damaged!")
    with pytest.raises(AssertionError, match="mcore/.*distcp"):
        run_ranks(_load_on_one_rank, 1, tmp_path / "again", args=(str(tiny_model_dir), str(ckpt)))


def _save_trained(rank: int, model_dir: str, ckpt: str, tp: int, pp: int, critic: bool):
    """One update of an actor or a critic at this layout, saved with the tokenizer; its HF weights."""
    from megatron.core import parallel_state as ps
    from transformers import AutoTokenizer

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic
    from tests.engines.test_megatron_critic import _critic_config, _value_batch

    cfg = _critic_config() if critic else _actor_config(model_dir)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32")
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                                 model_kind="token_classification" if critic else "causal_lm"), "cpu")
    dp = ps.get_data_parallel_world_size()
    if critic:
        DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI // dp, MICRO, MICRO)).update_critic(_value_batch())
    else:
        DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI // dp, MICRO)).update_policy(_scored_batch(model_dir))
    engine.save_checkpoint(ckpt, {}, tokenizer=AutoTokenizer.from_pretrained(model_dir))
    return dict(engine.iter_hf_weights())


@pytest.mark.parametrize("tp, pp, critic", [(2, 1, False), (1, 2, True)])
def test_offline_export_of_another_layout(tiny_model_dir, tmp_path, tp, pp, critic):
    import subprocess
    import sys

    import transformers
    from safetensors.torch import load_file

    from tests.trainer._e2e import subprocess_env

    role = "critic" if critic else "actor"
    ckpt, out = tmp_path / "global_step_1" / role, tmp_path / "hf"
    saved = run_ranks(_save_trained, 2, tmp_path, tp=tp, pp=pp, args=(str(tiny_model_dir), str(ckpt), tp, pp, critic))[0]
    script = "import sys; from rlfoundry.engines.megatron.export import export_megatron_checkpoint as e; e(sys.argv[1], sys.argv[2])"
    run = subprocess.run([sys.executable, "-c", script, str(ckpt), str(out)], capture_output=True, text=True,
                         env=subprocess_env(), timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(saved) and ("score.weight" in exported) == critic
    for name, tensor in saved.items():
        assert torch.equal(exported[name], tensor), name
    initial = load_file(tiny_model_dir / "model.safetensors")
    assert any(not torch.equal(initial[k], v) for k, v in exported.items() if k in initial)  # it trained
    auto = transformers.AutoModelForTokenClassification if critic else transformers.AutoModelForCausalLM
    model = auto.from_pretrained(out)
    assert model.num_parameters() == sum(t.numel() for t in exported.values())
    assert transformers.AutoTokenizer.from_pretrained(out).eos_token is not None


def _save_then_train_on(rank: int, model_dir: str, data, ckpt: str, tp: int, distributed_optimizer: bool):
    """One update, a save, one more update in the same process: the weights at the save."""
    actor, dp, dp_rank = _actor(model_dir, tp, distributed_optimizer)
    mine = data.chunk(dp)[dp_rank]
    actor.update_policy(mine)
    actor.engine.save_checkpoint(ckpt, {})
    # clones: the stream's TP-replicated tensors (norms) are the live parameters (engines/base.py)
    saved = {k: v.clone() for k, v in actor.engine.iter_hf_weights()}
    actor.update_policy(mine)
    return saved, dict(actor.engine.iter_hf_weights())


def _export_offline(rank: int, ckpt: str, out: str):
    from rlfoundry.engines.megatron.export import export_megatron_checkpoint

    export_megatron_checkpoint(ckpt, out)


@pytest.mark.parametrize("tp, distributed_optimizer", [(2, False), (1, True)])
def test_training_on_after_a_save_leaves_the_checkpoint_as_saved(tiny_model_dir, tmp_path, tp, distributed_optimizer):
    """The checkpoint holds the weights of the moment it was saved, though the process trains on: read
    back offline at one rank (``rlfoundry export``'s path), every tensor, the ones replicated on every
    TP rank (norms) too, equals the save-time weights bit for bit."""
    from safetensors.torch import load_file

    data, ckpt, out = _scored_batch(str(tiny_model_dir)), tmp_path / "global_step_1" / "actor", tmp_path / "hf"
    saved, later = run_ranks(_save_then_train_on, 2, tmp_path, tp=tp,
                             args=(str(tiny_model_dir), data, str(ckpt), tp, distributed_optimizer))[0]
    assert not torch.equal(later["model.norm.weight"], saved["model.norm.weight"])  # the later update moved them
    run_ranks(_export_offline, 1, tmp_path, args=(str(ckpt), str(out)))
    exported = load_file(out / "model.safetensors")
    assert set(exported) == set(saved)
    assert [k for k, v in saved.items() if not torch.equal(exported[k], v)] == []


def _save_contents(rank: int, model_dir: str, data, root: str):
    from pathlib import Path

    from safetensors.torch import load_file

    actor, _, _ = _actor(model_dir, 2, False)
    actor.update_policy(data)
    actor.engine.save_checkpoint(f"{root}/model", {"global_step": 1}, contents=["model"])
    actor.engine.save_checkpoint(f"{root}/export", {}, contents=["model", "hf_model", "extra"])
    weights = dict(actor.engine.iter_hf_weights())
    resumed, _, _ = _actor(model_dir, 2, False)
    try:
        resumed.engine.load_checkpoint(f"{root}/model")  # the default contents ask for the optimiser
        refused = ""
    except ValueError as e:
        refused = str(e)
    extra = resumed.engine.load_checkpoint(f"{root}/model", contents=["model"])
    moments = sum(len(s) for s in resumed.engine.optimizer.optimizer.state.values())
    export = Path(root) / "export" / "huggingface" / "model.safetensors"
    return {"weights": weights, "resumed": dict(resumed.engine.iter_hf_weights()), "refused": refused,
            "extra": extra, "fresh_moments": moments, "export": load_file(str(export)) if rank == 0 else None}


def test_save_contents_model_alone_and_with_an_hf_export(tiny_model_dir, tmp_path):
    """verl's Megatron ``save_contents=['model']``: the weights without the optimiser state, LR schedule or
    RNG files; a load of the weights alone keeps a fresh optimiser; ``hf_model`` adds the HF export."""
    import json

    data = _scored_batch(str(tiny_model_dir))
    root = tmp_path / "ckpt"
    results = run_ranks(_save_contents, 2, tmp_path, tp=2, args=(str(tiny_model_dir), data, str(root)))
    model_only, export = root / "model", root / "export"
    marker = json.loads((model_only / "checkpoint_complete.json").read_text())
    assert marker["has_optimizer"] is False and marker["has_lr_scheduler"] is False
    assert not (model_only / "lr_scheduler.pt").exists() and not list((model_only / "rng").iterdir())
    assert (export / "lr_scheduler.pt").exists() and len(list((export / "rng").iterdir())) == 2  # a file per rank
    for r in results:
        assert "saved without its optimizer state" in r["refused"]
        assert r["extra"]["global_step"] == 1 and r["fresh_moments"] == 0
        for name, tensor in r["weights"].items():
            assert torch.equal(r["resumed"][name], tensor), name
    exported = results[0]["export"]
    assert set(exported) == set(results[0]["weights"])
    for name, tensor in results[0]["weights"].items():
        assert torch.equal(exported[name], tensor), name
