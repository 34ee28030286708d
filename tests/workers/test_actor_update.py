"""The PPO actor update: invariance to micro-batch size, token budget and dp ranks; skipped NaN steps."""

from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
from safetensors.torch import load_file

from rlfoundry.config.schema import ActorConfig, FSDPConfig
from rlfoundry.config.typed import to_typed
from rlfoundry.protocol import DataProto
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.models.hf import load_hf_model
from rlfoundry.engines.base import MicroBatching
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
from tests.workers import (assert_same_gradients, full_params, local_worker, one_thread,  # noqa: F401
                           reassociation_bound, scored_batch, step_gradients, vocab_rows, worker_config)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
# 4 prompts x n=2 = 8 rows; ppo_mini_batch_size=2 prompts -> 2 optimiser steps per update.
# optim.eps=1e-4 (as tests/engines/test_megatron_engine.py): Adam's step lr * g / (|g| + eps) then
# changes by at most lr/eps = 10x a change in g, so gradients equal to float32 re-association give
# weights that differ by as little after several steps (an eps of 1e-8 amplifies them to ~lr, #51);
# elements with |g| >> 1e-4 still take Adam's normalised ~lr steps.
BASE = ["actor.ppo_mini_batch_size=2", "actor.use_kl_loss=true", "actor.entropy_coeff=0.01", "actor.optim.eps=1e-4"]


@pytest.fixture(scope="module")
def batch(tiny_model_dir, tokenizer) -> DataProto:
    """A scored batch as the trainer hands it to update_actor (8 rows, some ending at EOS)."""
    data = scored_batch(tiny_model_dir, tokenizer, TEXTS)
    assert len(set(data.batch["response_mask"].sum(-1).tolist())) > 1
    return data


def _update(model_dir, batch, overrides):
    """The weights after the update, its metrics, and the gradient each optimiser step took."""
    group = local_worker(worker_config(model_dir, BASE + overrides), role="actor")
    grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
    metrics = group.update_actor(batch).meta_info["metrics"]
    return full_params(group.worker.actor.module), metrics, grads


def _assert_same_update(a, b, batch):
    """The same first gradient (normwise per tensor, within float32 re-association: see
    tests/workers/__init__.py) and the same metrics of every mini-batch.

    Not the weights: Adam's first step is ~lr * sign(g), so a gradient near zero whose last bits
    differ between the paths moves its weight anywhere in [-lr, lr] (#51). Only the first step's
    gradients are compared: the second is taken at weights the first moved apart by up to lr/eps =
    10x the first gradients' difference (BASE's eps). The mini-batches' metrics agree to float32
    re-association over the tokens (rel 1e-4 ~ u x 288 tokens x 6; abs 1e-6 for a loss near 0); a
    micro-batch summed twice or dropped moves them by >= 1/4 of a mini-batch's rows."""
    params, metrics_a, grads_a = a
    _, metrics_b, grads_b = b
    assert len(grads_a) == len(grads_b) == len(metrics_a["actor/grad_norm"])
    vocab = vocab_rows(params)
    tokens = int(batch.batch["input_ids"].numel())
    assert_same_gradients(grads_b[0], grads_a[0], reassociation_bound(vocab, tokens), "first step")
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
        assert metrics_a[key] == pytest.approx(metrics_b[key], rel=1e-4, abs=1e-6), key


@pytest.mark.numerics
def test_micro_batch_1_vs_4_gives_the_same_update(tiny_model_dir, batch):
    one = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=1"])
    four = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=4"])
    _assert_same_update(one, four, batch)
    before = full_params(local_worker(worker_config(tiny_model_dir), role="ref").worker.ref_policy.module)
    moved = max((one[0][k] - before[k]).abs().max().item() for k in before)
    assert moved > 1e-4  # the update did something, so equality is not vacuous
    assert len(one[1]["actor/grad_norm"]) == 2  # two mini-batches, two optimiser steps


LORA = ["model.lora_rank=8", "model.lora_alpha=16"]


