"""fp32 linear layers on the CPU through oneDNN (``model.cpu_linear=onednn``, the default).

Why: torch sends an fp32 ``nn.Linear`` on the CPU to MKL's sgemm. On AMD EPYC (Zen) cores MKL does
not take its AVX-512 code path and runs at ~100 GFLOP/s per core on the training shapes of the
benchmark model, where oneDNN (also in every x86 torch wheel, the library behind torch's CPU
convolutions) reaches ~240 GFLOP/s with the same fp32 arithmetic: no down-conversion, results equal
to float rounding (``benchmarks/README.md`` has the measurement). The layers here compute the
forward and both backward products with ``torch.ops.mkldnn._linear_pointwise``, the oneDNN linear
that Inductor's CPU back end calls.

oneDNN costs ~10 µs more per call, so products under ``_MIN_MACS`` multiply-adds (one-token decode
steps, short prompts) keep torch's default path, as do other dtypes, autocast, non-CPU tensors and
DTensors: the swap never changes what a layer computes, only which library multiplies.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["BACKENDS", "OneDNNLinear", "linear", "onednn_available", "use_cpu_linear"]

BACKENDS = ("onednn", "aten")
# Below ~2M multiply-adds oneDNN's fixed call cost outweighs its faster kernel (measured: 64x128x256
# is 29 µs vs 42 µs on MKL, 32x128x64 is 14 µs vs 7 µs).
_MIN_MACS = 1 << 21


def onednn_available() -> bool:
    """True when this torch build has oneDNN and its fp32 linear op."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def _onednn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T + bias; strided (transposed) operands are accepted as they are."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _worth_it(x: torch.Tensor, weight: torch.Tensor) -> bool:
    rows = x.numel() // max(1, x.shape[-1])
    return rows * weight.shape[0] * weight.shape[1] >= _MIN_MACS


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
        return _onednn(x, weight, bias)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = _onednn(grad, weight.t(), None)
        grad2 = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            x2 = x.reshape(-1, x.shape[-1])
            # the sum runs over the rows: worth oneDNN's call cost only when there are many of them
            grad_w = _onednn(grad2.t(), x2.t(), None) if _worth_it(x, weight) else grad2.t() @ x2
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad2.sum(0)
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``, on oneDNN for plain fp32 CPU tensors when the product is large enough."""
    if (_plain_fp32_cpu(x, weight, bias) and _worth_it(x, weight)
            and not torch.is_autocast_enabled("cpu") and onednn_available()):
        return _OneDNNLinearFunction.apply(x, weight, bias)
    return F.linear(x, weight, bias)


class OneDNNLinear(nn.Linear):
    """An ``nn.Linear`` whose forward is ``linear`` above: same parameters, state-dict keys, hooks."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - nn.Linear's argument name
        return linear(input, self.weight, self.bias)


def use_cpu_linear(module: nn.Module, backend: str, device: torch.device | str) -> int:
    """Route ``module``'s ``nn.Linear`` layers to ``backend`` when it runs on the CPU; returns how many.

    ``onednn``: every plain ``nn.Linear`` becomes a ``OneDNNLinear`` in place (its class changes,
    nothing else). ``aten``, a GPU device, or a torch build without oneDNN: the module is untouched.
    """
    if backend not in BACKENDS:
        raise ValueError(f"model.cpu_linear must be one of {list(BACKENDS)}, got {backend!r}")
    if backend != "onednn" or torch.device(device).type != "cpu" or not onednn_available():
        return 0
    swapped = 0
    for layer in module.modules():
        if type(layer) is nn.Linear:
            layer.__class__ = OneDNNLinear
            swapped += 1
    return swapped
