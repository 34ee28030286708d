"""verl's training ``use_torch_compile`` and ``model.use_liger`` on CUDA (the GPU tier; each test marked
``gpu`` skips without CUDA). On one GPU the FSDP engine computes in bf16 under autocast over fp32
weights, so compiled and Liger log-probs are compared with eager ones within bf16 rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from rlfoundry.engines.base import LogProbs, MicroBatching
from tests.engines.test_fsdp_engine import _batch
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture

pytestmark = pytest.mark.gpu

BF16_ATOL = 5e-2  # bf16 keeps 8 bits of mantissa: log-probs of the tiny model move by ~1e-2 under reordering


def _cuda_engine(model_dir, **fields):
    from rlfoundry.config.schema import FSDPConfig, OptimConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig

    config = FSDPEngineConfig(path=str(model_dir), fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                              optim=OptimConfig(lr=1e-2, weight_decay=0.0), **fields)
    return FSDPEngine.build(config, "cuda", role="actor")


@pytest.mark.numerics
def test_compiled_training_forward_equals_eager_on_cuda(process_group, tiny_model_dir):
    before = counters["stats"]["unique_graphs"]  # other tier tests in this process compile their own decode
    data = _batch().to("cuda")
    eager = _cuda_engine(tiny_model_dir).infer_batch(data, LogProbs(entropy=True), MicroBatching(size=2))
    compiled_engine = _cuda_engine(tiny_model_dir, use_torch_compile=True)
    compiled = compiled_engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=2))
    graphs = counters["stats"]["unique_graphs"] - before
    assert graphs >= 1  # the layers ran through dynamo
    for key in ("log_probs", "entropy"):
        torch.testing.assert_close(compiled[key], eager[key], atol=BF16_ATOL, rtol=0)
    compiled_engine.infer_batch(_batch(tr=9).to("cuda"), LogProbs(), MicroBatching(size=2))  # another length
    assert counters["stats"]["unique_graphs"] - before == graphs, dict(counters["stats"])  # no recompile


# Liger patches transformers' Qwen2 module (RMSNorm, MLP, rotary) for the whole process: the comparison
# runs in a process of its own, the unpatched model first.
_LIGER = textwrap.dedent("""
    import json, sys
    import torch
    from rlfoundry.engines.base import LogProbs, MicroBatching
    from tests.engines.test_fsdp_engine import _batch
    from tests.engines.test_fsdp_utils import world_of_one
    from tests.gpu.test_compile_liger import _cuda_engine
    world_of_one("cpu:gloo,cuda:nccl")
    data = _batch().to("cuda")
    plain = _cuda_engine(sys.argv[1]).infer_batch(data, LogProbs(), MicroBatching(size=2))["log_probs"]
    engine = _cuda_engine(sys.argv[1], use_liger=True)
    patched = engine.module.model.norm._get_name()  # Liger rebinds a patched module's forward and name
    liger = engine.infer_batch(data, LogProbs(), MicroBatching(size=2))["log_probs"]
    print(json.dumps({"max_diff": (liger - plain).abs().max().item(), "norm": patched}))
""")


def test_liger_log_probs_equal_the_unpatched_model_on_cuda(tiny_model_dir):
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (pip install liger-kernel)")
    # the child makes its own world of one: a MASTER_PORT inherited from this process's store would be taken
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    out = subprocess.run([sys.executable, "-c", _LIGER, str(tiny_model_dir)], capture_output=True, text=True,
                         timeout=300, cwd=Path(__file__).resolve().parents[2], env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["norm"].startswith("Liger"), result  # the kernels really are in the model
    assert result["max_diff"] < BF16_ATOL, result
