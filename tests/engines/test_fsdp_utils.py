"""FSDP2 plumbing: model loading errors, sharding layout, grad-norm, LR schedules by hand."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from rlfoundry.config.schema import OptimConfig
from rlfoundry.config.typed import to_typed
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.models.hf import load_hf_model
from tests.workers import local_worker, one_thread, worker_config  # noqa: F401 (fixture)


def world_of_one(backend: str = "gloo"):
    """World size 1, as Worker.init_distributed makes it: gloo on the CPU, ``cpu:gloo,cuda:nccl`` on
    CUDA (shared if one already exists)."""
    if not dist.is_initialized():
        from rlfoundry.single_controller.base.worker import find_free_port

        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(find_free_port()))
        dist.init_process_group(backend, rank=0, world_size=1)
    return dist.group.WORLD


@pytest.fixture(scope="module")
def process_group():
    return world_of_one()


# ---- LR schedule -------------------------------------------------------------------------

def _lrs(optim_cfg: dict, steps: int, total: int | None = None) -> list[float]:
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = fu.build_lr_scheduler(opt, to_typed(OptimConfig, optim_cfg), total)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_warmup_then_cosine_by_hand():
    # warm-up 2 steps: 0, 1/2; then progress p = (s - 2) / (10 - 2) and
    # lr = 0.1 + 0.9 * (1 + cos(pi p)) / 2: s=2 -> 1, s=6 (p=1/2) -> 0.55, s=10 (p=1) -> 0.1, held after.
    lrs = _lrs({"lr_warmup_steps": 2, "warmup_style": "cosine", "min_lr_ratio": 0.1}, 12, total=10)
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[6] == pytest.approx(0.55)
    assert lrs[4] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lrs[10] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1)


def test_lr_decay_steps_is_the_schedules_length():
    # Megatron's lr_decay_steps=6 in a 10-step run: warm-up ratio 1/3 of 6 = 2 steps (0, 1/2), then the
    # cosine from 1 at s=2 to 0.1 at s=6 (p = (s - 2) / 4: s=4 -> 0.55), held at 0.1 to the run's end.
    lrs = _lrs({"lr_warmup_steps_ratio": 1 / 3, "warmup_style": "cosine", "min_lr_ratio": 0.1,
                "lr_decay_steps": 6}, 10, total=10)
    assert lrs[:3] == pytest.approx([0.0, 0.5, 1.0])
    assert lrs[4] == pytest.approx(0.55)
    assert lrs[6:] == pytest.approx([0.1] * 4)


def test_warmup_ratio_constant_and_no_decay_without_total():
    # ratio 0.25 of 8 steps = 2 warm-up steps, then constant 1 (verl's lr_scheduler_type name)
    assert _lrs({"lr_warmup_steps": -1, "lr_warmup_steps_ratio": 0.25, "lr_scheduler_type": "constant"}, 4, 8) == \
        pytest.approx([0.0, 0.5, 1.0, 1.0])
    # total_training_steps -1 / None: cosine cannot know where to end, so it does not decay
    assert _lrs({"warmup_style": "cosine", "total_training_steps": -1}, 3) == pytest.approx([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"not one of \['constant', 'cosine'\]"):
        _lrs({"warmup_style": "linear"}, 1)


# ---- loading -----------------------------------------------------------------------------

def test_missing_model_path_names_the_path_and_the_fix(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model.*does not exist.*model.path"):
        load_hf_model(missing)
    (tmp_path / "not-a-model").mkdir()
    with pytest.raises(FileNotFoundError, match="not-a-model.*not a Hugging Face model directory.*config.json"):
        load_hf_model(tmp_path / "not-a-model")


def test_worker_with_bad_model_path_fails_clearly(tmp_path):
    cfg = worker_config(tmp_path, [f"model.path={tmp_path / 'nowhere'}"])
    with pytest.raises(FileNotFoundError, match="nowhere"):
        local_worker(cfg)


def test_token_classification_is_a_one_value_head(tiny_critic_dir):
    model = load_hf_model(tiny_critic_dir, model_kind="token_classification")
    assert model(input_ids=torch.tensor([[5, 6, 7]])).logits.shape == (1, 3, 1)


# ---- sharding ----------------------------------------------------------------------------

@pytest.mark.numerics
def test_fsdp2_wraps_each_layer_and_keeps_outputs_and_grad_norm(tiny_model_dir, process_group):
    plain = load_hf_model(tiny_model_dir)
    sharded = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu", layer_units=True)
    assert isinstance(sharded, FSDPModule)
    assert all(isinstance(layer, FSDPModule) for layer in sharded.model.layers)
    x = torch.tensor([[3, 9, 27, 81, 12], [4, 5, 6, 7, 8]])
    for model in (plain, sharded):
        model(input_ids=x).logits.square().mean().backward()
    # FSDP2's one-rank shard runs the same ops: default fp32 tolerances (1.3e-6 rel) hold
    torch.testing.assert_close(sharded(input_ids=x).logits, plain(input_ids=x).logits)
    expected = torch.nn.utils.get_total_norm([p.grad for p in plain.parameters()]).item()
    norm = fu.clip_grad_norm_(sharded.parameters(), max_norm=expected / 2)
    # the norm of sharded DTensor gradients: the same squares summed per shard, then across: fp32 rounding
    assert isinstance(norm, float) and norm == pytest.approx(expected, rel=1e-5)
    # clipped to half: the norm measured again is max_norm
    assert fu.clip_grad_norm_(sharded.parameters(), max_norm=None) == pytest.approx(expected / 2, rel=1e-4)


def test_unsharded_cpu_model_is_one_unit_with_one_gradient_reduction(tiny_model_dir, process_group):
    """Nothing to shard (one rank here; fsdp_size=1 on many): per-layer units would only add one
    blocking gradient reduction each on the CPU, so the root is the only unit."""
    from torch.profiler import profile

    model = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")
    assert isinstance(model, FSDPModule)
    assert not any(isinstance(layer, FSDPModule) for layer in model.model.layers)
    with profile() as prof:
        model(input_ids=torch.tensor([[3, 9, 27, 81, 12]])).logits.square().mean().backward()
    reductions = [e.name for e in prof.events() if e.name.startswith("FSDP::post_backward_reduce")]
    assert reductions == ["FSDP::post_backward_reduce"], reductions
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.numerics
def test_optimizer_steps_sharded_weights_exactly_like_plain_adamw(tiny_model_dir, process_group):
    """build_optimizer's fused AdamW over DTensor shards == torch's fused AdamW on a plain copy, bit
    for bit (weight decay, betas and eps from verl's keys), and torch's default AdamW to rounding."""
    plain, default = load_hf_model(tiny_model_dir), load_hf_model(tiny_model_dir)
    sharded = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")
    cfg = {"lr": 1e-2, "weight_decay": 0.1, "betas": [0.8, 0.9], "eps": 1e-6}
    optimizers = [fu.build_optimizer(sharded, to_typed(OptimConfig, cfg)),
                  torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6,
                                    fused=True),
                  torch.optim.AdamW(default.parameters(), lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-6)]
    x = torch.tensor([[3, 9, 27, 81, 12], [4, 5, 6, 7, 8]])
    for step in range(3):
        for model, opt in zip((sharded, plain, default), optimizers):
            model(input_ids=x + step).logits.square().mean().backward()
            opt.step()
            opt.zero_grad()
    full = {k: v.full_tensor() for k, v in sharded.state_dict().items()}
    for name, value in plain.state_dict().items():
        assert torch.equal(full[name], value), name
        # torch's foreach AdamW vs the fused kernel on bit-equal gradients: the update's own rounding, ~u x |w|, not
        # amplified
        torch.testing.assert_close(default.state_dict()[name], value, rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(full["lm_head.weight"], load_hf_model(tiny_model_dir).lm_head.weight)


def test_unsharded_gathers_once_and_reshards_after(tiny_model_dir, process_group):
    model = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")
    weight = lambda: model.model.layers[0].mlp.up_proj.weight  # noqa: E731
    x = torch.tensor([[1, 2, 3]])
    before = model(input_ids=x).logits
    with fu.unsharded(model):
        assert not hasattr(weight(), "full_tensor")  # plain parameters for the whole block
        torch.testing.assert_close(model(input_ids=x).logits, before)
        assert not hasattr(weight(), "full_tensor")  # a forward did not reshard them
    assert hasattr(weight(), "full_tensor")  # sharded DTensor again


def test_nonfinite_grad_norm_is_reported_not_clipped(tiny_model_dir, process_group):
    model = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")
    model(input_ids=torch.tensor([[1, 2]])).logits.sum().backward()
    first = next(p for p in model.parameters() if p.grad is not None)
    first.grad.to_local().view(-1)[0] = float("nan")
    assert math.isnan(fu.clip_grad_norm_(model.parameters(), max_norm=1.0))


def test_device_mesh_from_fsdp_size(process_group):
    """-1 or a size >= the world: one sharding dimension; 0 is refused with the key's name."""
    for size in (-1, 1, 8):
        mesh = fu.device_mesh("cpu", size)
        assert mesh.mesh_dim_names == ("fsdp",) and tuple(mesh.shape) == (1,)
    with pytest.raises(ValueError, match=r"fsdp_config.fsdp_size must be -1 .* or >= 1, got 0"):
        fu.device_mesh("cpu", 0)


@pytest.mark.numerics
def test_fused_forward_runs_on_one_fsdp_unit_and_leaves_per_layer_units_to_hf(tiny_model_dir, process_group):
    """Through the root unit's own hooks the fused pass gathers and reduces like the HF forward; with
    per-layer units those layers' hooks would be skipped, so it declines."""
    from rlfoundry.cpu import fused_forward
    from tests.cpu.test_fused_forward import _batch, _lm

    per_layer = fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu", layer_units=True)
    assert "FSDP units below the root" in fused_forward.unsupported_reason(per_layer, 20)
    batch = _batch(per_layer.config.vocab_size)
    grads = {}
    for name, model in (("fsdp", fu.apply_fsdp2(load_hf_model(tiny_model_dir), "cpu")),
                        ("plain", load_hf_model(tiny_model_dir))):
        assert fused_forward.unsupported_reason(model, 20) is None
        actor = _lm(model, True)
        first, group = actor._prompt_groups(batch)
        logits, *_ = actor._shared_prompt_response_logits(batch, first, group)
        logits.square().mean().backward()
        grads[name] = {k: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad)
                       for k, p in model.named_parameters()}
    for key, grad in grads["plain"].items():
        # the fused pass under FSDP2's root hooks vs on the plain module: the same ops, fp32 rounding at most
        torch.testing.assert_close(grads["fsdp"][key], grad, atol=1e-6, rtol=1e-5, msg=key)


def test_optimizer_moments_come_back_to_their_parameters_device():
    """optimizer_offload on the GPU parks AdamW moments on the host; before the step each must be on its
    own parameter's device: the GPU, or the host when FSDP2 offloads the parameters (param_offload). On
    an H200 moving them all to the engine's device made the fused step refuse (2026-11-26). Without a
    second real device here, one parameter lives on the meta device: its moments follow it there, the
    host parameter's stay."""
    on_host, elsewhere = torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.empty(2, 2, device="meta"))
    optimizer = torch.optim.AdamW([on_host, elsewhere], lr=0.1)
    for p in (on_host, elsewhere):  # moments parked on the host, as offload_optimizer leaves them
        optimizer.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.ones(p.shape), "exp_avg_sq": torch.ones(p.shape)}
    fu.load_optimizer(optimizer)
    moments = ("exp_avg", "exp_avg_sq")
    assert {optimizer.state[elsewhere][k].device.type for k in moments} == {"meta"}
    assert {optimizer.state[on_host][k].device.type for k in moments} == {"cpu"}
