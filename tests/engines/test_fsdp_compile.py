"""verl's ``actor.use_torch_compile`` / ``ref.use_torch_compile`` on the FSDP engine: each decoder
layer's forward compiled with dynamic shapes (engines/fsdp/compile.py). Compiled log-probs, entropy and
one update equal eager ones within fp32 rounding; the layers really run compiled (dynamo's graph
counters); micro-batches of another length reuse the graphs; the key off compiles nothing.

CPU inductor (gcc) compiles one Qwen2 layer in ~25 s per graph here (no-grad and training: two
graphs), so the compiled engine is built once for the module."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp import utils as fu
from rlfoundry.engines.fsdp.compile import compile_problems
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from tests.engines.test_fsdp_engine import _batch, _nll
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture
from tests.workers import assert_same_gradients, first_step_gradients, reassociation_bound, vocab_rows


def _engine(model_dir, compile_: bool, cpu_kernels: str = "off", **fields) -> FSDPEngine:
    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels=cpu_kernels,
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0), use_torch_compile=compile_, **fields)
    return FSDPEngine.build(config, "cpu", role="actor")


def _graphs() -> int:
    return counters["stats"]["unique_graphs"]


def _step(engine, tr: int = 6):
    """Log-probs before, the update's metrics, and (on the engine's first step) the gradients it took."""
    data = _batch(tr=tr)
    before = engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=2))
    metrics = engine.train_batch(data, LogProbs(), _nll, UpdatePlan(mini_batch_size=4, micro=MicroBatching(size=2)))
    first = int(next(iter(engine.optimizer.state.values()))["step"]) == 1
    return before, metrics, first_step_gradients(engine.optimizer, engine.module) if first else None


def _bound(engine, tr: int = 6) -> float:
    """float32 re-association over the vocabulary and the batch's tokens (tests/workers/__init__.py)."""
    vocab = vocab_rows(dict(engine.module.named_parameters()))
    return reassociation_bound(vocab, int(_batch(tr=tr).batch["input_ids"].numel()))


def _shared():
    """Rows 0-1 and 2-3 share their prompt (what rollout.n > 1 gives)."""
    data = _batch()
    ids = data.batch["input_ids"]
    ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
    return data


@pytest.mark.numerics
def test_compiled_layers_give_eager_numbers_and_do_not_recompile_for_other_lengths(process_group, tiny_model_dir):
    torch._dynamo.reset()
    counters.clear()
    eager, compiled = _engine(tiny_model_dir, False), _engine(tiny_model_dir, True)
    layers = fu.get_decoder_layers(compiled.module)
    assert eager.compiled is None and compiled.compiled.layers == layers and len(layers) >= 2
    a, b = _step(eager), _step(compiled)
    # every layer's forward went through dynamo: one graph for the no-grad log-prob forward, one for the
    # training forward (the layers share them: one code object, parameters as inputs)
    assert _graphs() == 2, dict(counters["stats"])
    # fp32 on the CPU: inductor fuses and reorders the element-wise ops (RMSNorm, rotary, SiLU), so the
    # numbers move by rounding only (measured ~1e-7 on log-probs)
    torch.testing.assert_close(b[0]["log_probs"], a[0]["log_probs"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[0]["entropy"], a[0]["entropy"], atol=1e-5, rtol=1e-5)
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
    assert b[1]["actor/grad_norm"] == pytest.approx(a[1]["actor/grad_norm"], rel=1e-4)
    # the gradients of the one Adam step, not the weights after it: the first step is ~lr * sign(g) per
    # element, which turned rounding in gradients near zero into weight differences of 9.7e-5 at lr 1e-2
    # on one CPU and up to 2 lr on another (#51). Inductor re-associates the element-wise ops only, well
    # within the bound; a wrongly compiled op (a rotary sign, a dropped residual) moves them by O(1)
    assert_same_gradients(b[2], a[2], _bound(eager), "compiled")
    # micro-batches of another length (11 -> 14 tokens) reuse both graphs: dynamic shapes, no recompile
    _step(compiled, tr=9)
    assert _graphs() == 2, dict(counters["stats"])
    # rows sharing a prompt: the shared-prompt forward (its KV cache would recompile per layer) steps aside
    fresh = [_engine(tiny_model_dir, c, use_shared_prompt=True) for c in (False, True)]
    a, b = (e.infer_batch(_shared(), LogProbs(), MicroBatching(size=4))["log_probs"] for e in fresh)
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert _graphs() == 2, dict(counters["stats"])
    # outside the engine's forwards (the HF rollout samples from this module) the layers are eager
    assert all("forward" not in vars(layer) for layer in layers)


def test_key_off_compiles_nothing_and_keeps_the_cpu_kernels(process_group, tiny_model_dir):
    counters.clear()
    engine = _engine(tiny_model_dir, False, cpu_kernels="auto")
    engine.infer_batch(_batch(), LogProbs(), MicroBatching(size=2))
    assert engine.compiled is None and engine.cpu_kernels and _graphs() == 0
    # on: the CPU kernels step aside for the compiled layers (dynamo cannot trace them)
    assert _engine(tiny_model_dir, True, cpu_kernels="auto").cpu_kernels is False


def test_what_is_not_compiled_is_a_start_up_error_naming_the_key():
    assert compile_problems(ulysses=1, vision=False) == []
    problems = compile_problems(ulysses=2, vision=True)
    assert len(problems) == 2 and "ulysses_sequence_parallel_size" in problems[0] and "vision" in problems[1]
    assert all("use_torch_compile" in p for p in problems)


def test_the_workers_keys_reach_the_actor_and_reference_engines(tiny_model_dir):
    """actor_rollout_ref.actor.use_torch_compile compiles the actor's engine and, followed by default,
    the reference's; ref.use_torch_compile=false keeps the reference eager (nothing runs: no compile)."""
    from tests.workers import local_worker, worker_config

    both = local_worker(worker_config(tiny_model_dir, ["actor.use_torch_compile=true"])).worker
    assert both.engine.compiled is not None and both.ref_policy.engine.compiled is not None
    actor_only = local_worker(worker_config(tiny_model_dir, ["actor.use_torch_compile=true",
                                                             "ref.use_torch_compile=false"])).worker
    assert actor_only.engine.compiled is not None and actor_only.ref_policy.engine.compiled is None


@pytest.mark.slow
@pytest.mark.numerics
def test_lora_and_gradient_checkpointing_compile_to_the_same_update(process_group, tiny_model_dir):
    """A peft adapter on the compiled layers, and HF gradient checkpointing (its recompute in backward
    runs inside the engine's compiled block): same log-probs, gradient norm and adapter after one step."""
    from rlfoundry.models.lora import LoraSpec

    fields = dict(lora=LoraSpec(rank=4), gradient_checkpointing=True)
    eager = _engine(tiny_model_dir, False, **fields)
    a, graphs = _step(eager), _graphs()
    b = _step(_engine(tiny_model_dir, True, **fields))
    assert _graphs() > graphs  # the adapted, checkpointed layers ran compiled (graphs of their own)
    # fp32 rounding only: the same forward in another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(b[0]["log_probs"], a[0]["log_probs"], atol=1e-5, rtol=1e-5)
    assert b[1]["actor/grad_norm"] == pytest.approx(a[1]["actor/grad_norm"], rel=1e-4)
    # the adapter's gradients in its first Adam step (A's are exactly 0 on both sides: B starts at 0),
    # not the merged weights W + scaling * B A after it (Adam's ~lr * sign(g): #51)
    assert_same_gradients(b[2], a[2], _bound(eager), "compiled LoRA")