@pytest.mark.numerics
def test_a_lora_update_is_the_same_for_any_micro_batch_size_and_moves_only_the_adapter(tiny_model_dir, batch):
    pytest.importorskip("peft")
    one = _update(tiny_model_dir, batch, LORA + ["actor.ppo_micro_batch_size_per_gpu=1"])
    four = _update(tiny_model_dir, batch, LORA + ["actor.ppo_micro_batch_size_per_gpu=4"])
    _assert_same_update(one, four, batch)
    start = full_params(local_worker(worker_config(tiny_model_dir, LORA), role="actor").worker.actor.module)
    moved = {k for k in start if (one[0][k] - start[k]).abs().max() > 1e-4}
    assert moved and all(".lora_A." in k or ".lora_B." in k for k in moved), moved


@pytest.mark.numerics
def test_token_budget_micro_batches_give_the_same_update(tiny_model_dir, batch):
    fixed = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=4"])
    # 40 tokens: a few rows per micro-batch, packed by length in another order
    dynamic = _update(tiny_model_dir, batch, ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=40"])
    _assert_same_update(fixed, dynamic, batch)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.numerics
def test_gradient_is_exactly_micro_batch_invariant(tiny_model_dir, batch, mode):
    """With SGD(lr=1) and no clipping the weight change is minus the gradient: compare it directly."""
    cfg = to_typed(ActorConfig, worker_config(tiny_model_dir, BASE + [f"actor.loss_agg_mode={mode}", "actor.grad_clip=0"]).actor)

    def grad_step(sizes: ActorBatchSizes, dynamic: bool) -> dict[str, torch.Tensor]:
        module = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")
        before = full_params(module)
        actor_cfg = dataclasses.replace(cfg, use_dynamic_bsz=dynamic)
        engine_cfg = FSDPEngineConfig(path=str(tiny_model_dir), fsdp=FSDPConfig(), optim=cfg.optim,
                                      grad_clip=cfg.grad_clip, cpu_kernels="off")
        engine = FSDPEngine(module, engine_cfg, "cpu", optimizer=torch.optim.SGD(module.parameters(), lr=1.0))
        actor = DataParallelPPOActor(actor_cfg, engine, sizes)
        actor.update_policy(batch)
        return {k: before[k] - v for k, v in full_params(module).items()}

    reference = grad_step(ActorBatchSizes(mini_batch_size=8, micro_batch_size=8), False)
    for sizes, dynamic in [(ActorBatchSizes(8, 1), False), (ActorBatchSizes(8, 3), False),
                           (ActorBatchSizes(8, 1, max_token_len=45), True)]:
        for name, grad in grad_step(sizes, dynamic).items():
            # SGD(lr=1): the gradients themselves, fp32 re-association over micro-batches (rtol); atol for elements ~0
            torch.testing.assert_close(grad, reference[name], atol=1e-6, rtol=1e-4, msg=name)


@pytest.mark.numerics
def test_log_probs_do_not_depend_on_micro_batching(tiny_model_dir, batch):
    group = local_worker(worker_config(tiny_model_dir), role="actor")
    actor = group.worker.actor
    whole, ent_whole = actor.compute_log_prob(batch, calculate_entropy=True, micro_batch_size=8)
    single, ent_single = actor.compute_log_prob(batch, calculate_entropy=True, micro_batch_size=1)
    packed, ent_packed = actor.compute_log_prob(batch, calculate_entropy=True, max_token_len=40)
    for other, ent in [(single, ent_single), (packed, ent_packed)]:
        # micro-batches of other shapes (GEMM blocking, packed order): fp32 rounding only: the same forward in another
        # order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(other, whole, atol=1e-5, rtol=0)  # order restored after packing
        torch.testing.assert_close(ent, ent_whole, atol=1e-5, rtol=0)


def test_micro_batches_go_longest_first_and_are_cut_after_their_longest_response(tiny_model_dir, batch):
    """Padding after a micro-batch's longest response, and before its longest prompt, is never
    computed; outputs are 0 there."""
    actor = local_worker(worker_config(tiny_model_dir, ["model.use_shared_prompt=false"]), role="actor").worker.actor
    masks: list[torch.Tensor] = []

    def padding_mask(mask):  # the engine hands sdpa models transformers' prepared 4-D causal mask
        return mask if mask.dim() == 2 else mask[:, 0, -1, :]  # the last query sees every real key

    hook = actor.module.register_forward_pre_hook(lambda m, a, kw: masks.append(padding_mask(kw["attention_mask"])),
                                                  with_kwargs=True)
    try:
        log_probs, _ = actor.compute_log_prob(batch, micro_batch_size=2)
    finally:
        hook.remove()
    lengths = batch.batch["response_mask"].sum(-1)
    ordered = sorted(lengths.tolist(), reverse=True)
    tp = batch.batch["prompts"].shape[1]
    # each forward: its first column starts some row's prompt, its last one ends some row's response
    assert all(bool(m[:, 0].any()) and bool(m[:, -1].any()) for m in masks)
    assert [int(m[:, -ordered[0]:].sum(-1).max()) for m in masks[:1]] == [ordered[0]]  # longest first
    assert not bool(batch.batch["attention_mask"][:, 0].any())  # the batch begins with left padding, cut above
    widths = [m.shape[1] for m in masks]
    assert min(widths) < batch.batch["input_ids"].shape[1]  # something was cut
    padding = batch.batch["response_mask"] == 0
    assert torch.all(log_probs[padding] == 0) and torch.all(log_probs[~padding] < 0)


@pytest.mark.numerics
def test_remove_padding_gives_the_same_log_probs_and_update(tiny_model_dir, batch):
    padded = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=4"])
    packed = _update(tiny_model_dir, batch, ["actor.ppo_micro_batch_size_per_gpu=4", "model.use_remove_padding=true"])
    _assert_same_update(padded, packed, batch)
    group = local_worker(worker_config(tiny_model_dir, ["model.use_remove_padding=true"]), role="actor_rollout_ref")
    out = group.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    # the packed forward vs the padded one: fp32 rounding only: the same forward in another order (~u·sqrt(H +
    # V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(out.batch["old_log_probs"][mask], batch.batch["old_log_probs"][mask], atol=1e-5, rtol=0)
    ref = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref[mask], batch.batch["ref_log_prob"][mask], atol=1e-5, rtol=0)


