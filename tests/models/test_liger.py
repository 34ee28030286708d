"""verl's ``actor_rollout_ref.model.use_liger`` (models/liger.py): where Liger's Triton kernels cannot run,
building the engine is an error naming the key, never a silent run without them. The numbers with Liger
on CUDA are checked in the GPU tier (tests/gpu/test_compile_liger.py)."""

from __future__ import annotations

import pytest

from rlfoundry.config.schema import FSDPConfig
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models import liger
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture


def test_liger_on_the_cpu_is_an_error_naming_the_key_and_what_to_do(process_group, tiny_model_dir):
    config = FSDPEngineConfig(path=str(tiny_model_dir), fsdp=FSDPConfig(), optim=None, grad_clip=None,
                              cpu_kernels="off", use_liger=True)
    with pytest.raises(ValueError, match=r"actor_rollout_ref.model.use_liger=true: Liger's kernels are Triton GPU "
                                         r"kernels and the training device is cpu; set .*use_liger=false"):
        FSDPEngine.build(config, "cpu", role="ref")


def test_liger_missing_on_cuda_names_the_install_command(monkeypatch):
    monkeypatch.setattr(liger.importlib.util, "find_spec", lambda name: None)
    (problem,) = liger.liger_problems("cuda")
    assert "actor_rollout_ref.model.use_liger=true needs liger-kernel" in problem and "pip install liger-kernel" in problem
