"""Multi-token prediction on the Megatron engine (verl's model.mtp.*; engines/megatron/mtp.py), on a tiny
MiMo (a Qwen2 model plus one MTP layer, rlfoundry/models/mimo.py), CPU processes over gloo:

- the MTP layers load from and export to MiMo's HF names bit for bit; the rollout's stream leaves them out;
- the logged MTP loss equals a cross-entropy computed independently, in plain torch from the HF tensors
  (the decoder's normed hidden state at t and the embedding of token t+1 through MiMo's MTP layer and the
  LM head, against token t+2 on the response);
- enable_train=false leaves the MTP layers as loaded and the rest of the update equal to a model built
  without them; mtp_loss_scaling_factor scales the MTP layers' gradients; detach_encoder keeps the MTP loss
  out of the decoder's gradients (and without it, it is in them);
- a checkpoint saved after one update and resumed gives the second update bit for bit, MTP layers included,
  and its offline export (``rlfoundry export``) writes them;
- TP=2 (sequence parallelism on and off), PP=2 and CP=2 give one rank's MTP loss and update;
- through the hybrid worker (verl's keys, HF rollout): the MTP metric is logged and the rollout's sync takes
  the updated causal LM without the MTP tensors;
- SFT on the Megatron engine (engine=megatron, model.mtp.*) trains them too, or with enable_train=false leaves
  them and its steps as without them.
"""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow]

ACTOR = ["actor.grad_clip=100.0", "actor.optim.eps=1e-4", "actor.optim.weight_decay=0.01"]


@pytest.fixture(scope="module")
def mimo_dir(tmp_path_factory):
    from rlfoundry.models.mimo import save_tiny_mimo

    return str(save_tiny_mimo(tmp_path_factory.mktemp("mimo") / "tiny-mimo"))


def _data(model_dir: str, rows: int = 4):
    from rlfoundry.protocol import DataProto
    from tests.engines.test_megatron_model import _batch

    batch = _batch(seed=0, rows=rows, tp=6, tr=5)
    width = batch["responses"].shape[1]
    mask = batch["attention_mask"][:, -width:]
    g = torch.Generator().manual_seed(3)
    lp = -torch.rand(mask.shape, generator=g) * mask
    batch.update(response_mask=mask, old_log_probs=lp, ref_log_prob=lp, advantages=torch.randn(lp.shape, generator=g) * mask)
    return DataProto.from_dict(tensors=batch, meta_info={"temperature": 1.0})


def _engine(model_dir: str, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False, **mtp):
    from rlfoundry.config.schema import ActorConfig, MegatronConfig, MtpConfig
    from rlfoundry.config.typed import to_typed
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from tests.workers import worker_config

    cfg = to_typed(ActorConfig, worker_config(model_dir, ACTOR).actor)
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
                              dtype="float32", sequence_parallel=sp)
    config = MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                  mtp=MtpConfig(**mtp) if mtp else None)
    return cfg, MegatronEngine(config, "cpu")


def _update(rank: int, model_dir: str, data, tp: int = 1, pp: int = 1, cp: int = 1, sp: bool = False, grads: bool = False,
            **mtp):
    """One actor update (one mini-batch of every row, micro-batches of 2); the metrics and the weights,
    with ``grads`` the gradients of the first step by HF name of the Megatron parameter instead of stepping."""
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    cfg, engine = _engine(model_dir, tp, pp, cp, sp, **mtp)
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(len(data), 2))
    captured = {}
    if grads:
        def capture() -> float:
            for chunk in engine._bare_chunks():
                for name, p in chunk.named_parameters():
                    if getattr(p, "main_grad", None) is not None:
                        captured[name] = p.main_grad.detach().clone()
            return 0.0
        engine._optimizer_step = capture
    metrics = actor.update_policy(data)
    return {"metrics": metrics, "weights": {k: v.clone() for k, v in engine.iter_hf_weights(mtp=True)},
            "grads": captured}