# The shared-prompt forward sums a row's attention over the prompt's cache and its own tokens in another
# order than one padded forward: the losses agree to ~1e-7 relative and the gradients within float32
# re-association (Adam had turned that into weight differences of 1.07e-5 at lr 1e-3, #51).

@pytest.mark.parametrize("micro", [2, 4])
@pytest.mark.numerics
def test_shared_prompt_forward_gives_the_same_log_probs_and_update(tiny_model_dir, batch, micro):
    """Each prompt once + its rows from the shared KV cache == one padded forward per row."""
    shared_cfg = ["model.use_shared_prompt=true", f"actor.ppo_micro_batch_size_per_gpu={micro}"]
    group = local_worker(worker_config(tiny_model_dir, shared_cfg), role="actor_rollout_ref")
    actor = group.worker.actor
    micros, _ = actor.engine.lm.micro_batches(batch, MicroBatching(micro))
    assert all(actor.engine.lm.shared_prompt_plan(micros)), "every micro-batch should take the shared path"
    out = group.compute_log_prob(batch)
    mask = batch.batch["response_mask"].bool()
    # the shared prompt's KV cache vs one padded forward per row: fp32 rounding only: the same forward in another
    # order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(out.batch["old_log_probs"][mask], batch.batch["old_log_probs"][mask], atol=1e-5, rtol=0)
    ref = group.compute_ref_log_prob(batch).batch["ref_log_prob"]
    torch.testing.assert_close(ref[mask], batch.batch["ref_log_prob"][mask], atol=1e-5, rtol=0)
    padded = _update(tiny_model_dir, batch, [f"actor.ppo_micro_batch_size_per_gpu={micro}", "model.use_shared_prompt=false"])
    _assert_same_update(padded, _update(tiny_model_dir, batch, shared_cfg), batch)


def test_shared_prompt_is_skipped_when_it_saves_nothing(tiny_model_dir, batch):
    actor = local_worker(worker_config(tiny_model_dir, ["model.use_shared_prompt=true"]), role="actor").worker.actor
    one_per_prompt = batch.select_idxs(torch.arange(0, len(batch), 2))  # n=1: every prompt distinct
    assert actor.engine.lm._prompt_groups(one_per_prompt.batch) is None


