"""fp32 linear layers on the CPU through oneDNN: one of the CPU kernels (``rlfoundry/cpu``).

Why: torch sends an fp32 ``nn.Linear`` on the CPU to MKL's sgemm, which runs its fast kernels on
Intel CPUs only. On AMD CPUs oneDNN (built into torch's x86 wheels) runs the same fp32 products
faster; on Intel CPUs MKL is the faster of the two (``python -m benchmarks.cpu_linear``; figures in
benchmarks/README.md, "CPU kernels"). So the swap is made where ``onednn_preferred()`` says so: on AMD CPUs.
The layers here compute the forward and both backward products with
``torch.ops.mkldnn._linear_pointwise``; results equal torch's to float rounding.

oneDNN builds and caches a kernel for every matrix shape it meets, and training shapes change with
every micro-batch's token count, so products are cut into row blocks of fixed sizes (a handful of
kernels per model, built once). Small products (decode steps, short prompts, narrow layers), other
dtypes, autocast, non-CPU tensors and DTensors keep torch's default path, where the extra Python
and copies would cost more than oneDNN saves: the swap never changes what a layer computes, only
which library multiplies.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from rlfoundry.cpu.tuning import (
    LINEAR_BIG_BLOCK as _BIG,
    LINEAR_LEFTOVER_ROWS as _LEFTOVER,
    LINEAR_MIN_MACS as _MIN_MACS,
    LINEAR_MIN_ROWS as _MIN_ROWS,
    LINEAR_SMALL_BLOCK as _SMALL,
)

__all__ = ["OneDNNLinear", "linear", "onednn_available", "onednn_preferred", "prefers_onednn", "use_onednn_linear"]

# Rows per oneDNN call (cpu/tuning.py): whole big blocks, then small blocks for the rest, the last
# one zero-padded; a leftover under _LEFTOVER rows goes to torch's default path. Products under
# _MIN_ROWS rows or _MIN_MACS multiply-adds stay there too: the blocks' Python, padding and copies
# would cost more than oneDNN saves.


@functools.cache  # a property of the torch build, asked on every linear call
def onednn_available() -> bool:
    """True when this torch build has oneDNN and its fp32 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def prefers_onednn(cpu_vendor: str) -> bool:
    """Whether oneDNN beats torch's default (MKL) for fp32 products on a CPU of this vendor
    (``/proc/cpuinfo``'s ``vendor_id``): measured yes on AMD EPYC, no on Intel Xeon; elsewhere
    (ARM, unknown) torch's default is kept."""
    return cpu_vendor == "AuthenticAMD"


@functools.cache
def onednn_preferred() -> str | None:
    """Why this machine's fp32 linear layers go to oneDNN, or None when they stay on torch's path."""
    if not onednn_available():
        return None
    vendor = _cpu_vendor()
    return f"{vendor} CPU: oneDNN multiplies fp32 faster than MKL here" if prefers_onednn(vendor) else None


def _cpu_vendor() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; strided (transposed) operands are accepted as they are."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _plan(total: int) -> list[tuple[int, int, int]]:
    """Cover ``total`` rows with (start, rows, block) pieces: block = the oneDNN call's row count
    (rows < block: zero-padded), or 0 for a leftover under ``_LEFTOVER`` rows on torch's path."""
    pieces, start = [], 0
    while total - start >= _BIG or total - start > _BIG - _SMALL:
        pieces.append((start, min(_BIG, total - start), _BIG))
        start += _BIG
    while total - start >= _LEFTOVER:
        pieces.append((start, min(_SMALL, total - start), _SMALL))
        start += _SMALL
    if start < total:
        pieces.append((start, total - start, 0))
    return pieces


def _block(rows: torch.Tensor, block: int) -> torch.Tensor:
    """(r, c) -> (block, c): ``rows`` then zeros (``rows`` itself when it fills the block)."""
    if rows.shape[0] == block:
        return rows
    out = rows.new_zeros(block, rows.shape[1])
    out[: rows.shape[0]] = rows
    return out


def _matmul_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
    """out (M, N) = x (M, K) Wᵀ + bias, block by block; returns ``out``."""
    for start, rows, block in _plan(x.shape[0]):
        part = x[start: start + rows]
        if block:
            out[start: start + rows] = _onednn(_block(part, block), weight, bias)[:rows]
        else:
            out[start: start + rows] = F.linear(part, weight, bias)
    return out


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """gradᵀ x (N, K), summed over the rows block by block (the (N, K) sums are small: adding them
    costs less than the extra kernels oneDNN would keep for accumulating in place)."""
    total = None
    for start, rows, block in _plan(x.shape[0]):
        g, xs = grad[start: start + rows], x[start: start + rows]
        part = _onednn(_block(g, block).t(), _block(xs, block).t(), None) if block else g.t() @ xs
        total = part if total is None else total.add_(part)
    return total


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1])


def _plain_fp32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(
        t is None or (type(t) in (torch.Tensor, nn.Parameter) and t.dtype == torch.float32 and t.device.type == "cpu")
        for t in tensors
    )


class _OneDNNLinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b, forward and backward on oneDNN: dx = dy W, dW = dyᵀ x, db = Σ dy."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = x.new_empty(*x.shape[:-1], weight.shape[0])  # filled in place: the output is no view
        _matmul_rows(_rows(x), weight, bias, out.view(-1, weight.shape[0]))
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad2 = _rows(grad)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = x.new_empty(x.shape)
            _matmul_rows(grad2, weight.t(), None, grad_x.view(-1, x.shape[-1]))
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad2, _rows(x))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b


def _cpu_autocast_on() -> bool:
    try:
        return torch.is_autocast_enabled("cpu")
    except TypeError:  # torch < 2.4 has no device argument
        return torch.is_autocast_cpu_enabled()


def _worth_it(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    return rows >= _MIN_ROWS and rows * weight.shape[0] * weight.shape[1] >= _MIN_MACS


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on oneDNN for plain fp32 CPU tensors when the product is large enough to gain."""
    if (_worth_it(x, weight) and _plain_fp32_cpu(x, weight, bias)
            and not _cpu_autocast_on() and onednn_available()):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``linear`` above: same parameters, state-dict keys, hooks."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        return linear(input, self.weight, self.bias)


def use_onednn_linear(module: nn.Module, device: torch.device | str) -> int:
    """Make ``module``'s plain ``nn.Linear`` layers ``OneDNNLinear`` in place (their class changes,
    nothing else) when it runs on the CPU of a torch build with oneDNN; returns how many."""
    if torch.device(device).type != "cpu" or not onednn_available():
        return 0
    swapped = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = OneDNNLinear
            swapped += 1
    return swapped
