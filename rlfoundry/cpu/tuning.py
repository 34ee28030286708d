"""The CPU kernels' tuning constants, in one place.

Each was measured on a CPU (the figures, with their dates and machines, are in benchmarks/README.md,
"CPU kernels"); re-measure there before changing one.
"""

from __future__ import annotations

__all__ = [
    "CALL_COST_PARAM_TOKENS", "CALL_COST_MIN_TOKENS", "LINEAR_BIG_BLOCK", "LINEAR_SMALL_BLOCK",
    "LINEAR_LEFTOVER_ROWS", "LINEAR_MIN_ROWS", "LINEAR_MIN_MACS", "DECODE_PACK_MIN",
    "MALLOC_MMAP_THRESHOLD", "MALLOC_TRIM_THRESHOLD", "call_cost_tokens",
]

# linear.py: oneDNN builds a kernel per shape, so products go in row blocks of two fixed sizes
# (512 keeps scratchpads small; a 128-row block still beats MKL); leftovers under 64 rows stay on MKL.
LINEAR_BIG_BLOCK, LINEAR_SMALL_BLOCK, LINEAR_LEFTOVER_ROWS = 512, 128, 64
# linear.py: below this size a oneDNN call's Python, padding and copies cost more than it saves.
LINEAR_MIN_ROWS, LINEAR_MIN_MACS = 256, 1 << 23
# fused_decode.py: packing a weight into oneDNN's layout pays only from about this many weights.
DECODE_PACK_MIN = 1 << 18
# malloc.py: blocks under this come from the heap (glibc's largest allowed value on 64-bit).
MALLOC_MMAP_THRESHOLD = 32 << 20
# malloc.py: at most this much freed memory is kept per process (the memory the setting costs).
MALLOC_TRIM_THRESHOLD = 128 << 20
# engines/fsdp/forward.py: one more forward + backward call's fixed work (~20 ms at ~300 GFLOP/s on
# the CPU, 6 FLOPs per parameter and token) in parameter x tokens; GPUs use it until measured.
CALL_COST_PARAM_TOKENS = 10**9
# ... and its floor: smaller products run further below peak (what ~120 M parameters get).
CALL_COST_MIN_TOKENS = 64


def call_cost_tokens(params: int) -> int:
    """What one more forward + backward call costs beyond its tokens, in tokens of a model with
    ``params`` parameters (the micro-batch planner weighs calls against padding with it)."""
    return max(CALL_COST_MIN_TOKENS, int(CALL_COST_PARAM_TOKENS / max(params, 1)))