def test_nan_advantage_skips_the_step_and_keeps_the_weights(tiny_model_dir, batch):
    group = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=4"]), role="actor")
    before = full_params(group.worker.actor.module)
    poisoned = batch.select(deepcopy=True)
    poisoned.batch["advantages"][0, 0] = float("nan")
    metrics = group.update_actor(poisoned).meta_info["metrics"]
    assert metrics["actor/nan_skipped"] == [1.0]
    after = full_params(group.worker.actor.module)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # the next, healthy batch trains normally (no NaN left behind in grads or optimiser state)
    group.update_actor(batch)
    assert all(torch.isfinite(v).all() for v in full_params(group.worker.actor.module).values())


def test_update_without_optimizer_role_is_a_clear_error(tiny_model_dir, batch):
    group = local_worker(worker_config(tiny_model_dir), role="rollout")
    with pytest.raises(RuntimeError, match="update_actor is not available for role 'rollout'"):
        group.update_actor(batch)


# ---- two real ranks ----------------------------------------------------------------------

_RENDEZVOUS_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from rlfoundry.single_controller import init_ray

    # Ray's processes inherit this process's environment. The in-process workers above left their
    # rendezvous address in it; Ray ranks inheriting it would try to rendezvous on the port this
    # process's own gloo group already holds. Start Ray from a clean environment.
    saved = {k: os.environ.pop(k) for k in _RENDEZVOUS_VARS if k in os.environ}
    if ray.is_initialized():  # left by another module (an in-process Ray trainer): its pools may hold the CPUs
        ray.shutdown()
    try:
        init_ray(address="local", num_cpus=2)
    finally:
        os.environ.update(saved)
    yield
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize("lora", [[], LORA], ids=["full", "lora"])
@pytest.mark.numerics
def test_two_rank_update_equals_one_rank_update(tiny_model_dir, batch, ray_cluster, tmp_path, lora):
    """Ray actors, FSDP2 over gloo: the mini-batch split over 2 ranks gives the 1-rank update (with
    LoRA: the adapter sharded beside its frozen base in the same FSDP2 units; compared merged).

    One mini-batch of all 8 rows (4 prompts x n=2): with several mini-batches the ranks' row
    slices would form *different* mini-batches than one rank's consecutive rows (verl semantics).
    """
    from rlfoundry.single_controller import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
    from rlfoundry.workers.fsdp_workers import ActorRolloutRefWorker

    cfg = worker_config(tiny_model_dir, BASE + lora + ["actor.ppo_mini_batch_size=4",
                                                      "actor.ppo_micro_batch_size_per_gpu=2"])
    pool = RayResourcePool(process_on_nodes=[2], name_prefix="actor2")
    group = RayWorkerGroup(pool, RayClassWithInitArgs(ActorRolloutRefWorker, cfg, "actor"), call_timeout_s=300)
    try:
        group.init_model()
        two = group.update_actor(batch).meta_info["metrics"]
        group.update_actor(batch)  # a second Adam step weighs the two gradients' sizes, not just signs
        group.save_hf_model(str(tmp_path / "two"))
    finally:
        group.shutdown()
        pool.remove()
    one = two_updates_on_one_rank_match(cfg, batch, tmp_path / "one", tmp_path / "two")
    # every rank reports the all-reduced mini-batch numbers: the merged lists repeat them per rank
    assert two["actor/grad_norm"] == pytest.approx(one["actor/grad_norm"] * 2, rel=1e-4)
    assert two["actor/pg_loss"] == pytest.approx(one["actor/pg_loss"] * 2, rel=1e-4, abs=1e-6)


def two_updates_on_one_rank_match(cfg, batch, out_dir, other_dir) -> dict:
    """Two updates on one in-process rank, saved to ``out_dir``; asserts the weights equal the HF
    export in ``other_dir`` (made by the same two updates elsewhere). Returns the first update's metrics.

    The two sides' gradients agree normwise within float32 re-association (reassociation_bound; the
    ranks sum rows in another order), and with ``cfg``'s eps (BASE) each Adam step changes by at most
    lr/eps times a change in the gradient, whose norm is at most grad_clip: so each tensor's weights
    differ by at most steps x (lr/eps) x bound x grad_clip in the 2-norm, doubled for the second
    step's gradient being taken at weights that differ by the first's (~1e-3 here). A rank's rows
    lost or counted twice changes the gradient by O(1), moving every element with |g| >> eps by
    ~lr: >= 8e-3 in the 2-norm of the smallest (64-element) tensor, and ~6e-2 in the matrices."""
    local = local_worker(cfg, role="actor")
    one = local.update_actor(batch).meta_info["metrics"]
    local.update_actor(batch)
    local.save_hf_model(str(out_dir))
    w1, w2 = load_file(out_dir / "model.safetensors"), load_file(other_dir / "model.safetensors")
    optim, tokens = cfg.actor.optim, int(batch.batch["input_ids"].numel())
    vocab = vocab_rows(w1)
    bound = 2 * 2 * optim.lr / optim.eps * reassociation_bound(vocab, tokens) * cfg.actor.grad_clip
    assert set(w1) == set(w2)
    for name in w1:
        err = float((w2[name] - w1[name]).norm())
        assert err <= bound, f"{name}: weights {err:.2e} apart in the 2-norm (bound {bound:.1e})"
    return one


