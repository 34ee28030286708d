"""oneDNN fp32 linear layers: same numbers as nn.Linear, oneDNN only where it was asked for and pays."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import profile

from rlfoundry.cpu.linear import OneDNNLinear, linear, onednn_available, use_onednn_linear

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this torch build has no oneDNN")
ONEDNN_OP = "mkldnn::_linear_pointwise"


def _onednn_shapes(fn) -> list[tuple]:
    """The operand shapes of every oneDNN linear call ``fn`` makes."""
    with profile(record_shapes=True) as prof:
        fn()
    return [tuple(tuple(s) for s in e.input_shapes[:3]) for e in prof.events() if e.name == ONEDNN_OP]


def _onednn_calls(fn) -> int:
    return len(_onednn_shapes(fn))


def _grads(layer: nn.Module, x: torch.Tensor, weights: torch.Tensor):
    """Output and gradients of sum(weights * layer(x)): a non-uniform upstream gradient."""
    x = x.clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    out = layer(x)
    (out * weights).sum().backward()
    return out.detach(), x.grad, layer.weight.grad, None if layer.bias is None else layer.bias.grad


@needs_onednn
@pytest.mark.parametrize("bias", [True, False])
# 1200 rows: 2 x 512 + 128 + 48 (torch's path); 1400: 2 x 512 + 2 x 128 + 120 padded to 128
@pytest.mark.parametrize("rows", [1200, 1400])
@pytest.mark.numerics
def test_forward_and_backward_match_float64_and_run_on_onednn(bias, rows):
    torch.manual_seed(0)
    ref = nn.Linear(128, 256, bias=bias)
    layer = nn.Linear(128, 256, bias=bias)
    layer.load_state_dict(ref.state_dict())
    assert use_onednn_linear(layer, "cpu") == 1 and type(layer) is OneDNNLinear
    x, w = torch.randn(4, rows // 4, 128), torch.randn(4, rows // 4, 256)
    shapes = _onednn_shapes(lambda: _grads(layer, x, w))
    blocks = {1200: 3, 1400: 5}[rows]
    assert len(shapes) == 3 * blocks  # forward, dx and dW, block by block (db is a plain sum)
    assert all(512 in call[0] or 128 in call[0] for call in shapes), shapes  # a block of 512 or 128 rows
    got = _grads(layer, x, w)
    exact = _grads(ref.double(), x.double(), w.double())
    for name, a, b in zip(("out", "dx", "dW", "db"), got, exact):
        if b is not None:
            assert a.dtype == torch.float32
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-4, msg=name)


@needs_onednn
def test_changing_row_counts_reuse_the_same_few_kernel_shapes():
    """oneDNN builds and keeps a kernel (~0.6-3 MB) per shape: token counts change every micro-batch,
    the shapes it sees must not."""
    layer = nn.Linear(64, 96)
    use_onednn_linear(layer, "cpu")
    seen = set()
    for rows in range(128, 3000, 37):
        x = torch.randn(rows, 64, requires_grad=True)
        seen.update(_onednn_shapes(lambda: layer(x).square().sum().backward()))
    # forward (x, W, b), dx (dy, Wᵀ) and dW (dyᵀ, xᵀ), each at 512 and 128 rows
    assert len({call[:2] for call in seen}) <= 6, sorted(seen)


@needs_onednn
@pytest.mark.numerics
def test_strided_and_broadcast_upstream_gradients():
    """Autograd hands backward expanded (stride-0) and sliced gradients; oneDNN must read them right."""
    torch.manual_seed(1)
    ref, layer = nn.Linear(64, 512), nn.Linear(64, 512)
    layer.load_state_dict(ref.state_dict())
    use_onednn_linear(layer, "cpu")
    ref.double()
    x = torch.randn(1300, 64)
    for loss in (lambda y: y.sum(), lambda y: y[::3, :7].square().sum(), lambda y: (y.t() * torch.arange(1300.0)).sum()):
        grads = []
        for m, xi in ((ref, x.double()), (layer, x)):
            xi = xi.clone().requires_grad_(True)
            m.zero_grad()
            loss(m(xi)).backward()
            grads.append((xi.grad, m.weight.grad, m.bias.grad))
        for exact, got in zip(*grads):
            assert (got.double() - exact).abs().max() <= 2e-6 * exact.abs().max()


@pytest.mark.numerics
def test_small_products_other_dtypes_and_aten_keep_torchs_path_bit_for_bit():
    torch.manual_seed(2)
    layer = nn.Linear(64, 64)
    use_onednn_linear(layer, "cpu")
    small = torch.randn(255, 64)  # under 256 rows: oneDNN's fixed costs would exceed its gain
    assert _onednn_calls(lambda: layer(small)) == 0
    assert torch.equal(layer(small), F.linear(small, layer.weight, layer.bias))
    big64 = torch.randn(2048, 64, dtype=torch.float64)  # fp32 only
    w64 = layer.weight.double()
    assert _onednn_calls(lambda: linear(big64, w64)) == 0
    assert torch.equal(linear(big64, w64), F.linear(big64, w64))
    big = torch.randn(2048, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast decides the dtype: torch's path
        assert _onednn_calls(lambda: layer(big)) == 0
        assert layer(big).dtype == torch.bfloat16
    assert _onednn_calls(lambda: layer(big)) == 4  # outside autocast: oneDNN, four 512-row blocks
    untouched = nn.Linear(64, 64)
    assert use_onednn_linear(untouched, "cuda") == 0 and type(untouched) is nn.Linear  # GPUs: cuBLAS


@needs_onednn
@pytest.mark.numerics
def test_hf_model_keeps_its_parameters_and_outputs(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    swapped = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    before = dict(swapped.named_parameters())
    n_linear = sum(type(m) is nn.Linear for m in plain.modules())
    assert use_onednn_linear(swapped, "cpu") == n_linear > 0
    assert dict(swapped.named_parameters()) == before  # the same tensors under the same names
    assert list(swapped.state_dict()) == list(plain.state_dict())
    ids = torch.randint(3, 250, (16, 64))  # 1024 rows: two blocks
    calls = _onednn_calls(lambda: swapped(input_ids=ids))
    assert calls > 0
    # oneDNN and MKL block the hidden-size sums differently: fp32 rounding of O(10) logits
    torch.testing.assert_close(swapped(input_ids=ids).logits, plain(input_ids=ids).logits, rtol=1e-5, atol=1e-5)



@needs_onednn
@pytest.mark.parametrize("vendor, swapped", [("AuthenticAMD", True), ("GenuineIntel", False), ("", False)])
def test_the_cpu_kernels_swap_layers_only_where_onednn_beats_mkl(monkeypatch, vendor, swapped):
    """MKL runs its fast fp32 kernels on Intel CPUs only: oneDNN replaces it on AMD, nowhere else."""
    from rlfoundry import cpu as cpu_kernels
    from rlfoundry.cpu import linear as cpu_linear

    monkeypatch.setattr(cpu_linear, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(cpu_linear, "onednn_preferred", functools.cache(cpu_linear.onednn_preferred.__wrapped__))
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    said = cpu_kernels.apply_cpu_kernels(model, "cpu")
    assert all((type(m) is OneDNNLinear) == swapped for m in model)
    assert ("oneDNN (" in said) == swapped and (vendor in said if swapped else "default path" in said)
