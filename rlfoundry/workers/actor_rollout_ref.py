"""``ActorRolloutRefWorker``: the hybrid worker holding the policy, its rollout engine and the reference.

One class, several roles (verl's hybrid engine): ``actor``, ``rollout``, ``ref``, ``actor_ref``,
``actor_rollout`` and ``actor_rollout_ref``. The training engine is whichever the role's ``strategy``
names (``config/training_engines.py``); where it can share its module (FSDP2), the actor and the HF
rollout use that one module, so generation sees the latest weights without a copy, and elsewhere the
rollout keeps a copy the engine refreshes after every update; the reference is a separate frozen model
loaded from the same path, built only when the role includes ``ref`` (with LoRA, ``model.lora_rank > 0``,
the reference is the actor's own module with the adapter switched off: no second copy). A rollout pool of its own
(``rollout`` alone: the asynchronous pipelines) holds a whole replica per rank that the trainer's
``send_weights`` refreshes through the checkpoint engine.

Driver-facing methods (dispatch mode in brackets):

| method | in | out |
|---|---|---|
| ``init_model`` [ONE_TO_ALL] | — | — |
| ``generate_sequences`` [DP_COMPUTE_PROTO] | prompts, one row each | B·n rows (see ``HFRollout``) |
| ``compute_log_prob`` [DP_COMPUTE_PROTO] | sequences | ``old_log_probs``, ``entropys`` (B, Tr); ``sum_pi_squared`` (B, Tr) with ``actor.calculate_sum_pi_squared``; MoE routing replay: ``routed_experts`` (R2), ``routing_{changed,counted}_tokens`` (B,) (R3) |
| ``compute_prox_log_prob`` [DP_COMPUTE_PROTO] | sequences, ``meta_info["prox_version"]`` | what ``compute_log_prob`` gives, under the weights of that update count (the sync period's first; fully async) |
| ``compute_log_prob_fp32`` [DP_COMPUTE_PROTO] | a few sequences | ``fp32_log_probs`` (B, Tr): ``old_log_probs`` recomputed in fp32 (the mismatch audit's precision test) |
| ``compute_ref_log_prob`` [DP_COMPUTE_PROTO] | sequences | ``ref_log_prob`` (B, Tr) |
| ``update_actor`` [DP_COMPUTE_PROTO] | batch with advantages | ``meta_info["metrics"]`` |
| ``refresh_ref_from_actor`` [ONE_TO_ALL] | — | — (the reference takes the actor's weights: SPIN's ``trainer.ref_update_freq``) |
| ``save_checkpoint`` / ``load_checkpoint`` / ``save_hf_model`` [ONE_TO_ALL] | paths | — |
| ``save_ref_checkpoint`` / ``load_ref_checkpoint`` [ONE_TO_ALL] | a path | — (the reference's weights: SPIN's resume) |
| ``open_weight_bridge`` [RANK_ZERO], ``connect_weight_bridge`` [ONE_TO_ALL] | — / host, port, rollout ranks | (host, port) / — |
| ``send_weights`` (trainer) / ``receive_weights`` (rollout pool) [ONE_TO_ALL] | — | transfer sizes / param_version |
| ``rollout_sampling_state`` [RANK_ZERO] / ``load_rollout_sampling_state`` [ONE_TO_ALL] (rollout pool) | — / state | the engine's sampling position / — |

**Policy versions.** ``param_version`` counts the actor's updates (restored with a checkpoint); every
sync hands it to the rollout engine with the weights, and every generated sample carries the version
its engine held as the non-tensor column ``param_version``. ``update_actor`` reports
``actor/param_version`` and ``rollout/param_staleness_{mean,max}`` (its version minus the samples'),
and a hybrid worker whose rollout fell behind its actor refuses to generate (``StaleWeightsError``).
With ``rollout.checkpoint_engine.verify`` every sync into an engine that holds a copy of the weights
ends with a digest comparison (``weight_sync.py``), and so does a vLLM LoRA adapter sync, over the adapter.

``config`` is the ``actor_rollout_ref`` subtree with verl's keys (a DictConfig, a dict of the keys to
change, or an ``ActorRolloutRefConfig``); the worker keeps it typed, with the schema's defaults filled in.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlfoundry.config.batch import per_gpu, role_batch
from rlfoundry.config.schema import ActorRolloutRefConfig, DistillationLossConfig, starts_from_dist_checkpoint
from rlfoundry.config.training_engines import engine_plugin
from rlfoundry.config.typed import to_typed
from rlfoundry.models.batch_invariant import apply_exact
from rlfoundry.models.hf import check_model_dir, generation_eos_ids, resolve_model_path
from rlfoundry.models import routing_replay
from rlfoundry.models.lora import LoraSpec
from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base import Dispatch, Worker, register
from rlfoundry.single_controller.base.worker import WorkerRuntime
from rlfoundry.utils import faults
from rlfoundry.utils.errors import StaleWeightsError
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.engines.base import EngineRequest, TrainingEngine
from rlfoundry.engines.snapshot import WeightSnapshot
from rlfoundry.workers.actor import ROUTING_OUTPUTS, ActorBatchSizes, DataParallelPPOActor
from rlfoundry.workers.flowrl_head import add_log_z_head
from rlfoundry.workers.rollout import BaseRollout, get_rollout_class
from rlfoundry.workers.rollout.base import ENGINE_ONLY
from rlfoundry.workers.utils.device import on_device
from rlfoundry.engines import oom
from rlfoundry import cpu as cpu_kernels

__all__ = ["ActorRolloutRefWorker", "ROLES"]

logger = logging.getLogger(__name__)

ROLES = ("actor", "rollout", "ref", "actor_ref", "actor_rollout", "actor_rollout_ref")


class ActorRolloutRefWorker(Worker):
    """Policy (FSDP2 + AdamW), HF rollout on the same module, and a frozen reference, per role."""

    def __init__(self, config: Any, role: str, runtime: WorkerRuntime | None = None, distillation_loss: Any = None):
        super().__init__(runtime)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        self.config = to_typed(ActorRolloutRefConfig, config, name="actor_rollout_ref")
        # on-policy distillation: the actor's update adds the distillation term (docs/distillation.md)
        self.distillation_loss = None if distillation_loss is None else to_typed(
            DistillationLossConfig, distillation_loss, name="distillation.distillation_loss")
        self.role = role
        self._is_actor = role in ("actor", "actor_ref", "actor_rollout", "actor_rollout_ref")
        self._is_rollout = role in ("rollout", "actor_rollout", "actor_rollout_ref")
        self._is_ref = role in ("ref", "actor_ref", "actor_rollout_ref")
        self._rollout_cls = get_rollout_class(self.config.rollout.name) if self._is_rollout else None
        self.actor_sizes = self._actor_batch_sizes() if self._is_actor else None
        self.actor: DataParallelPPOActor | None = None
        self.rollout: BaseRollout | None = None
        self.ref_policy: DataParallelPPOActor | None = None
        self.engine: TrainingEngine | None = None
        self._moe_layer_count: int | None = None  # routers of the policy (_moe_layers), counted once
        self.agent_loop: Any = None  # rollout.multi_turn.enable: tool-calling trajectories over self.rollout
        self._bridge: Any = None  # a rollout pool of its own: the CheckpointEngine joining it to the trainer
        self._bridge_store: Any = None
        self.lora = LoraSpec.of(self.config.model)
        self._ref_in_actor = False  # LoRA: the reference is the actor's module with the adapter off
        self.param_version = 0  # the actor's updates so far (the trainer's policy version)
        self.rollout_version = 0  # the version of the weights the rollout engine samples with
        self._prox_snapshot: WeightSnapshot | None = None  # compute_prox_log_prob: the sync period's first weights
        self._unverified_logged = False  # verify on, an engine that cannot report its weights: said once

    def _actor_batch_sizes(self) -> ActorBatchSizes:
        """verl's normalisation: mini-batch prompts × rollout.n, divided over the dp ranks."""
        actor, dp = self.config.actor, self._dp_size()
        sizes = role_batch("actor_rollout_ref.actor", actor.ppo_mini_batch_size, self.config.rollout.n, dp,
                           per_gpu(actor.ppo_micro_batch_size_per_gpu, actor.ppo_micro_batch_size, dp),
                           actor.use_dynamic_bsz, require_micro=True)
        return ActorBatchSizes(sizes.mini_batch_size, sizes.micro_batch_size or 1, actor.ppo_max_token_len_per_gpu)

    def _dp_size(self) -> int:
        actor = self.config.actor
        return engine_plugin(actor.strategy).data_parallel_size(self.world_size, actor.megatron,
                                                                actor.ulysses_sequence_parallel_size)

    # ---- building ----------------------------------------------------------------------

    def _build_engine(self, policy: Any, trainable: bool, role: str) -> TrainingEngine:
        """``policy``: the ``actor`` or ``ref`` subtree; its ``strategy`` picks the engine."""
        model, actor = self.config.model, self.config.actor
        request = EngineRequest(
            model=model, fsdp=policy.fsdp_config, megatron=policy.megatron,
            optim=actor.optim if trainable else None, grad_clip=actor.grad_clip,
            override_config=dict(model.override_config), gradient_checkpointing=model.enable_gradient_checkpointing,
            # a KV cache cannot be shared under gradient checkpointing (HF turns use_cache off there)
            use_shared_prompt=model.use_shared_prompt and not model.enable_gradient_checkpointing,
            lora=self.lora if trainable else None,
            ulysses_sequence_parallel_size=policy.ulysses_sequence_parallel_size,
            use_torch_compile=policy.use_torch_compile, exact=self.config.rollout.exact_log_probs,
            # FlowRL trains a log Z head with the policy (workers/flowrl_head.py)
            prepare=add_log_z_head(actor.proj_layer) if trainable and actor.policy_loss.loss_mode == "flowrl" else None,
        )
        return engine_plugin(policy.strategy).build(request, self.device, role)

    def _build_rollout(self, module: torch.nn.Module | None) -> BaseRollout:
        eos_ids = generation_eos_ids(self.tokenizer, self.config.model.path)
        # no HF module (a Megatron actor and vLLM): the engine reads the config from the model
        # directory and takes the weights from the actor's engine, HF-named, tensor by tensor; a
        # rollout pool of its own (no actor here) loads the checkpoint and then receives syncs
        config, extra = self.config.rollout, {}
        if self.engine is not None and self.config.rollout.name != "hf":
            # HF names (a LoRA actor's weights merged), from whichever engine trains
            extra = {"model_path": resolve_model_path(self.config.model.path), "weight_source": self.engine.iter_hf_weights}
            if self.lora is not None and config.lora_sync == "adapter" and config.name == "vllm":
                extra |= {"adapter_source": self._adapter_for_rollout, "lora_rank": self.lora.rank}
        elif module is None:
            extra = {"model_path": resolve_model_path(self.config.model.path)}
            config = dataclasses.replace(config, load_format="auto")
        mtp = self.config.model.mtp
        if mtp.enable_rollout:  # the MTP layers draft (rollout.name=hf: trainer/config.py refuses the others)
            extra |= {"mtp_draft_path": resolve_model_path(self.config.model.path),
                      "speculative_tokens": int(mtp.num_speculative_tokens), "mtp_draft_synced": self._syncs_mtp()}
        return self._rollout_cls(module, config, pad_token_id=pad_id(self.tokenizer), eos_token_id=eos_ids,
                                 rank=self.rank, cpu_kernels=self._cpu_kernels(), **extra)

    def _syncs_mtp(self) -> bool:
        """The weight sync carries the MTP layers: the draft drafts with them and the trainer has them (``mtp.enable``:
        an engine that trains them, whose ``iter_hf_weights(mtp=True)`` streams them)."""
        mtp = self.config.model.mtp
        return bool(mtp.enable_rollout and mtp.enable)

    def _hf_weights(self):
        """The trainer's tensors for the rollout, the MTP layers' too where the draft takes them."""
        return self.engine.iter_hf_weights(mtp=True) if self._syncs_mtp() else self.engine.iter_hf_weights()

    def _adapter_for_rollout(self) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """The adapter's peft config and tensors (peft's file names) for an engine's LoRA request. Collective."""
        return self.engine.adapter_config(), self.engine.adapter_weights()

    def _rollout_module(self) -> torch.nn.Module | None:
        """The module the rollout samples from (HF) or syncs from (vLLM): the engine's own where it has
        one to share (FSDP); else, for the HF engine an HF copy of the policy that ``update_actor``
        refreshes tensor by tensor from the engine's weights, and for vLLM none (it loads the same
        stream). A rollout pool of its own (role ``rollout``) holds such a copy too: a whole replica
        per rank, refreshed by ``receive_weights``. A copy is loaded in ``_copy_dtype``."""
        shared = self.engine.rollout_module() if self.engine is not None else None
        if shared is not None:
            return shared
        if self.config.rollout.name != "hf":
            return None
        from rlfoundry.models.hf import load_hf_model

        module = load_hf_model(self.config.model.path, torch_dtype=self._copy_dtype(),
                               trust_remote_code=self.config.model.trust_remote_code).to(self.device)
        module.requires_grad_(False)
        if self.config.rollout.exact_log_probs:
            apply_exact(module)
        if self._cpu_kernels():
            cpu_kernels.apply_cpu_kernels(module, self.device)
        return module

    def _cpu_kernels(self) -> bool:
        """The CPU kernels for the rollout's module: off in exact mode (the engine's ``_cpu_kernels_on`` too)."""
        return cpu_kernels.enabled(self.config.model.cpu_kernels, self.device) and not self.config.rollout.exact_log_probs

    def _copy_dtype(self) -> torch.dtype:
        """The dtype of the HF rollout's own copy of the policy: the dtype the actor computes in on this
        device, as the shared module decodes in it (``rollout_log_probs_inexact`` decides from the same
        dtype): FSDP's ``mixed_precision.param_dtype``, by default bf16 on CUDA (half the memory and weight
        reads of fp32, for a rollout pool sharing the GPU with the trainer, or a judge) and fp32 on a CPU;
        an engine with a dtype key of its own (Megatron's ``megatron.dtype``) on CUDA, fp32 on a CPU, where
        bf16 matmuls are slow and the copy stayed fp32 before."""
        from rlfoundry.config.typed import pick
        from rlfoundry.engines.fsdp.utils import compute_dtype
        from rlfoundry.models.hf import resolve_dtype

        actor = self.config.actor
        own = engine_plugin(actor.strategy).dtype_key
        if own is not None:
            return resolve_dtype(pick(actor, own, None)) if self.device.type == "cuda" else torch.float32
        return compute_dtype(self.device, (actor.fsdp_config.mixed_precision or {}).get("param_dtype"))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        """Load, shard and wire up everything this role needs. Collective over the group."""
        from transformers import AutoTokenizer

        self.init_distributed()
        model = self.config.model
        path = check_model_dir(model.path)  # a bad path fails before any loading
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=model.trust_remote_code)
        seed = self.config.rollout.seed
        if self._is_actor:
            self.engine = self._build_engine(self.config.actor, True, "actor")
            self.actor = DataParallelPPOActor(self.config.actor, self.engine, self.actor_sizes, seed=seed,
                                              distillation_loss=self.distillation_loss)
        if self._is_rollout:
            self.rollout = self._build_rollout(self._rollout_module())
            self.agent_loop = self._build_agent_loop()
            if self._is_actor and (starts_from_dist_checkpoint(self.config.actor) or self._copy_lacks_adapter()):
                self._refresh_rollout()  # its copy came from model.path, the actor's weights from elsewhere
        if self._is_ref and self._is_actor and self.lora is not None:
            self._ref_in_actor = True
            self.ref_policy = DataParallelPPOActor(self.config.ref, self.engine)
        elif self._is_ref:
            self.ref_policy = DataParallelPPOActor(self.config.ref, self._build_engine(self.config.ref, False, "ref"))

    def _copy_lacks_adapter(self) -> bool:
        """A rollout copy loaded from model.path (a Megatron actor's) lacks the adapter the actor starts
        from (``lora_adapter_path``) until it takes the merged weights."""
        return self.lora is not None and bool(self.lora.adapter_path) and self.engine.rollout_module() is None

    def _build_agent_loop(self) -> Any:
        """``rollout.multi_turn.enable``: the agent loops over the rollout engine (``build_agent_loop``)."""
        if not self.config.rollout.multi_turn.enable:
            return None
        from rlfoundry.workers.rollout.agent_loop import build_agent_loop

        return build_agent_loop(self.rollout, self.tokenizer, self.config.rollout)

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self.engine.optimizer if self.engine is not None else None

    # ---- data methods ------------------------------------------------------------------

    def _require(self, part: Any, what: str) -> None:
        if part is None:
            raise RuntimeError(f"{what} is not available for role {self.role!r} (or init_model was not called)")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """n samples per prompt from the current policy (contract: ``HFRollout.generate_sequences``)."""
        self._require(self.rollout, "generate_sequences")
        start = time.perf_counter()
        prompts = on_device(prompts, self.device)
        if self._is_actor and self.rollout_version != self.param_version:
            raise StaleWeightsError(
                f"rank {self.rank}: the rollout engine holds the weights of param_version {self.rollout_version} but "
                f"the actor is at {self.param_version}; a weight sync after update_actor was skipped.")
        # On OOM: fewer prompts per engine call, kept for the rest of the run (workers/utils/oom.py)
        out = oom.backoff_of(self).run("generate_sequences", len(prompts), lambda rows: self._generate(prompts, rows))
        out.meta_info["generate_seconds"] = time.perf_counter() - start  # the rollout pool's busy time
        out.non_tensor_batch["param_version"] = np.full(len(out), self.rollout_version, dtype=object)
        if not self.config.rollout.calculate_log_probs and "rollout_log_probs" in out.batch.keys():
            # verl's rollout.calculate_log_probs (on wherever the run reads them: trainer/config.py)
            out.pop(batch_keys=["rollout_log_probs"])
        return out.to("cpu")

    def _generate(self, prompts: DataProto, rows: int) -> DataProto:
        # partial rollout's multi-turn: the driver runs the agent loops and sends their turns' chunks here
        engine = self.rollout if prompts.meta_info.get(ENGINE_ONLY) else (self.agent_loop or self.rollout)
        if rows >= len(prompts):
            return engine.generate_sequences(prompts)
        return DataProto.concat([engine.generate_sequences(part) for part in prompts.split(rows)])

    def _log_prob_kwargs(self, cfg: Any, data: DataProto) -> dict[str, Any]:
        """Micro-batching of a ``rollout``/``ref`` subtree's ``log_prob_*`` keys and the sampling temperature."""
        return {
            "micro_batch_size": cfg.log_prob_micro_batch_size_per_gpu or 1,
            "max_token_len": cfg.log_prob_max_token_len_per_gpu if cfg.log_prob_use_dynamic_bsz else None,
            "temperature": float(data.meta_info.get("temperature", self.config.rollout.temperature)),
        }

    def _log_prob_with_backoff(self, name: str, policy: DataParallelPPOActor, data: DataProto,
                               kwargs: dict[str, Any], **asked: Any) -> dict[str, torch.Tensor]:
        """``policy.compute_log_prob_outputs`` (``asked``: its ``calculate_*`` flags, ``topk``); on OOM the micro-batch
        (or token budget) halves and stays halved."""
        key = "micro_batch_size" if kwargs["max_token_len"] is None else "max_token_len"
        floor = 1 if key == "micro_batch_size" else int(data.batch["attention_mask"].sum(-1).max())

        def run(size: int):
            return policy.compute_log_prob_outputs(data, **asked, **{**kwargs, key: size})

        unit = "rows" if key == "micro_batch_size" else "tokens"
        return oom.backoff_of(self).run(name, kwargs[key], run, floor=floor, unit=unit)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """``old_log_probs`` and ``entropys`` (B, Tr) of the responses under the current policy, and with
        ``actor.calculate_sum_pi_squared`` ``sum_pi_squared`` (B, Tr): sum_v pi(v|s_t)^2, what the optimal
        token baselines read (verl's key), from the same forward.

        Uses ``rollout.log_prob_*`` micro-batching and ``meta_info["temperature"]`` (default:
        ``rollout.temperature``), so the numbers match what the rollout sampled with. Its ``meta_info``
        says the temperature, ``param_version`` and ``compute_dtype`` it scored with (the mismatch audit's).
        """
        self._require(self.actor, "compute_log_prob")
        return self._actor_log_probs(data, self.param_version)

    def _actor_log_probs(self, data: DataProto, version: int) -> DataProto:
        """``compute_log_prob``'s pass under whatever weights the engine holds now (``version``: their update count)."""
        data = on_device(data, self.device)
        data, mine = self.actor.engine.model_parallel_rows(data)
        kwargs = self._log_prob_kwargs(self.config.rollout, data)
        squares = bool(self.config.actor.calculate_sum_pi_squared)
        out = self._log_prob_with_backoff("compute_log_prob", self.actor, data, kwargs, calculate_entropy=True,
                                          calculate_sum_pi_squared=squares)
        tensors = {"old_log_probs": out["log_probs"][mine], "entropys": out["entropy"][mine]}
        if squares:
            tensors["sum_pi_squared"] = out["sum_pi_squared"][mine]
        # MoE routing replay (docs/moe.md): R2's recorded experts; R3's per-row routing-change counts
        tensors |= {k: v[mine] for k, v in out.items() if k in ROUTING_OUTPUTS}
        # the mismatch audit's evidence (trainer/ppo/mismatch.py): the version and dtype that scored the rows
        meta = {"temperature": kwargs["temperature"], "param_version": version,
                "compute_dtype": str(self._copy_dtype()).removeprefix("torch."),
                "moe_layers": self._moe_layers(), "fp32_recompute": self.actor.engine.full_precision() is not None}
        return DataProto.from_dict(tensors=tensors, meta_info=meta).to("cpu")

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_prox_log_prob(self, data: DataProto) -> DataProto:
        """``compute_log_prob`` under the weights of update count ``meta_info["prox_version"]``, the first
        step of the current sync period (verl's fully-async ``compute_prox_log_prob``).

        At that step the weights are the current ones: a CPU copy of them is kept (replacing the last
        period's) and the pass runs as usual. At a later step of the period the copy is swapped in for
        the pass and the current weights are put back bitwise; optimiser state is not touched. A run
        resumed mid-period has lost that copy: the weights it resumed with stand in until the next sync.
        """
        self._require(self.actor, "compute_prox_log_prob")
        want, engine = int(data.meta_info["prox_version"]), self.actor.engine
        with engine.weights_resident():  # offloaded parameters back in their tensors to be copied or written
            params = list(engine.trainable_parameters())
            held = self._prox_snapshot
            if held is not None and held.period == want:
                with held.swapped_in(params):
                    return self._actor_log_probs(data, held.param_version)
            if want != self.param_version:
                logger.warning(f"compute_prox_log_prob: the weights of update {want} (this sync period's first) "
                               f"are not held after the resume; the resumed weights (update {self.param_version}) "
                               "stand in for them until the next weight sync.")
            self._prox_snapshot = None  # the last period's copy goes before the new one is made
            self._prox_snapshot = WeightSnapshot(params, want, self.param_version)
            return self._actor_log_probs(data, self.param_version)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_log_prob_fp32(self, data: DataProto) -> DataProto:
        """``fp32_log_probs`` (B, Tr): what ``compute_log_prob`` gives, computed in fp32 (the engine's
        ``full_precision``). The mismatch audit calls it on a step's few worst rows, where
        ``compute_log_prob``'s ``meta_info["fp32_recompute"]`` says the engine can."""
        self._require(self.actor, "compute_log_prob_fp32")
        context = self.actor.engine.full_precision()
        if context is None:
            raise RuntimeError(f"the actor's engine ({type(self.actor.engine).__name__}) cannot compute in fp32 here "
                               "(sharded mixed precision, or weights stored below fp32); compute_log_prob's "
                               "meta_info['fp32_recompute'] says so before this is called")
        data = on_device(data, self.device)
        data, mine = self.actor.engine.model_parallel_rows(data)
        with context:
            out = self._log_prob_with_backoff("compute_log_prob_fp32", self.actor, data,
                                              self._log_prob_kwargs(self.config.rollout, data))
        return DataProto.from_dict(tensors={"fp32_log_probs": out["log_probs"][mine].float()}).to("cpu")

    def _moe_layers(self) -> int:
        """How many MoE routers of a kind routing replay knows the policy has (the mismatch audit's evidence)."""
        if self._moe_layer_count is None:
            module = self.engine.module
            own = getattr(self.engine, "moe_layer_count", None)  # an engine whose routers are not HF's (Megatron)
            self._moe_layer_count = own if own is not None else (
                len(routing_replay.routers(module)) if isinstance(module, torch.nn.Module) else 0)
        return self._moe_layer_count

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """``ref_log_prob`` (B, Tr) under the frozen reference policy (same temperature as sampling). With
        ``meta_info["topk"]`` k > 0 (a top-k distillation teacher's call) also ``ref_topk_log_probs`` and
        ``ref_topk_ids`` (B, Tr, k): the k likeliest tokens of each response position and their log-probs."""
        self._require(self.ref_policy, "compute_ref_log_prob")
        data = on_device(data, self.device)
        data, mine = self.ref_policy.engine.model_parallel_rows(data)
        kwargs = self._log_prob_kwargs(self.config.ref, data)
        topk = int(data.meta_info.get("topk", 0))
        with self.engine.adapter_disabled() if self._ref_in_actor else contextlib.nullcontext():
            out = self._log_prob_with_backoff("compute_ref_log_prob", self.ref_policy, data, kwargs, topk=topk)
        tensors = {"ref_log_prob": out["log_probs"][mine]}
        if topk:
            tensors |= {"ref_topk_log_probs": out["topk_log_probs"][mine], "ref_topk_ids": out["topk_ids"][mine]}
        return DataProto.from_dict(tensors=tensors).to("cpu")

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def refresh_ref_from_actor(self) -> None:
        """Copy the actor's weights into the reference (SPIN, verl's ``trainer.ref_update_freq``): each rank
        its own shard, the two engines being built alike from one model; the rollout is untouched."""
        self._require(self.ref_policy, "refresh_ref_from_actor")
        self._require(self.optimizer, "refresh_ref_from_actor")
        if self._ref_in_actor:
            raise RuntimeError("a LoRA run's reference is the actor's base model: it cannot take the actor's weights")
        ref = dict(_plain_names(self.ref_policy.engine.module))
        with torch.no_grad(), self.engine.weights_resident(), self.ref_policy.engine.weights_resident():
            actor = dict(_plain_names(self.engine.module))
            if actor.keys() != ref.keys():
                raise RuntimeError(f"actor and reference differ in parameters: {sorted(actor.keys() ^ ref.keys())[:4]}")
            for name, param in actor.items():
                _local(ref[name]).copy_(_local(param))

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def update_actor(self, data: DataProto) -> DataProto:
        """One training step's PPO update; then the lr schedule steps and the rollout is told.

        Returns an empty DataProto whose ``meta_info["metrics"]`` has verl's ``actor/*`` metrics
        (lists with one value per optimiser step) and ``actor/lr`` (the lr this step used).
        """
        self._require(self.optimizer, "update_actor")
        data = self.engine.update_rows(on_device(data, self.device))
        data.meta_info.setdefault("temperature", self.config.rollout.temperature)
        staleness = self._staleness_metrics(data)
        self.engine.onload()
        metrics = oom.update_or_explain_oom("actor", lambda: self._update_policy(data),
                                            micro_batch_size=self.actor_sizes.micro_batch_size)
        metrics["actor/lr"] = self.engine.step_lr_scheduler()
        self.engine.offload()
        self.param_version += 1
        self._refresh_rollout()
        return DataProto(meta_info={"metrics": metrics | staleness | {"actor/param_version": self.param_version}})

    def _staleness_metrics(self, data: DataProto) -> dict[str, float]:
        """Updates between the weights that sampled each row and those about to train on it. A hybrid
        worker's own rollout samples with the current weights: anything older is a stale engine."""
        if "param_version" not in data.non_tensor_batch:
            return {}  # a batch from elsewhere (a test, an SFT-style caller)
        lag = self.param_version - data.non_tensor_batch["param_version"].astype(np.int64)
        if self._is_rollout and int(lag.max()) != 0:
            raise StaleWeightsError(f"rank {self.rank}: samples generated with param_version "
                                    f"{self.param_version - int(lag.max())} reach update {self.param_version + 1} of a "
                                    "hybrid engine, whose rollout must sample with the current weights.")
        return {"rollout/param_staleness_mean": float(lag.mean()), "rollout/param_staleness_max": float(lag.max())}

    def _refresh_rollout(self) -> None:
        """After the actor's weights changed: a rollout on a copy takes them tensor by tensor; one that
        pulls them (vLLM, SGLang) is told and pulls; one on the engine's own module (HF) is told. Both
        loads are verified when ``checkpoint_engine.verify``."""
        if self.rollout is None:
            return
        # a LoRA adapter sync (vLLM, lora_sync=adapter) pulls the adapter alone, whichever engine trains
        if self.engine.rollout_module() is None and not self.rollout.pulls_adapter():
            self._load_into_rollout(self._hf_weights(), self.param_version, "the hybrid rollout engine")
        else:
            self._pull_into_rollout()
            self.rollout_version = self.param_version

    def _verify_dtypes(self) -> dict[str, torch.dtype] | None:
        """The engine's storage dtypes when this sync is to be verified; None: verify off, or an engine
        that cannot report its weights (said once: its syncs go unverified)."""
        if not self.config.rollout.checkpoint_engine.verify:
            return None
        dtypes = self.rollout.weight_dtypes()
        if dtypes is None and not self._unverified_logged:
            self._unverified_logged = True
            logger.warning("rank %d: rollout.checkpoint_engine.verify is on but the %s engine cannot report "
                           "digests of its weights; its weight syncs go unverified (docs/async.md, verify).",
                           self.rank, type(self.rollout).__name__)
        return dtypes

    def _pull_into_rollout(self) -> None:
        """``on_actor_update``; for an engine that pulls the actor's weights, with verify on, the pulled
        stream is recorded on its way in (``weight_tap``) and the engine's digests compared after."""
        from rlfoundry.workers.weight_sync import DigestRecorder

        if self.rollout.pulls_adapter() and self.config.rollout.checkpoint_engine.verify:
            self._pull_adapter_into_rollout()
            return
        dtypes = self._verify_dtypes() if self.rollout.pulls_weights() else None
        if dtypes is None:
            self.rollout.on_actor_update()
            return
        recorder, streams = DigestRecorder(dtypes), []

        def tap(weights):
            streams.append(recorder.wrap(weights))
            return streams[-1]

        self.rollout.weight_tap = tap
        try:
            self.rollout.on_actor_update()
            if not streams:  # the engine pulled nothing (a skipped sync): what it should hold, to compare
                self.rollout._weights(None)
        finally:
            self.rollout.weight_tap = None
        for stream in streams:  # what the engine left unread must still match (and every rank gather it)
            for _ in stream:
                pass
        self._compare_rollout_digests(recorder.expected, self.param_version, "the hybrid rollout engine")

    def _pull_adapter_into_rollout(self) -> None:
        """A verified LoRA adapter sync (vLLM, ``lora_sync=adapter``): the adapter the engine was sent is
        recorded (``adapter_tap``), or, if it was sent nothing (a skipped sync), the actor's adapter is
        gathered to compare with; then the engine's digests of the adapter its LoRA layers hold."""
        from rlfoundry.workers.weight_sync import compare_digests

        sent: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
        self.rollout.adapter_tap = lambda config, tensors: sent.append((config, tensors))
        try:
            self.rollout.on_actor_update()
        finally:
            self.rollout.adapter_tap = None
        config, tensors = sent[-1] if sent else self._adapter_for_rollout()
        expected, held = self.rollout.adapter_digests(config, tensors)
        compare_digests(expected, held, where=f"the hybrid rollout engine's LoRA adapter on rank {self.rank}",
                        version=self.param_version)

    def _compare_rollout_digests(self, expected: dict[str, int], version: int, where: str) -> None:
        from rlfoundry.workers.weight_sync import compare_digests

        compare_digests(expected, self.rollout.weight_digests(), where=f"{where} on rank {self.rank}",
                        version=version, engine_name=self.rollout.engine_weight_name)

    def _load_into_rollout(self, weights: Any, version: int | None, where: str, sent: dict[str, int] | None = None) -> None:
        """Load a weight stream into the rollout engine; with verify on, compare its digests after.
        ``version`` None: the one the bridge's stream carried (known once it has ended)."""
        from rlfoundry.workers.weight_sync import DigestRecorder

        dtypes = self._verify_dtypes()
        if dtypes is None:  # verify off, or an engine that cannot report its weights
            self.rollout.sync_weights(weights)
        else:
            recorder = DigestRecorder(dtypes, sent=sent)
            stream = recorder.wrap(weights)
            self.rollout.sync_weights(stream)
            for _ in stream:  # what the engine left unread must still match (and the bridge be read to its end)
                pass
            version = self._bridge.version if version is None else version
            self._compare_rollout_digests(recorder.expected, version, where)
        self.rollout_version = self._bridge.version if version is None else version

    def _update_policy(self, data: DataProto) -> dict[str, list[float]]:
        faults.inject("update_actor", tensors=data.batch, nan_key="advantages")  # tests only (utils/faults.py)
        return self.actor.update_policy(data)

    # ---- weights to a rollout pool of its own (workers/checkpoint_engine.py) ---------------

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def open_weight_bridge(self) -> tuple[str, int]:
        """On the trainer's rank 0: open the bridge's store; its (host, port) for ``connect_weight_bridge``."""
        from rlfoundry.workers.checkpoint_engine import CheckpointEngine

        self._require(self.actor, "open_weight_bridge")
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        self._bridge_store, port = CheckpointEngine.open_store(host, self.runtime.dist_timeout_s)
        return host, port

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def connect_weight_bridge(self, host: str, port: int, rollout_ranks: int) -> None:
        """Join the bridge (collective with the other pool): the trainer's rank 0 is its rank 0, rollout
        rank r its rank 1 + r; the trainer's other ranks only help gather the full tensors. Rollout ranks
        tell the sender their engine's dtypes, which a wider trainer's tensors are cast to before sending."""
        from rlfoundry.workers.checkpoint_engine import CheckpointEngine

        self._bridge = None
        if self._is_actor and self.rank != 0:
            return
        bridge_rank = 0 if self._is_actor else 1 + self.rank
        ce = self.config.rollout.checkpoint_engine
        timeout_s = self.runtime.dist_timeout_s if ce.timeout_s is None else ce.timeout_s
        self._bridge = CheckpointEngine.connect(host, port, bridge_rank, 1 + rollout_ranks,
                                                ce.update_weights_bucket_megabytes, timeout_s,
                                                store=self._bridge_store, digests=ce.verify,
                                                delta=ce.backend == "delta_sharded",
                                                dtypes=None if self._is_actor else self.rollout.storage_dtypes())

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def send_weights(self) -> dict[str, float]:
        """The trainer's side of a sync: every rank gathers (FSDP2 full tensors are collective), rank 0 sends."""
        self._require(self.actor, "send_weights")
        weights = self._hf_weights()
        if self._bridge is None:
            for _ in weights:  # the gather needs every rank
                pass
            return {}
        stats = self._bridge.send(weights, version=self.param_version)
        return {"tensors": stats.tensors, "bytes": stats.bytes, "meta_bytes": stats.meta_bytes,
                "buckets": stats.buckets, "elements": stats.elements, "changed": stats.changed,
                "param_version": self.param_version}

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> int:
        """The rollout's side of a sync: the trainer's tensors into the rollout engine, one at a time,
        compared with the trainer's digests after (``checkpoint_engine.verify``); the param_version now held."""
        self._require(self.rollout, "receive_weights")
        self._load_into_rollout(self._bridge.receive(), None, "the rollout pool", sent=self._bridge.sent_digests)
        return self.rollout_version

    @register(dispatch_mode=Dispatch.RANK_ZERO)
    def rollout_sampling_state(self) -> dict[str, Any]:
        """A rollout pool's engine state (the sampling RNG's position: calls so far), which the trainer's
        checkpoint keeps for it: the pool is not checkpointed itself (the trainer's weights are its)."""
        self._require(self.rollout, "rollout_sampling_state")
        return self.rollout.state_dict()

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_rollout_sampling_state(self, state: dict[str, Any]) -> None:
        """A resumed run: the pool's engines go on sampling where the checkpointed run's did at its
        oldest untrained prompt, so regenerated prompts get the draws the uninterrupted run gave them."""
        self._require(self.rollout, "load_rollout_sampling_state")
        self.rollout.load_state_dict(state)

    # ---- checkpoints -------------------------------------------------------------------

    def _extra_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"role": self.role, "param_version": self.param_version}
        if self.rollout is not None:
            state["rollout"] = self.rollout.state_dict()
        return state

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, local_path: str, global_step: int = 0, max_ckpt_to_keep: int | None = None) -> None:
        """Sharded model + optimiser + scheduler + RNG (+ engine/rollout counters) to ``local_path``, as
        ``actor.checkpoint.save_contents`` lists (``hf_model``: full weights in ``huggingface/`` too).

        ``local_path`` is this role's directory, e.g. ``D/global_step_N/actor``. With
        ``max_ckpt_to_keep``, this role's directories in older *finalised* steps beyond that count
        are removed (verl's ``max_actor_ckpt_to_keep``); whole-step retention is the trainer's job.
        """
        from rlfoundry import checkpoint as ckpt

        self._require(self.actor, "save_checkpoint")
        self.engine.save_checkpoint(local_path, {**self._extra_state(), "global_step": int(global_step)},
                                    tokenizer=self.tokenizer, contents=self.config.actor.checkpoint.save_contents)
        path = Path(local_path)
        if max_ckpt_to_keep and self.rank == 0 and re.fullmatch(r"global_step_\d+", path.parent.name):
            ckpt.remove_old_checkpoints(path.parent.parent, max_ckpt_to_keep, component=path.name)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, local_path: str, verify: bool = True) -> dict[str, Any]:
        """Restore what ``save_checkpoint`` wrote; returns its extra state (``global_step`` …)."""
        self._require(self.actor, "load_checkpoint")
        extra = self.engine.load_checkpoint(local_path, verify=verify,
                                            contents=self.config.actor.checkpoint.load_contents)
        # older checkpoints: every saved step had updated the actor unless the critic was warming up
        self.param_version = int(extra.get("param_version", extra.get("global_step", 0)))
        if self.rollout is not None and "rollout" in extra:
            self.rollout.load_state_dict(extra["rollout"])
        self._refresh_rollout()  # the rollout's copy (or vLLM's) follows the loaded weights
        return extra

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_ref_checkpoint(self, local_path: str) -> None:
        """The reference's weights alone (its model shards, each rank its own; no optimiser, schedule or
        RNG: it does not train) as a role directory at ``local_path``, staged and published like the
        actor's: what SPIN's refreshed reference needs to resume (``trainer._save_checkpoint``)."""
        self._require(self.ref_policy, "save_ref_checkpoint")
        self.ref_policy.engine.save_checkpoint(local_path, {"role": "ref"}, tokenizer=self.tokenizer,
                                               contents=["model"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def load_ref_checkpoint(self, local_path: str, verify: bool = True) -> None:
        """Restore the reference's weights that ``save_ref_checkpoint`` wrote."""
        self._require(self.ref_policy, "load_ref_checkpoint")
        self.ref_policy.engine.load_checkpoint(local_path, verify=verify, contents=["model"])

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def save_hf_model(self, path: str, adapter_only: bool = False) -> None:
        """Full safetensors weights + config + tokenizer at ``path``, loadable by ``from_pretrained`` (a
        LoRA policy merged); ``adapter_only``: the peft adapter directory (``PeftModel.from_pretrained``)."""
        self._require(self.actor, "save_hf_model")
        self.engine.save_hf_model(path, self.tokenizer, adapter_only=adapter_only)


def _plain_names(module: torch.nn.Module):
    """(name, parameter) without the wrappers' prefixes (activation checkpointing, torch.compile)."""
    for name, param in module.named_parameters():
        yield name.replace("_checkpoint_wrapped_module.", "").replace("_orig_mod.", ""), param


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a (D)Tensor, sharing its storage."""
    return t.to_local() if hasattr(t, "to_local") else t