def _fsdp_collectives(model_dir, batch, overrides) -> tuple[tuple, dict[str, int]]:
    """The update, and how many times FSDP2 gathered and reduced each unit during it."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    group = local_worker(worker_config(model_dir, BASE + overrides), role="actor")
    grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        metrics = group.update_actor(batch).meta_info["metrics"]
    counts = Counter(e.name for e in prof.events() if e.name.startswith(("FSDP::all_gather", "FSDP::post_backward_reduce")))
    return (full_params(group.worker.actor.module), metrics, grads), dict(counts)


@pytest.mark.numerics
def test_shared_prompt_gathers_and_reduces_each_unit_once_per_mini_batch(tiny_model_dir, batch):
    """Its second model call (responses on the prompts' cache) would otherwise make every FSDP unit
    reduce-scatter twice and all-gather again in backward; the update must not change."""
    # the hook pausing that makes this possible is one of the CPU kernels (rlfoundry/cpu)
    kept = ["actor.fsdp_config.reshard_after_forward=false", "actor.ppo_micro_batch_size_per_gpu=2",
            "model.cpu_kernels=auto", "actor.fsdp_config.single_rank=fsdp"]
    shared, counts = _fsdp_collectives(tiny_model_dir, batch, kept + ["model.use_shared_prompt=true"])
    padded, padded_counts = _fsdp_collectives(tiny_model_dir, batch, kept + ["model.use_shared_prompt=false"])
    _assert_same_update(padded, shared, batch)
    units = [name for name in counts if name.startswith("FSDP::post_backward_reduce")]
    assert len(units) >= 1, counts  # the root (on one CPU rank it is the only unit: apply_fsdp2)
    mini_batches = len(shared[1]["actor/grad_norm"])
    assert mini_batches == 2
    assert counts == padded_counts, (counts, padded_counts)
    assert all(counts[name] == mini_batches for name in units), counts


@pytest.mark.parametrize("vendor", ["AuthenticAMD", "GenuineIntel"])  # oneDNN linears on AMD only
@pytest.mark.numerics
def test_cpu_kernels_give_the_same_update_as_the_plain_path(tiny_model_dir, batch, vendor, monkeypatch):
    """``model.cpu_kernels=auto`` (oneDNN linears, the fused shared-prompt forward, one FSDP unit)
    changes how the update is computed, never the numbers (to fp32 rounding)."""
    from torch import nn

    from rlfoundry.cpu import linear as cpu_linear
    from rlfoundry.cpu.linear import OneDNNLinear, onednn_available

    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_linear, "onednn_preferred", functools.cache(cpu_linear.onednn_preferred.__wrapped__))
    kinds = {}
    for setting in ("auto", "off"):
        group = local_worker(worker_config(tiny_model_dir, BASE + [f"model.cpu_kernels={setting}",
                                                                   "model.use_shared_prompt=true"]), role="actor")
        kinds[setting] = {type(m) for m in group.worker.actor.module.modules() if isinstance(m, nn.Linear)}
        grads = step_gradients(group.worker.optimizer, group.worker.actor.module)
        metrics = group.update_actor(batch).meta_info["metrics"]
        kinds[setting + "_update"] = (full_params(group.worker.actor.module), metrics, grads)
    assert kinds["off"] == {nn.Linear}
    assert kinds["auto"] == ({OneDNNLinear} if onednn_available() and vendor == "AuthenticAMD" else {nn.Linear})
    _assert_same_update(kinds["auto_update"], kinds["off_update"], batch)
