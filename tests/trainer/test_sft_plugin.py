"""SFT builds and tears down its engine through the registered training-engine plug-in (engines/base.py), as the
RL roles do: a third-party engine registered under a strategy name of its own trains SFT, and one that lacks what
SFT needs is refused at start-up with a message naming the strategy and what is missing."""

from __future__ import annotations

import math

import pytest
import torch

from rlfoundry.config.training_engines import TRAINING_ENGINES
from rlfoundry.engines.base import EnginePlugin
from rlfoundry.engines.fsdp.plugin import PLUGIN as FSDP
from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.sft_trainer import SFTTrainer, load_sft_config
from tests.trainer.test_sft import _fixed_batch, _full, _overrides


class _Wrapped(EnginePlugin):
    """A third-party engine: the FSDP2 engine's plug-in behind a name of its own, each call recorded. It says
    nothing of LoRA or MTP (the base class's defaults: it has neither)."""

    name = "wrapped"
    supports_vision_language = True

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def build(self, request, device, role):
        self.calls.append(("build", role, request.optim is not None, request.model.path))
        return FSDP.build(request, device, role)

    def data_parallel_rank(self, role, rank, world_size):
        self.calls.append(("data_parallel_rank", rank, world_size))
        return FSDP.data_parallel_rank(role, rank, world_size)

    def teardown(self) -> None:
        self.calls.append(("teardown",))


class _OwnLayout(EnginePlugin):
    """An engine laid out by a subtree that no SFT config carries."""

    name = "own_layout"
    layout_key = "own"

    def build(self, request, device, role):
        raise AssertionError("a refused engine is never built")


WRAPPED, OWN_LAYOUT = _Wrapped(), _OwnLayout()


@pytest.fixture
def registered(monkeypatch):
    """The two engines registered as a third party registers one: a line in the strategy table."""
    monkeypatch.setitem(TRAINING_ENGINES, "wrapped", f"{__name__}:WRAPPED")
    monkeypatch.setitem(TRAINING_ENGINES, "own_layout", f"{__name__}:OWN_LAYOUT")
    WRAPPED.calls.clear()


def _one_step(model_dir, run_dir, *keys: str) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """One step on the first batch: its metrics and the weights after it."""
    trainer = SFTTrainer(load_sft_config([*_overrides(model_dir, run_dir), *keys]))
    try:
        metrics = trainer.train_step(_fixed_batch(trainer))
        weights = {n: _full(p) for n, p in trainer.engine.module.named_parameters()}
    finally:
        trainer._finish(0.0)
    return metrics, weights


def test_sft_trains_through_a_plugin_registered_under_its_own_name(registered, tiny_model_dir, tmp_path):
    """The wrapped engine's step is the FSDP2 engine's bit for bit (the same engine behind a new name), and SFT
    asked its plug-in for the rows, the engine (the SFT role, trainable, the model's directory) and the teardown."""
    fsdp, fsdp_weights = _one_step(tiny_model_dir, tmp_path / "f", "model.strategy=fsdp2")
    assert WRAPPED.calls == []
    wrapped, wrapped_weights = _one_step(tiny_model_dir, tmp_path / "w", "model.strategy=wrapped")
    assert WRAPPED.calls == [("data_parallel_rank", 0, 1), ("build", "sft", True, str(tiny_model_dir)),
                             ("teardown",)]
    assert wrapped["train/loss"] > math.log(200), "an untrained model is near uniform over ~260 tokens"
    assert wrapped["train/loss"] == fsdp["train/loss"] and wrapped["train/grad_norm"] == fsdp["train/grad_norm"]
    assert wrapped_weights.keys() == fsdp_weights.keys()
    for name, weight in wrapped_weights.items():
        assert torch.equal(weight, fsdp_weights[name]), name
    with torch.no_grad():  # the step changed the model (so equal weights are equal updates, not none)
        from transformers import AutoModelForCausalLM

        start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32).state_dict()
        moved = sum(not torch.equal(w, start[n]) for n, w in wrapped_weights.items() if n in start)
    assert moved > 0


@pytest.mark.parametrize(("keys", "named"), [
    (("model.strategy=own_layout",), "model.strategy=own_layout: its engine is laid out by a 'own' subtree"),
    (("model.strategy=wrapped", "model.lora_rank=8"), "model.lora_rank=8 with model.strategy=wrapped: its engine "
                                                      "builds no LoRA adapters"),
    (("model.strategy=wrapped", "model.mtp.enable=true"), "not built on the wrapped engine (model.strategy=wrapped"),
    (("model.strategy=unregistered",), "model.strategy='unregistered' must be one of"),
])
def test_an_engine_without_what_sft_needs_is_refused_naming_it(registered, keys, named):
    with pytest.raises(ConfigError, match=named.replace("(", r"\(")):
        load_sft_config(["model.path=/m", *keys])
    assert WRAPPED.calls == []  # refused at start-up: nothing built