def _reference_mtp_loss(model_dir: str, data) -> float:
    """CE_1, token mean over the response: MiMo's MTP layer in plain torch on the HF tensors."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm, Qwen2RotaryEmbedding

    import rlfoundry.models  # noqa: F401  (model_type "mimo")

    b = data.batch
    ids, attn, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    weights = load_file(f"{model_dir}/model.safetensors")
    mtp = {k[len("model.mtp_layers.0."):]: v for k, v in weights.items() if k.startswith("model.mtp_layers.0.")}
    with torch.no_grad():
        hidden = model.model(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state  # after the final norm
        S = ids.shape[1]

        def norm(name, x):
            n = Qwen2RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            n.weight.copy_(mtp[f"{name}.weight"])
            return n(x)

        next_ids = torch.nn.functional.pad(ids[:, 1:], (0, 1))
        x = torch.cat([norm("token_layernorm", model.model.embed_tokens(next_ids)), norm("hidden_layernorm", hidden)], -1)
        x = x @ mtp["input_proj.weight"].T
        layer = Qwen2DecoderLayer(config, layer_idx=0)
        layer.load_state_dict({k: v for k, v in mtp.items() if k.split(".")[0] in ("self_attn", "mlp", "input_layernorm",
                                                                                 "post_attention_layernorm")})
        allowed = torch.tril(torch.ones(S, S, dtype=torch.bool))[None] & attn.bool()[:, None, :]
        mask = torch.where(allowed, 0.0, -1e9)[:, None]
        out = layer(x, attention_mask=mask, position_ids=pos,
                    position_embeddings=Qwen2RotaryEmbedding(config)(x, pos))
        out = out[0] if isinstance(out, tuple) else out
        logits = norm("final_layernorm", out) @ weights["lm_head.weight"].T
        ce = -torch.log_softmax(logits, -1).gather(-1, torch.nn.functional.pad(ids[:, 2:], (0, 2)).unsqueeze(-1)).squeeze(-1)
        width = b["responses"].shape[1]
        full = torch.cat([torch.zeros(ids.shape[0], S - width, dtype=torch.long), b["response_mask"]], 1)
        counted = torch.nn.functional.pad(full[:, 2:], (0, 2)).bool() & attn.bool()
    return float(ce[counted].mean())


@pytest.mark.numerics
def test_mtp_loss_equals_independent_computation(mimo_dir, tmp_path):
    data = _data(mimo_dir)
    [r] = run_ranks(_mtp_on, 1, tmp_path, args=(mimo_dir, data))
    [loss] = r["metrics"]["mtp_losses/mtp_1_loss"]
    expected = _reference_mtp_loss(mimo_dir, data)
    assert expected > 1.0  # a real cross-entropy over the vocabulary, not a degenerate one
    assert loss == pytest.approx(expected, rel=0, abs=1e-5)


def _mtp_on(rank, model_dir, data):
    return _update(rank, model_dir, data, enable=True, enable_train=True, mtp_loss_scaling_factor=0.3)


def _weights_round_trip(rank, model_dir):
    _, engine = _engine(model_dir, enable=True)
    return dict(engine.iter_hf_weights(mtp=True)), sorted(dict(engine.iter_hf_weights()))


def test_mtp_weights_load_and_export_in_mimo_names(mimo_dir, tmp_path):
    from safetensors.torch import load_file

    [(exported, synced)] = run_ranks(_weights_round_trip, 1, tmp_path, args=(mimo_dir,))
    stored = load_file(f"{mimo_dir}/model.safetensors")
    assert any(k.startswith("model.mtp_layers.0.") for k in stored)
    assert set(exported) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(exported[name], tensor), name
    # the rollout's stream: the causal LM's tensors only
    assert synced == sorted(k for k in stored if not k.startswith("model.mtp_layers."))


def _frozen_and_plain(rank, model_dir, data):
    return (_update(rank, model_dir, data, enable=True, enable_train=False),
            _update(rank, model_dir, data))


def test_enable_train_false_leaves_mtp_layers_and_the_update(mimo_dir, tmp_path):
    from safetensors.torch import load_file

    data = _data(mimo_dir)
    [(frozen, plain)] = run_ranks(_frozen_and_plain, 1, tmp_path, args=(mimo_dir, data))
    stored = load_file(f"{mimo_dir}/model.safetensors")
    mtp = [k for k in stored if k.startswith("model.mtp_layers.")]
    for name in mtp:  # weight decay is on (ACTOR): a frozen layer, not a zero gradient, keeps them
        assert torch.equal(frozen["weights"][name], stored[name]), name
    assert not any(k.startswith("mtp_losses/") for k in frozen["metrics"])
    assert set(plain["weights"]) == set(stored) - set(mtp)  # built without the MTP layers
    moved = max((plain["weights"][k] - stored[k]).abs().max().item() for k in plain["weights"])
    assert moved > 1e-4
    for name, tensor in plain["weights"].items():
        assert torch.equal(frozen["weights"][name], tensor), name
    assert frozen["metrics"]["actor/pg_loss"] == plain["metrics"]["actor/pg_loss"]


def _gradients(rank, model_dir, data):
    runs = {}
    for label, factor, detach in (("a", 0.1, True), ("b", 0.2, True), ("zero", 0.0, True), ("attached", 0.1, False)):
        runs[label] = _update(rank, model_dir, data, grads=True, enable=True, enable_train=True,
                              mtp_loss_scaling_factor=factor, detach_encoder=detach)["grads"]
    return runs


@pytest.mark.numerics
def test_scaling_factor_scales_mtp_gradients_and_detach_encoder(mimo_dir, tmp_path):
    data = _data(mimo_dir)
    [runs] = run_ranks(_gradients, 1, tmp_path, args=(mimo_dir, data))
    a, b, zero, attached = runs["a"], runs["b"], runs["zero"], runs["attached"]
    mtp = [k for k in a if k.startswith("mtp.")]
    decoder = [k for k in a if not k.startswith("mtp.")]
    assert mtp and decoder
    for name in mtp:  # linear in the factor: the MTP layers learn from the MTP loss only
        assert zero[name].abs().max() == 0, name
        torch.testing.assert_close(b[name], 2 * a[name], atol=1e-7, rtol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    assert max(a[n].abs().max().item() for n in mtp) > 1e-4
    # detach_encoder: the decoder's and the embedding's gradients are the policy loss's alone; the output layer
    # never takes the MTP loss's (verl detaches it)
    for name in decoder:
        assert torch.equal(a[name], zero[name]), name
    differs = [n for n in decoder if not torch.equal(attached[n], zero[n])]
    assert any("embedding" in n for n in differs) and any("decoder.layers" in n for n in differs)
    assert not any("output_layer" in n for n in differs)


def _resume(rank, model_dir, data, root):
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor

    mtp = dict(enable=True, enable_train=True, mtp_loss_scaling_factor=0.5)
    cfg, engine = _engine(model_dir, **mtp)
    actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(len(data), 2))
    actor.update_policy(data)
    engine.save_checkpoint(f"{root}/ckpt", extra={})
    saved = {k: v.clone() for k, v in engine.iter_hf_weights(mtp=True)}
    straight = actor.update_policy(data)
    cfg, again = _engine(model_dir, **mtp)
    again.load_checkpoint(f"{root}/ckpt")
    resumed = DataParallelPPOActor(cfg, again, ActorBatchSizes(len(data), 2)).update_policy(data)
    from rlfoundry.engines.megatron.export import export_megatron_checkpoint

    export_megatron_checkpoint(f"{root}/ckpt", f"{root}/exported")  # `rlfoundry export`: the MTP layers too
    return (straight, dict(engine.iter_hf_weights(mtp=True))), (resumed, dict(again.iter_hf_weights(mtp=True))), saved


def test_checkpoint_resume_is_bit_for_bit(mimo_dir, tmp_path):
    import json

    from safetensors.torch import load_file

    data = _data(mimo_dir)
    [((m1, w1), (m2, w2), saved)] = run_ranks(_resume, 1, tmp_path, args=(mimo_dir, data, str(tmp_path)))
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert set(exported) == set(saved)
    assert all(torch.equal(exported[k], v) for k, v in saved.items())
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert m1["mtp_losses/mtp_1_loss"] == m2["mtp_losses/mtp_1_loss"]
    assert m1["actor/pg_loss"] == m2["actor/pg_loss"]
    assert set(w1) == set(w2) and any(k.startswith("model.mtp_layers.") for k in w1)
    for name, tensor in w1.items():
        assert torch.equal(w2[name], tensor), name


def _layout(rank, model_dir, data, tp, pp, cp, sp=False):
    from megatron.core import parallel_state as ps

    dp = ps.get_data_parallel_world_size()
    mine = data.chunk(dp)[ps.get_data_parallel_rank()]  # what the worker's dispatch hands this data-parallel rank
    out = _update(rank, model_dir, mine, tp=tp, pp=pp, cp=cp, sp=sp, enable=True, enable_train=True,
                  mtp_loss_scaling_factor=0.3)
    return {**out, "dp": dp}


@pytest.mark.numerics
@pytest.mark.parametrize("tp, pp, cp, sp, world", [
    (2, 1, 1, False, 2), (2, 1, 1, True, 2), (1, 2, 1, False, 2), (1, 1, 2, False, 2), (1, 1, 1, False, 2),
    pytest.param(2, 2, 1, True, 4, marks=pytest.mark.heavy), pytest.param(1, 2, 2, False, 4, marks=pytest.mark.heavy),
])
def test_model_parallel_equals_one_rank(mimo_dir, tmp_path, tp, pp, cp, sp, world):
    """TP=2 (the MTP block's linears and the vocabulary split), PP=2 (the block on the last stage with its
    own copy of the first stage's embedding, their gradients summed) and CP=2 (each rank two chunks of every
    row, the block's inputs rolled across the ranks) equal one rank; TP=2 with sequence parallelism too (the
    block's norms on 1/TP of the positions, their gradients summed over the ranks); DP=2: each rank half the
    rows, the MTP loss normalised by the whole mini-batch's tokens (heavy: TP×PP and PP×CP on 4 ranks)."""
    data = _data(mimo_dir)
    [one] = run_ranks(_layout, 1, tmp_path, args=(mimo_dir, data, 1, 1, 1))
    ranks = run_ranks(_layout, world, tmp_path, tp=tp, pp=pp, cp=cp, args=(mimo_dir, data, tp, pp, cp, sp))
    assert ranks[0]["dp"] == world // (tp * pp * cp)
    for r in ranks:
        for key in ("mtp_losses/mtp_1_loss", "actor/pg_loss", "actor/grad_norm"):
            assert r["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-5, abs=1e-6), key
        for name, tensor in one["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_start_up_checks(mimo_dir, tiny_model_dir):
    """enable on the Megatron engine with a MiMo: accepted (enable_train without enable_rollout); a model without
    MTP layers, pipeline parallelism, or the FSDP engine: errors naming the fix."""
    import warnings

    from rlfoundry.trainer.config import ConfigError, load_config

    def load(*keys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return load_config(["actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.ref.strategy=megatron",
                                "critic.strategy=megatron", *keys])

    def error(*keys):
        with pytest.raises(ConfigError) as e:
            load(*keys)
        return str(e.value)

    on = ("actor_rollout_ref.model.mtp.enable=true", "actor_rollout_ref.model.mtp.enable_train=true")
    cfg = load(f"actor_rollout_ref.model.path={mimo_dir}", *on)
    assert cfg.actor_rollout_ref.model.mtp.enable_train
    assert "no MTP layers" in error(f"actor_rollout_ref.model.path={tiny_model_dir}", *on)
    assert "strategy=megatron" in error(f"actor_rollout_ref.model.path={mimo_dir}", *on,
                                        "actor_rollout_ref.actor.strategy=fsdp")
    assert "LoRA" in error(f"actor_rollout_ref.model.path={mimo_dir}", *on, "actor_rollout_ref.model.lora_rank=4")


def _hybrid_worker(rank, model_dir, draft=False):
    """verl's keys through the hybrid worker: the HF rollout samples from the MiMo (its causal LM without the
    MTP layers), the Megatron actor trains with the MTP loss, and the sync after the update (which refuses a
    tensor the rollout's model has no place for) leaves the MTP tensors out; with ``draft``
    (``mtp.enable_rollout``) the rollout drafts with the MTP layers and the sync carries them."""
    import os

    from transformers import AutoTokenizer

    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker
    from tests.workers import make_prompts, worker_config

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # the process group exists already (run_ranks)
    os.environ.setdefault("MASTER_PORT", "0")
    config = worker_config(model_dir, ["actor.strategy=megatron", "actor.megatron.dtype=float32",
                                       "model.mtp.enable=true", "model.mtp.enable_train=true",
                                       "model.mtp.detach_encoder=true",
                                       *(["model.mtp.enable_rollout=true", "rollout.checkpoint_engine.verify=true"]
                                         if draft else [])])
    worker = ActorRolloutRefWorker(config, "actor_rollout")
    worker.init_model()
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), ["1+2=", "3+4=", "5+6=", "7+8="])
    data = worker.generate_sequences(prompts)
    data.meta_info = {"temperature": 1.0}
    data = data.union(worker.compute_log_prob(data))
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    metrics = worker.update_actor(data).meta_info["metrics"]
    again = worker.generate_sequences(prompts)  # after the sync
    rollout = dict(worker.rollout.module.named_parameters())
    actor = dict(worker.engine.iter_hf_weights(mtp=draft))
    if draft:  # the draft's tensors, in MiMo's names
        rollout |= {worker.rollout.speculator.draft.hf_name(n): t
                    for n, t in worker.rollout.speculator.draft.named_parameters()}
    return {"metrics": metrics, "responses": again.batch["responses"].shape, "drafted": "mtp_draft_tokens" in again.batch.keys(),
            "same": all(torch.equal(rollout[k], v) for k, v in actor.items()), "names": (sorted(rollout), sorted(actor)),
            "mtp": {k: v.clone() for k, v in actor.items() if k.startswith("model.mtp_layers.")}}


def test_hybrid_worker_trains_mtp_and_syncs_the_rollout(mimo_dir, tmp_path):
    [r] = run_ranks(_hybrid_worker, 1, tmp_path, args=(mimo_dir,))
    assert "mtp_losses/mtp_1_loss" in r["metrics"] and r["metrics"]["mtp_losses/mtp_1_loss"][0] > 0
    assert r["names"][0] == r["names"][1] and r["same"]  # the rollout holds the updated causal LM, nothing else


def test_hybrid_worker_syncs_the_trained_mtp_layers_into_the_draft(mimo_dir, tmp_path):
    """``mtp.enable_rollout`` beside MTP training: the rollout drafts with the MTP layers, and after the update
    its draft holds the trained ones (the sync, verified by digests, carries them), not the checkpoint's."""
    from safetensors.torch import load_file

    [r] = run_ranks(_hybrid_worker, 1, tmp_path, args=(mimo_dir, True))
    assert r["drafted"] and r["names"][0] == r["names"][1] and r["same"]
    stored = load_file(f"{mimo_dir}/model.safetensors")
    assert r["mtp"] and any(not torch.equal(t, stored[k]) for k, t in r["mtp"].items())  # trained, then synced


def _sft_rank(rank: int, runs: list[list[str]], out: str) -> None:
    """One process: the SFT trainer over each of ``runs``; each run's step metrics and final weights saved."""
    import os
    import sys

    import torch.multiprocessing as mp

    from rlfoundry.trainer.sft_trainer import SFTTrainer, load_sft_config

    torch.set_num_threads(1)
    results = []
    for overrides in runs:
        trainer = SFTTrainer(load_sft_config(overrides))
        steps, log = [], trainer.train_step
        trainer.train_step = lambda batch, log=log, steps=steps: steps.append(log(batch)) or steps[-1]
        try:
            trainer._train_loop()
            results.append({"steps": steps, "weights": {k: v.clone() for k, v in trainer.engine.iter_hf_weights(mtp=True)}})
        finally:
            trainer._finish(0.0)
    torch.save(results, out)
    sys.stdout.flush()
    for child in mp.active_children():
        child.terminate()
    os._exit(0)


def test_sft_on_megatron_trains_the_mtp_layers(mimo_dir, tmp_path):
    """verl's SFT line (engine=megatron, model.mtp.*): the MTP loss logged each step and the MTP layers
    trained; with enable_train=false they stay as loaded and the SFT update equals the model's without them."""
    import torch.multiprocessing as mp
    from safetensors.torch import load_file

    from tests.trainer.test_sft import _overrides

    base = ["engine=megatron", "optim=megatron", "optim.eps=1e-4", "model.cpu_kernels=off",
            "trainer.total_training_steps=2", "optim.weight_decay=0.01"]
    runs = [_overrides(mimo_dir, tmp_path / name, *base, *extra) for name, extra in (
        ("trained", ["model.mtp.enable=true", "model.mtp.enable_train=true", "model.mtp.mtp_loss_scaling_factor=0.5"]),
        ("frozen", ["model.mtp.enable=true"]), ("plain", []))]
    out = str(tmp_path / "sft.pt")
    mp.spawn(_sft_rank, args=(runs, out), nprocs=1, join=True)
    trained, frozen, plain = torch.load(out, weights_only=False)
    stored = load_file(f"{mimo_dir}/model.safetensors")
    mtp = [k for k in stored if k.startswith("model.mtp_layers.")]
    assert [s["mtp_losses/mtp_1_loss"] > 0 for s in trained["steps"]] == [True, True]
    assert all(not torch.equal(trained["weights"][k], stored[k]) for k in mtp if "norm" not in k)
    assert all(torch.equal(frozen["weights"][k], stored[k]) for k in mtp)
    assert not any(k.startswith("mtp_losses/") for k in frozen["steps"][0])
    assert [s["train/loss"] for s in frozen["steps"]] == [s["train/loss"] for s in plain["steps"]]
    for name, tensor in plain["weights"].items():
        assert torch.equal(frozen["weights"][name], tensor), name
