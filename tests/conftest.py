"""Shared fixtures: tiny models built locally (no hub), paths to the real shared data."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tiny models on a 2-core machine: one intra-op thread per process is faster than two threads
# fighting over the cores (and Ray workers / reward pools add processes of their own).
torch.set_num_threads(int(os.environ.get("RLFOUNDRY_TEST_THREADS", "1")))


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.gpu`` tests (the CUDA tier, DESIGN.md "one test tier per device") skip without CUDA.
    Under pytest-xdist (scripts/test.sh) the files with the most ``slow`` tests go first: each process takes
    whole files in collection order, and a long file left to the end would run while the other processes idle."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        slow: dict[str, int] = {}
        for item in items:
            slow[item.fspath.strpath] = slow.get(item.fspath.strpath, 0) + (item.get_closest_marker("slow") is not None)
        items.sort(key=lambda item: -slow[item.fspath.strpath])  # stable: a file's tests keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="gpu tier: needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO_ROOT.parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data not found at {SHARED_DATA} (CI places ../shared beside the repo)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen2 causal LM with the project's byte-level tokenizer, saved as an HF directory."""
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"))


@pytest.fixture(scope="session")
def tiny_critic_dir(tmp_path_factory) -> Path:
    """Same backbone shape with a one-label token-classification head (a value model)."""
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-critic"), head="token_classification", seed=1)


@pytest.fixture(scope="session")
def tiny_moe_dir(tmp_path_factory) -> Path:
    """A 2-layer Qwen3-MoE causal LM (8 experts, top-2, hidden 64), the project's tokenizer."""
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), arch="qwen3_moe")


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="session")
def tiny_vlm_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2-VL (one-block vision tower) with its processor, saved as one HF directory."""
    from rlfoundry.models.tiny_vlm import save_tiny_vlm

    return save_tiny_vlm(tmp_path_factory.mktemp("tiny-qwen2-vl"))
