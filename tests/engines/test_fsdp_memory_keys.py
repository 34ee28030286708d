"""verl's FSDP2 memory and speed keys on the FSDP engine: ``fsdp_config.wrap_policy.
transformer_layer_cls_to_wrap`` (the unit classes), ``fsdp_config.forward_prefetch`` (each unit
starts the next one's all-gather), ``fsdp_config.offload_policy`` and ``model.enable_activation_offload``
(host memory for parameters / saved activations: GPU only, the CPU being the host). Each changes how
the model is sharded or where tensors wait, never the numbers: log-probs and one update match the
default engine's within fp32 rounding."""

from __future__ import annotations

import contextlib

import pytest
import torch
from torch.distributed.fsdp import FSDPModule

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from tests.engines.test_fsdp_engine import _batch, _nll
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.workers import assert_same_gradients, first_step_gradients, reassociation_bound, vocab_rows


def _engine(model_dir, device="cpu", activation_offload=False, **fsdp) -> FSDPEngine:
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(**fsdp), grad_clip=1.0, cpu_kernels="off",
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0), activation_offload=activation_offload)
    return FSDPEngine.build(config, device, role="actor")


def _units(engine) -> list[str]:
    return [type(m).__name__.removeprefix("FSDP") for m in engine.module.modules() if isinstance(m, FSDPModule)]


def _step(engine, device="cpu") -> tuple[dict, dict, dict]:
    """Log-probs before, the update's metrics, and the gradients its one optimiser step took."""
    data = _batch().to(device)
    before = engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=2))
    metrics = engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=2)))
    grads = {n: g.cpu() for n, g in first_step_gradients(engine.optimizer, engine.module).items()}
    return before, metrics, grads


def _assert_same_step(a, b) -> None:
    # fp32 rounding only (another unit layout or prefetch order re-associates nothing larger)
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(a[0][key].cpu(), b[0][key].cpu(), atol=1e-5, rtol=1e-5)
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
    assert a[1]["actor/grad_norm"] == pytest.approx(b[1]["actor/grad_norm"], rel=1e-4)
    # the gradients of the step, not the weights after it: Adam's first step is ~lr * sign(g), so a
    # gradient near zero whose last bits differ moves its weight anywhere in [-lr, lr] (#51); a unit
    # whose gradient is not reduced or is reduced twice is off by O(1)
    vocab, tokens = vocab_rows(a[2]), int(_batch().batch["input_ids"].numel())
    assert_same_gradients(b[2], a[2], reassociation_bound(vocab, tokens))


@pytest.mark.numerics
def test_wrap_policy_layer_classes_are_the_units_and_the_step_is_the_same(process_group, tiny_model_dir):
    plain = _engine(tiny_model_dir)  # one CPU rank, fp32: not wrapped at all
    assert _units(plain) == []
    mlp = _engine(tiny_model_dir, single_rank="fsdp", wrap_policy={"transformer_layer_cls_to_wrap": ["Qwen2MLP"]})
    units = _units(mlp)
    # verl's FSDP2 rule: the named classes, the embeddings when untied from the LM head, then the root
    tied = mlp.module.config.tie_word_embeddings
    assert units.count("Qwen2MLP") == mlp.module.config.num_hidden_layers and units[0] == "Qwen2ForCausalLM"
    assert ("Embedding" in units) == (not tied) and "Qwen2DecoderLayer" not in units
    _assert_same_step(_step(plain), _step(mlp))


def test_a_wrap_class_the_model_lacks_is_an_error_naming_the_key(process_group, tiny_model_dir):
    with pytest.raises(ValueError, match=r"transformer_layer_cls_to_wrap=\['LlamaDecoderLayer'\] names no module.*"
                                         r"Qwen2DecoderLayer"):
        _engine(tiny_model_dir, single_rank="fsdp", wrap_policy={"transformer_layer_cls_to_wrap": "LlamaDecoderLayer"})


@pytest.mark.numerics
def test_forward_prefetch_chains_each_unit_to_the_next_with_the_same_numbers(process_group, tiny_model_dir):
    layers = {"transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}
    off = _engine(tiny_model_dir, single_rank="fsdp", wrap_policy=layers)
    on = _engine(tiny_model_dir, single_rank="fsdp", wrap_policy=layers, forward_prefetch=True)

    def chain(engine):
        units = [m for m in engine.module.modules() if isinstance(m, FSDPModule)][1:]  # the root first
        return [[s is u._get_fsdp_state() for s in a._get_fsdp_state()._states_to_forward_prefetch]
                for a, u in zip(units, units[1:])]

    assert chain(off) == [[]] * (len(_units(off)) - 2)
    assert chain(on) == [[True]] * (len(_units(on)) - 2) and len(_units(on)) - 2 >= 1
    _assert_same_step(_step(off), _step(on))


@pytest.mark.numerics
def test_activation_offload_saves_on_the_host_only_where_there_is_an_accelerator(process_group, tiny_model_dir,
                                                                                 monkeypatch):
    assert isinstance(fu.activation_offload(torch.device("cuda")), torch.autograd.graph.save_on_cpu)
    assert isinstance(fu.activation_offload(torch.device("cpu")), contextlib.nullcontext)
    from rlfoundry.config.schema import ModelConfig

    model = ModelConfig(path=str(tiny_model_dir), enable_activation_offload=True)
    assert FSDPEngineConfig.for_model(model, FSDPConfig()).activation_offload
    entered = []

    def recording(device):
        entered.append(device.type)
        return contextlib.nullcontext()

    monkeypatch.setattr(fu, "activation_offload", recording)
    _assert_same_step(_step(_engine(tiny_model_dir)), _step(_engine(tiny_model_dir, activation_offload=True)))
    assert entered == ["cpu", "cpu"]  # each micro-batch's training forward, never the inference pass


@pytest.mark.numerics
def test_offload_policy_on_the_cpu_changes_nothing(process_group, tiny_model_dir):
    plain, offload = _engine(tiny_model_dir), _engine(tiny_model_dir, offload_policy=True)
    assert _units(offload) == []  # nothing to offload on the host: the single-rank shortcut stands
    _assert_same_step(_step(plain), _step(offload))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.numerics
def test_offloads_lower_peak_gpu_memory_with_the_same_step(process_group, tiny_model_dir):
    """On CUDA: offload_policy keeps the parameters on the host; activation offload lowers the peak."""
    def peak(**kw):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        engine = _engine(tiny_model_dir, "cuda", mixed_precision={"param_dtype": "fp32"}, **kw)
        step = _step(engine, "cuda")
        return torch.cuda.max_memory_allocated(), step, engine

    base, ref, _ = peak()
    offloaded, step, engine = peak(offload_policy=True)
    assert all(p.to_local().device.type == "cpu" for p in engine.module.parameters())
    _assert_same_step(ref, step)
    assert offloaded < base
