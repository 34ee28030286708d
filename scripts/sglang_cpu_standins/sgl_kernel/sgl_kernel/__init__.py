"""Import-only stand-in for the CPU symbols of ``sgl_kernel``, installed by ``scripts/setup_sglang_cpu.sh``.

Why it exists: with ``SGLANG_USE_CPU_ENGINE=1``, SGLang 0.5.23 imports a few ``*_cpu`` names from
``sgl_kernel`` at module level (under ``if _is_cpu:``), so ``sglang.Engine`` cannot even start
without the package. The real one on PyPI (``sgl-kernel`` / ``sglang-kernel``) is a CUDA build; its CPU
build has to be compiled from SGLang's source against the exact torch. None of these names is called
when serving a plain causal LM:

* SGLang's CPU kernels proper (``torch.ops.sgl_kernel.*``: fused norms, rotary, attention, packed
  linear) are used only on CPUs with Intel AMX, detected by ``torch.cpu._is_amx_tile_supported()`` *and*
  ``hasattr(torch.ops.sgl_kernel, "convert_weight_packed")`` (``sglang.srt.utils.common.
  cpu_has_amx_support``). This stand-in registers no torch ops, so SGLang always takes its pure-torch
  paths (``attention_backend="torch_native"``, native norms/rotary/sampling), AMX or not.
* The names below are called only by speculative decoding (EAGLE / tree verification / DFlash slot
  assignment) and the KV-cache moves it does; rlfoundry's CPU setup does not enable speculative decoding.

* A few torch ops that SGLang's Qwen3.5-family model files look up at module level
  (``torch.ops.sgl_kernel.<name>``, ``_TORCH_OPS`` below) are defined here, schema only: its multimodal
  processor for Qwen2-VL (``sglang/srt/multimodal/processors/qwen_vl.py``) imports those files, and
  without the ops that import fails and SGLang finds no processor for any Qwen-VL model
  (``No processor registered for architecture: ['Qwen2VLForConditionalGeneration']``). Defining them does
  not turn on the AMX path (that checks ``convert_weight_packed``, which stays undefined). rlfoundry's
  SGLang rollout imports this package before SGLang on the CPU so they exist in time.

If anything does call one of them, it raises a ``RuntimeError`` naming this stand-in. Distributed as
``rlfoundry-standin-sgl-kernel`` so pip never reports a real sgl-kernel as installed.
"""

from __future__ import annotations

__version__ = "0.0.0+rlfoundry.standin"
STANDIN = True

_MESSAGE = (
    "rlfoundry's sgl_kernel stand-in (scripts/sglang_cpu_standins/sgl_kernel, installed by "
    "scripts/setup_sglang_cpu.sh for SGLang on CPU) was called: sgl_kernel.{name}. It only satisfies "
    "SGLang's imports; the feature that called it (speculative decoding, or the Intel AMX path) needs "
    "sgl-kernel's CPU build, compiled from SGLang's source."
)


def _standin(name: str):
    def fn(*args, **kwargs):
        raise RuntimeError(_MESSAGE.format(name=name))

    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = f"Stand-in for sgl_kernel.{name}: raises when called."
    return fn


# Every name SGLang 0.5.23 imports from `sgl_kernel` at module level under `if _is_cpu:` (an AST scan of
# the installed package), with the module that imports it.
_CPU_NAMES = (
    "assign_req_to_token_pool_cpu",  # sglang/srt/mem_cache/allocation.py (speculative decoding slots)
    "copy_all_layer_kv_cache_cpu",  # sglang/kernels/ops/kvcache/cache_move.py (KV moves after spec. decoding)
    "assign_draft_cache_locs_contiguous_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "assign_extend_cache_locs_cpu",  # sglang/kernels/ops/speculative/cache_locs.py
    "fill_accept_out_cache_loc_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "fill_bonus_tokens_cpu",  # sglang/kernels/ops/speculative/eagle.py
    "rotate_input_ids_cpu",  # sglang/kernels/ops/speculative/multi_layer_eagle.py
    "build_tree_kernel_efficient_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
    "verify_tree_greedy_cpu",  # sglang/kernels/ops/speculative/spec_tree.py
)

for _name in _CPU_NAMES:
    globals()[_name] = _standin(_name)
del _name

# torch ops read at module level by sglang/srt/models/qwen3_5.py (imported by the Qwen-VL multimodal processor)
_TORCH_OPS = (
    "fused_sigmoid_mul_cpu",
    "fused_qk_gemma_rmsnorm_cpu",
    "fused_qk_gemma_rmsnorm_with_gate_cpu",
    "fused_qkvzba_split_reshape_cat_contiguous_cpu",
)


def _define_torch_ops() -> object:
    import torch

    library = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in _TORCH_OPS:
        if not hasattr(torch.ops.sgl_kernel, name):
            library.define(f"{name}(Tensor x) -> Tensor")
            library.impl(name, _standin(name), "CompositeImplicitAutograd")
    return library


_LIBRARY = _define_torch_ops()  # kept: the ops live as long as the library object

__all__ = list(_CPU_NAMES)
