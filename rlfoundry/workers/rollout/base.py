"""The rollout engine interface: what the hybrid worker needs from any generation back end.

An engine turns one row per prompt into ``n`` sampled responses per prompt (contract in
``hf_rollout.HFRollout.generate_sequences``) and learns about new actor weights through
``sync_weights``/``on_actor_update``. The HF engine shares the actor's module, so syncing is free;
an engine that keeps its own copy of the weights (vLLM, SGLang) overrides ``sync_weights`` to load
the actor's state dict after every update, and the trainer never knows the difference.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from rlfoundry.config import to_typed
from rlfoundry.config.schema import RolloutConfig
from rlfoundry.protocol import DataProto

__all__ = ["ENGINE_ONLY", "BaseRollout", "SamplingParams", "resolve_sampling_params", "rollout_config"]

ROLLOUT_KEY = "actor_rollout_ref.rollout"  # where RolloutConfig sits in the trainer config (for messages)
# FIRE sampling (rollout.use_fire_sampling; verl's fire_vllm_rollout.py): the first response token's
# temperature, and its top-k where the user's is off
# meta_info key: the rows are an agent loop's turn requests (partial rollout's multi-turn runs the loops in
# the driver, trainer/ppo/partial_rollout.py): a rollout worker answers them with its plain engine
ENGINE_ONLY = "engine_only"
FIRE_TEMPERATURE = 30.0
FIRE_TOP_K = 16


def rollout_config(config: Any) -> RolloutConfig:
    """The typed ``actor_rollout_ref.rollout`` subtree: ``config`` as is when it already is one, else
    ``to_typed`` (a DictConfig, a dict with some keys, None; missing keys get the schema's defaults)."""
    return config if isinstance(config, RolloutConfig) else to_typed(RolloutConfig, config, name=ROLLOUT_KEY)


@dataclass(frozen=True)
class SamplingParams:
    """One generation call's settings after config, ``val_kwargs`` and ``meta_info`` are merged."""

    n: int = 1  # these defaults serve tests that build one by hand; config values come from RolloutConfig
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # <= 0 disables (verl/vLLM write -1, HF writes 0)
    response_length: int = 512
    fire: bool = False  # rollout.use_fire_sampling, in a sampled training call: see ``for_token``

    @property
    def greedy(self) -> bool:
        return (not self.do_sample) or self.temperature <= 0

    @property
    def logprob_temperature(self) -> float:
        """Temperature the reported log-probs use: the sampling one, or 1 when it is 0 (greedy)."""
        return self.temperature if self.temperature > 0 else 1.0

    def for_token(self, t: int) -> SamplingParams:
        """The settings response token ``t`` is drawn with (every decode loop asks per step, so all agree).

        FIRE (Flaming-hot Initiation with Regular Execution, arXiv 2410.21236): the first token at
        temperature 30 among the top 16 (a positive user top_k is kept, top_p too), every later one with
        these settings; a hot first token diversifies the n samples of a prompt. Greedy stays greedy:
        verl's greedy call sets temperature 0 on its first-token parameters too.
        """
        if t > 0 or not self.fire or self.greedy:
            return self
        return replace(self, temperature=FIRE_TEMPERATURE, top_k=self.top_k if self.top_k > 0 else FIRE_TOP_K,
                       fire=False)


_SAMPLING_KEYS = ("n", "do_sample", "temperature", "top_p", "top_k")


def resolve_sampling_params(config: Any, meta_info: Mapping[str, Any] | None) -> SamplingParams:
    """Merge rollout config < ``val_kwargs`` (when ``meta_info["validate"]``) < explicit meta_info keys.

    ``config``: a ``RolloutConfig`` (or anything ``rollout_config`` takes).
    """
    config, meta = rollout_config(config), dict(meta_info or {})
    validate = bool(meta.get("validate", False))
    source = config.val_kwargs if validate else config
    values = {k: getattr(source, k) for k in _SAMPLING_KEYS}
    values["response_length"] = config.response_length
    values.update({k: meta[k] for k in (*_SAMPLING_KEYS, "response_length") if meta.get(k) is not None})
    params = SamplingParams(
        n=int(values["n"]), do_sample=bool(values["do_sample"]), temperature=float(values["temperature"]),
        top_p=float(values["top_p"]), top_k=int(values["top_k"]), response_length=int(values["response_length"]),
        # validation scores the policy as val_kwargs set it (verl's validation never draws a FIRE token)
        fire=bool(config.use_fire_sampling) and not validate,
    )
    if params.n < 1 or params.response_length < 1:
        raise ValueError(f"rollout n and response_length must be >= 1, got n={params.n}, "
                         f"response_length={params.response_length}")
    return params


KEYED_CALL = 1 << 40  # in the call-number slot of a keyed request's seed: never a real call number


def mixed_seed(*values: int) -> int:
    """A well-mixed 63-bit seed from non-negative ints (config seed, rank, call number, request key ...)."""
    return int(np.random.SeedSequence(list(values)).generate_state(1, dtype=np.uint64)[0] >> 1)


class BaseRollout(ABC):
    """A generation engine. Subclasses implement ``generate_sequences``."""

    # engines that sample each request from a stream keyed by ``meta_info["sample_keys"]`` (HF, vLLM) and
    # count their calls in ``calls``; an agent loop's server then keys its requests (``reserve_draws``)
    keyed_draws: bool = False

    def reserve_draws(self) -> int | None:
        """One call number for a batch of calls whose requests carry their own keys (``sample_keys``; an
        agent loop's server mixes it into each request's key): however many calls the batch then makes,
        the counter moves by one, so the next draws do not depend on how its requests were batched. None:
        this engine draws per call."""
        if not self.keyed_draws:
            return None
        self.calls += 1
        return self.calls - 1

    @abstractmethod
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """One row per prompt in, ``n`` interleaved rows per prompt out (see HFRollout)."""

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load new actor weights. Engines that share the actor's module have nothing to do."""

    def _weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None) -> Iterable[tuple[str, torch.Tensor]]:
        """What ``sync_weights`` loads: ``named_tensors``, else the engine's ``weight_source()``, else its
        actor ``module``'s parameters gathered one at a time (collective under FSDP2)."""
        from rlfoundry.workers.weight_sync import checkpoint_named

        if named_tensors is not None:
            return checkpoint_named(self._conversion_model, named_tensors)
        if getattr(self, "weight_source", None) is not None:
            pulled = self.weight_source()
        elif getattr(self, "module", None) is None:
            raise RuntimeError("sync_weights(None) needs the actor module; pass (name, tensor) pairs instead")
        else:
            from rlfoundry.engines.fsdp.utils import iter_full_parameters

            pulled = iter_full_parameters(self.module)
        # verify mode records what the engine loads: the checkpoint's names
        pulled = checkpoint_named(self._conversion_model, pulled)
        return pulled if self.weight_tap is None else self.weight_tap(pulled)

    def _conversion_model(self) -> torch.nn.Module:
        """The HF model whose load-time conversion ``weight_sync.checkpoint_named`` reverses: the actor's module,
        else one on the meta device (no memory) from the engine's model directory, built once."""
        module = getattr(self, "module", None)
        if isinstance(module, torch.nn.Module):
            return module
        if getattr(self, "_meta_model", None) is None:
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(self.model_path, trust_remote_code=self.trust_remote_code)
            with torch.device("meta"):
                self._meta_model = AutoModelForCausalLM.from_config(config, trust_remote_code=self.trust_remote_code)
        return self._meta_model

    # set by the worker around a verified pull (``rollout.checkpoint_engine.verify``): wraps the stream a
    # pull loads (``DigestRecorder.wrap``), so what the engine took is recorded on its way in
    weight_tap: Callable[[Iterable[tuple[str, torch.Tensor]]], Iterable[tuple[str, torch.Tensor]]] | None = None

    def pulls_weights(self) -> bool:
        """Whether ``on_actor_update`` loads a weight stream through ``_weights(None)`` (vLLM, SGLang), which
        verify mode records through ``weight_tap``; False: the engine samples with the actor's own module
        (HF) or syncs some other way (a LoRA adapter request)."""
        return False

    # set by the worker around a verified adapter sync: called with the (peft config, peft-named tensors)
    # the sync loads, so what the engine was sent is recorded
    adapter_tap: Callable[[dict[str, Any], dict[str, torch.Tensor]], None] | None = None

    def pulls_adapter(self) -> bool:
        """Whether ``on_actor_update`` loads the actor's LoRA adapter alone (vLLM, ``lora_sync=adapter``),
        passing what it loads to ``adapter_tap``; verify mode then compares ``adapter_digests``."""
        return False

    def adapter_digests(self, config: dict[str, Any], tensors: Mapping[str, torch.Tensor]
                        ) -> tuple[dict[str, int], dict[str, int]] | None:
        """For an engine that ``pulls_adapter``: ({peft name: the digest ``tensors[name]`` has as the engine
        would hold it}, {peft name: the digest of what the engine holds there}); None: not verifiable."""
        return None

    def weight_dtypes(self) -> dict[str, torch.dtype] | None:
        """{HF name: the dtype the engine stores it in}, for ``rollout.checkpoint_engine.verify``; None:
        this engine cannot report its weights, and its syncs go unverified."""
        return None

    def storage_dtypes(self) -> dict[str, torch.dtype] | None:
        """{HF name: the dtype the engine's loader casts it to}, whatever ``verify`` says: a weight bridge
        sends a tensor the trainer holds wider in it (``checkpoint_engine.wire_dtype``); None: unknown (the
        trainer's dtypes travel). Default: ``weight_dtypes``."""
        return self.weight_dtypes()

    def weight_digests(self) -> dict[str, int] | None:
        """{name: ``weight_sync.tensor_digest``} of the weights the engine samples with (None: as above), by
        the engine's names (``engine_weight_name``)."""
        return None

    def engine_weight_name(self, name: str) -> str | None:
        """The engine's name for the tensor that holds HF ``name`` (several HF tensors fused into one engine
        tensor share it: its digest is the sum of theirs); None: the engine keeps no copy of its own (a
        tied ``lm_head``). Default: the HF name."""
        return name

    def on_actor_update(self) -> None:
        """Called by the worker after every optimiser step of the actor."""
        self.sync_weights(None)

    def state_dict(self) -> dict[str, Any]:
        """Engine state a checkpoint must keep (e.g. the sampling RNG position)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned."""
