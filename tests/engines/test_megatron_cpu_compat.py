"""The CPU shims for megatron-core (``engines/megatron/cpu_compat.py``): each one's megatron-core
call still exists and still names CUDA (else the shim is dead and should go), and with them the
pieces run on the CPU as megatron-core means them to."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")


def test_the_calls_the_shims_stand_in_for_still_name_cuda():
    from megatron.core.models.common.embeddings import rotary_pos_embedding
    from megatron.core.pipeline_parallel import p2p_communication, schedules
    from megatron.core.tensor_parallel import random as mp_random

    # rotary embeddings move inv_freq to torch.cuda.current_device(); p2p allocates shape tensors there
    assert "torch.cuda.current_device()" in inspect.getsource(rotary_pos_embedding.RotaryEmbedding.get_emb)
    assert "torch.cuda.current_device()" in inspect.getsource(p2p_communication)
    assert "torch.cuda.synchronize()" in inspect.getsource(p2p_communication)
    # the schedules allocate their token counter with device="cuda" through their module-level torch
    assert 'device="cuda"' in inspect.getsource(schedules.forward_backward_no_pipelining)
    assert schedules.torch is torch or schedules.torch.__name__ == "torch"
    # the RNG tracker swaps states through these two helpers and seeds CUDA in add()
    assert callable(mp_random._get_cuda_rng_state) and callable(mp_random._set_cuda_rng_state)
    assert "torch.cuda.manual_seed" in inspect.getsource(mp_random.CudaRNGStatesTracker.add)
    for name in ("_DATA_PARALLEL_RNG_TRACKER_NAME", "_MODEL_PARALLEL_RNG_TRACKER_NAME",
                 "_EXPERT_PARALLEL_RNG_TRACKER_NAME"):
        assert isinstance(getattr(mp_random, name), str)
    # tied embeddings across pipeline stages: the shared weight is moved to CUDA before its all-reduce
    from megatron.core.models.common.language_module.language_module import LanguageModule

    setup = inspect.unwrap(LanguageModule.setup_embeddings_and_output_layer)
    assert "weight.data = weight.data.cuda()" in inspect.getsource(setup)
    # context parallelism: this rank's rotary chunks are picked with a pinned index tensor moved to CUDA
    from megatron.core.models.common.embeddings import rope_utils

    chunks = inspect.getsource(inspect.unwrap(rope_utils.get_pos_emb_on_this_cp_rank))
    assert "pin_memory=True" in chunks and ".cuda(non_blocking=True)" in chunks
    # MoE: the all-to-all dispatcher makes a CUDA stream and copies its split sizes to the host on it
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    assert "torch.cuda.Stream()" in inspect.getsource(MoEAlltoAllTokenDispatcher.__init__)
    dtoh = inspect.getsource(inspect.unwrap(MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize))
    assert "torch.cuda.stream(" in dtoh and "as_numpy=True" in dtoh
    # gloo: the dispatcher's gather of unequal parts over the expert tensor-parallel ranks (TP x EP)
    from megatron.core.tensor_parallel import mappings

    gather = inspect.getsource(inspect.unwrap(mappings._gather_along_first_dim))
    assert "torch.distributed.all_gather(output_tensor_list, input_, group=group)" in gather
    post = inspect.getsource(MoEAlltoAllTokenDispatcher.dispatch_postprocess)
    assert "output_split_sizes = self.output_splits_tp.tolist()" in post and "output_split_sizes=output_split_sizes" in post
    # the router reads te_general_gemm, which moe_utils binds only when TransformerEngine imports
    assert "te_general_gemm is not None" in inspect.getsource(moe_utils.RouterGatingLinearFunction.forward)
    # the CPU optimiser: CUDA streams when built and at each step; the split by is_cuda, copies pinned
    from megatron.core.optimizer.cpu_offloading.hybrid_optimizer import HybridDeviceOptimizer

    init = inspect.getsource(HybridDeviceOptimizer._init_sub_optimizers)
    assert "torch.cuda.current_stream()" in init and "torch.cuda.Stream()" in init
    assert "torch.cuda.stream(" in inspect.getsource(HybridDeviceOptimizer.step)
    split = inspect.getsource(inspect.unwrap(HybridDeviceOptimizer._get_sub_optimizer_param_groups))
    assert "param.is_cuda" in split and ".cpu().pin_memory()" in split and ".float()" in split
    # OptimizerConfig asks TransformerEngine's version (None without it) before its CPU-offload early return
    from megatron.core.optimizer.optimizer_config import OptimizerConfig

    post_init = inspect.getsource(OptimizerConfig.__post_init__)
    assert post_init.index('is_te_min_version("2.1.0")') < post_init.index("if self.optimizer_cpu_offload:")


def test_the_calls_the_megatron_fsdp_stand_ins_replace_still_name_cuda():
    """Megatron-FSDP (use_megatron_fsdp): streams, "cuda:N" device names, "cuda" device meshes, a .cuda()
    in its DTensor check, and the PREMUL_SUM reduction the engine turns off on the CPU."""
    from megatron.core.distributed.fsdp import mcore_fsdp_adapter
    from megatron.core.distributed.fsdp.src.megatron_fsdp import megatron_fsdp, param_and_grad_buffer, uneven_dtensor

    assert "torch.cuda.Stream()" in inspect.getsource(megatron_fsdp.MegatronFSDP._init_fsdp_param_and_grad_buffer)
    assert 'torch.device(f"cuda:{torch.cuda.current_device()}")' in inspect.getsource(megatron_fsdp.MegatronFSDP.__init__)
    buffers = inspect.getsource(param_and_grad_buffer)
    assert "torch.cuda.stream(" in buffers and "torch.cuda.current_stream()" in buffers and ".record_event()" in buffers
    assert "_make_nccl_premul_sum" in inspect.getsource(param_and_grad_buffer.gradient_reduce_preprocessing)
    assert 'device_type="cuda"' in inspect.getsource(mcore_fsdp_adapter.FullyShardedDataParallel._init_dist_index)
    assert ").cuda()" in inspect.getsource(inspect.unwrap(uneven_dtensor.validate_uneven_dtensor))


def test_tensor_cuda_keeps_a_cpu_tensor_in_place_only_while_the_wrapped_call_runs():
    from rlfoundry.engines.megatron.cpu_compat import _with_cuda_as_cpu

    original = torch.Tensor.cuda
    t = torch.ones(2)
    assert _with_cuda_as_cpu(lambda x: x.cuda())(t) is t
    assert torch.Tensor.cuda is original


def _runs_ok_in_a_fresh_cpu_process(code: str) -> None:
    """``code`` in its own interpreter (the shims patch process-wide state), ending with ``print('ok')``."""
    if torch.cuda.is_available():
        pytest.skip("the shims apply only without CUDA")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]


def test_install_redirects_cuda_placements_to_the_cpu():
    code = (
        "import torch\n"
        "from rlfoundry.engines.megatron import cpu_compat\n"
        "from megatron.core.pipeline_parallel import schedules\n"
        "assert cpu_compat.install() and cpu_compat.install()\n"
        "assert schedules.torch.zeros([], dtype=torch.int, device='cuda').device.type == 'cpu'\n"
        "assert schedules.torch.zeros(2, device='cpu').device.type == 'cpu'\n"
        "assert schedules.torch.no_grad is torch.no_grad and schedules.torch.Tensor is torch.Tensor\n"
        "assert torch.ones(2).to(device=torch.cuda.current_device()).device.type == 'cpu'\n"
        "torch.cuda.synchronize()\n"
        "print('ok')\n"
    )
    _runs_ok_in_a_fresh_cpu_process(code)


def test_the_hybrid_optimizer_splits_and_steps_as_on_a_gpu():
    """megatron-core's HybridDeviceOptimizer on the CPU, as megatron-core builds it for Adam: at fraction
    0.5 the first parameters (by elements) get host copies stepped by per-parameter host AdamWs, the
    rest (fp32 copies of the bf16 parameters) the "device" AdamW; a step writes the same bf16 weights as
    torch's fused AdamW over fp32 copies; torch's own tensor methods are back afterwards."""
    code = (
        "import torch\n"
        "from rlfoundry.engines.megatron import cpu_compat\n"
        "assert cpu_compat.install()\n"
        "from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer\n"
        "own = {n: torch.Tensor.__dict__.get(n) for n in ('is_cuda', 'pin_memory', 'cpu', 'clone', 'float', 'detach')}\n"
        "g = torch.Generator().manual_seed(0)\n"
        "params = [torch.nn.Parameter(torch.randn(n, generator=g).bfloat16()) for n in (8, 8, 4, 12)]\n"
        "kw = dict(lr=1e-2, weight_decay=0.1, betas=(0.9, 0.999), eps=1e-8, bias_correction=True, fused=True)\n"
        "hdo = HybridDeviceOptimizer([{'params': params}], offload_fraction=0.5, cpu_optimizer_cls=torch.optim.AdamW,\n"
        "    gpu_optimizer_cls=torch.optim.AdamW, overlap_cpu_optimizer_d2h_h2d=True, param_update_in_fp32=True, **kw)\n"
        "assert {n: torch.Tensor.__dict__.get(n) for n in own} == own and not params[0].is_cuda\n"
        "assert list(hdo.gpu_params_map_cpu_copy) == params[:2] and len(hdo.cpu_optimizers) == 2\n"
        "assert [p.dtype for o in hdo.sub_optimizers for gr in o.param_groups for p in gr['params']] == [torch.float32] * 4\n"
        "assert hdo.gpu_optimizer.param_groups[0]['params'] == [hdo.param_to_fp32_param[p] for p in params[2:]]\n"
        "masters = [torch.nn.Parameter(p.detach().float()) for p in params]\n"
        "plain = torch.optim.AdamW(masters, **{k: v for k, v in kw.items() if k != 'bias_correction'})\n"
        "for step in range(3):\n"
        "    for p, m in zip(params, masters):\n"
        "        grad = torch.randn(p.shape, generator=g)\n"
        "        p.grad, m.grad = grad.bfloat16(), grad.bfloat16().float()\n"
        "    hdo.step(); plain.step()\n"
        "assert all(torch.equal(p, m.bfloat16()) for p, m in zip(params, masters))\n"
        "assert all(torch.equal(hdo.state[p]['exp_avg'], plain.state[m]['exp_avg']) for p, m in zip(params, masters))\n"
        "print('ok')\n"
    )
    _runs_ok_in_a_fresh_cpu_process(code)


def _draws(rank: int):
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    before = torch.get_rng_state()
    with get_cuda_rng_tracker().fork():
        first = torch.rand(4)
    with get_cuda_rng_tracker().fork():
        second = torch.rand(4)
    untouched = torch.equal(before, torch.get_rng_state())
    return {"first": first, "second": second, "default": torch.rand(4), "untouched": untouched}


@pytest.mark.slow
def test_model_parallel_rng_on_the_cpu_generator(tmp_path):
    """Tensor-parallel ranks draw different numbers inside the model-parallel region (dropout of
    split activations) and the same outside it; the region's state advances and leaves the
    default generator alone."""
    a, b = run_ranks(_draws, 2, tmp_path, tp=2)
    assert a["untouched"] and b["untouched"]
    assert not torch.equal(a["first"], a["second"])
    assert not torch.equal(a["first"], b["first"])
    assert torch.equal(a["default"], b["default"])


def _uneven_gather(rank: int):
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region

    sizes = [2, 3]  # what the MoE dispatcher gathers at TP x EP: each rank's tokens for this rank's experts
    part = torch.arange(sizes[rank] * 4, dtype=torch.float32).view(-1, 4).add(100 * rank).requires_grad_()
    whole = gather_from_sequence_parallel_region(part, group=ps.get_tensor_model_parallel_group(),
                                                 output_split_sizes=sizes)
    weights = torch.arange(whole.numel(), dtype=torch.float32).view_as(whole)
    (whole * weights).sum().backward()  # the backward: an uneven reduce-scatter, which gloo runs itself
    return {"whole": whole.detach(), "grad": part.grad}


@pytest.mark.slow
def test_a_gather_of_unequal_parts_runs_over_gloo(tmp_path):
    """megatron-core's sequence-parallel gather with ``output_split_sizes`` (2 and 3 rows here): gloo's
    all_gather takes equal sizes only; with the shim every rank gets both parts in rank order, and the
    backward hands each rank the sum over ranks of its rows' gradient (both ranks' weights are equal)."""
    a, b = run_ranks(_uneven_gather, 2, tmp_path, tp=2)
    expected = torch.cat([torch.arange(8.0).view(2, 4), torch.arange(12.0).view(3, 4) + 100])
    assert torch.equal(a["whole"], expected) and torch.equal(b["whole"], expected)
    weights = torch.arange(20.0).view(5, 4)
    assert torch.equal(a["grad"], 2 * weights[:2]) and torch.equal(b["grad"], 2 * weights[2:])
