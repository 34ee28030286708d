"""rlfoundry's SGLang plugin: SGLang loads it in each of its processes (the entry point group
``sglang.srt.plugins`` in pyproject.toml; SGLang's general-plugin mechanism, ``sglang.srt.plugins``).

What it does: lets SGLang's CPU engine keep the experts its MoE routers chose (``enable_return_routed_experts``,
MoE routing replay). SGLang allocates that record's host buffer through ``ALLOC_MEMORY_FUNCS[device]``,
whose default pins the memory with ``cudaHostRegister``; on a CPU engine (device "cpu") there is no CUDA
to register with and the scheduler dies at start-up ("Torch not compiled with CUDA enabled", SGLang
0.5.23 ``state_capturer/base.py``). Pinning buys nothing there (no device copy reads from it), so the
"cpu" device gets a plain host allocation. GPU engines (device "cuda") are untouched.
"""

from __future__ import annotations

from typing import Any

__all__ = ["register"]


def _host_buffer(dims: tuple, dtype: Any, device: str, pin_memory: bool, allocator: Any, **_: Any) -> Any:
    """SGLang's host-buffer allocation without the pinning (the CPU engine's buffers are host memory already)."""
    return allocator.allocate(dims, dtype=dtype, device=device)


def register() -> None:
    """Called by SGLang's ``load_plugins()``; a missing table (another SGLang) leaves SGLang as it is."""
    try:
        from sglang.srt.mem_cache.pool_host import common
    except ImportError:
        return
    table = getattr(common, "ALLOC_MEMORY_FUNCS", None)
    if table is not None and "cpu" not in table:
        table["cpu"] = _host_buffer
