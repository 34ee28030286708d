"""SGLang rollout engine, started from the actor's worker process (verl's hybrid engine).

``sglang.Engine`` runs in-process: its tokenizer manager lives in this process, its scheduler (the
model, the KV cache) and detokenizer in processes it spawns. After every actor update the weights
stream to it in Hugging Face names, in buckets, through ``update_weights_from_tensor`` (no disk
round trip); SGLang's model classes stack q/k/v and gate/up themselves.

Verify mode (``rollout.checkpoint_engine.verify``, docs/async.md): after each sync the engine's digests
are computed in its scheduler process over its own full tensors, under its names (``_report_weights``,
reached as a ``custom_weight_loader`` through ``update_weights_from_tensor``: ``sglang.Engine`` has no
call that returns a value computed there), and the trainer's HF-named digests are summed into them
(q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj). Not verified with tensor parallelism.

Output contract: exactly ``HFRollout.generate_sequences`` (B·n interleaved rows, right-padded
``responses`` of width ``response_length``, ``response_mask`` 1 through EOS, ``rollout_log_probs``).
Log-probs are SGLang's ``output_token_logprobs``: log softmax(logits / T) of the sampled token, before
top-k/top-p filtering (the value the actor's ``compute_log_prob`` recomputes, as the HF engine reports).

Config (``actor_rollout_ref.rollout``), verl's keys:

| key | here |
|---|---|
| n, temperature, top_p, top_k, do_sample, response_length, val_kwargs.*, ignore_eos | per request |
| prompt_length (+ response_length) | ``context_length`` unless ``max_model_len`` is set |
| dtype, seed (``random_seed``), max_num_seqs (``max_running_requests``), enforce_eager, enable_prefix_caching (``disable_radix_cache`` when false), cudagraph_capture_sizes (``cuda_graph_bs``) | passed to the engine |
| load_format | ``dummy*``: random init, synced from the actor at start-up; else read from disk once |
| gpu_memory_utilization | GPU: ``mem_fraction_static``. CPU: a KV cache of ``max_num_seqs`` full sequences |
|   | (at least 4096 tokens; ``engine_kwargs.sglang.max_total_tokens`` sets it) |
| free_cache_engine, enable_sleep_mode | GPU: ``enable_memory_saver`` (both true) (weights keep a host copy); memory released after each |
|   | generation, weights resumed for each sync, everything for each generation. CPU: nothing to release |
| tensor_model_parallel_size | runs as 1: one engine per actor rank, as vLLM's (the config layer warns; an engine |
|   | with ``tp_size`` > 1 would need GPUs its rank's worker cannot see) |
| update_weights_bucket_megabytes | tensors per ``update_weights_from_tensor`` call |
| enable_rollout_routing_replay | ``enable_return_routed_experts`` and, per request, ``return_routed_experts``: each
|   | sample's experts (SGLang's ``meta_info["routed_experts"]``) become the batch's ``routed_experts`` (an MoE policy, R3) |
| engine_kwargs.sglang.* | passed to ``sglang.Engine`` last (override everything above) |

Sampling seeds: SGLang's CPU path has no per-request seed (only its deterministic mode, which the CPU
attention backend lacks, uses one); the engine's RNG is seeded once from ``rollout.seed + rank``, so a
resumed run does not redraw the interrupted run's samples (the HF and vLLM engines do).

Image + text prompts (a vision-language model, docs/vision.md): each image row goes to SGLang with the
data set's token ids (image tokens expanded) and, as ``image_data``, the data set's own processor output for
its images (``{"format": "processor_output", "pixel_values", "image_grid_thw"}``, one item per row: SGLang's
precomputed multimodal input), so the engine's vision tower sees the trainer's very pixels; SGLang computes the
3-D rotary positions itself. The placeholder ids are never sampled (``logit_bias`` -1e30, applied before
SGLang's log-probs, as the trainer masks them). verl's SGLang rollout sends the PIL images for SGLang to
process again; that processing differs here (SGLang resizes Qwen2-VL images to at least 56x56 pixels,
whatever the model's processor says) and on the CPU needs a working torchvision.

Setting up SGLang: ``pip install sglang`` on GPU; ``bash scripts/setup_sglang_cpu.sh`` (``.venv-sglang``)
on a CPU-only machine. Nothing here imports SGLang at module level.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from rlfoundry.engines.fsdp.utils import hf_parameter_name
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.base import BaseRollout, SamplingParams, rollout_config
from rlfoundry.workers.rollout.token_requests import TokenRequests, as_id_list, assemble
from rlfoundry.workers.weight_sync import FusedNames

__all__ = ["SGLangRollout", "build_engine_kwargs"]

INSTALL_HINT = "pip install sglang (GPU); on a CPU-only machine: bash scripts/setup_sglang_cpu.sh"
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}
_CPU_MIN_KV_TOKENS = 4096


def build_engine_kwargs(config: Any, model_path: str, device_type: str, rank: int = 0,
                        hf_overrides: Mapping[str, Any] | None = None, trust_remote_code: bool = False) -> dict[str, Any]:
    """``sglang.Engine(**kwargs)`` from the rollout config (pure; the module docstring has the map)."""
    import json

    config = rollout_config(config)
    dtype = _DTYPES.get(config.dtype.lower())
    if dtype is None:
        raise ValueError(f"rollout.dtype={config.dtype!r}; use one of {sorted(_DTYPES)}")
    context = int(config.max_model_len or config.prompt_length + config.response_length)
    kwargs: dict[str, Any] = {
        "model_path": model_path, "dtype": dtype, "context_length": context,
        "load_format": "dummy" if config.load_format.startswith("dummy") else "auto",
        "random_seed": int(config.seed) + rank, "max_running_requests": int(config.max_num_seqs),
        "trust_remote_code": trust_remote_code, "log_level": "error",
        # prompts arrive as token ids and responses leave as token ids: no tokenizer in the engine
        "skip_tokenizer_init": True,
        "disable_cuda_graph": bool(config.enforce_eager),
        "disable_radix_cache": not config.enable_prefix_caching,  # SGLang's prefix caching
        **({"cuda_graph_bs": list(config.cudagraph_capture_sizes)} if config.cudagraph_capture_sizes else {}),
        # verify mode's digests are computed in the scheduler process by this "loader" (SGLangRollout._report)
        "custom_weight_loader": [_REPORT_WEIGHTS],
        # MoE routing replay: the scheduler keeps each token's experts (on the CPU its host buffer needs
        # rlfoundry's SGLang plugin, sglang_plugin.py)
        **({"enable_return_routed_experts": True} if config.enable_rollout_routing_replay else {}),
    }
    if hf_overrides:
        kwargs["json_model_override_args"] = json.dumps(dict(hf_overrides))
    if device_type == "cuda":
        # released weights keep a host copy (as vLLM's level-1 sleep): a step that skips the actor
        # update (critic warm-up) must generate with the last synced weights, not freed memory
        kwargs |= {"mem_fraction_static": config.gpu_memory_utilization,
                   "tp_size": 1,  # a worker sees its own GPU only (tensor_model_parallel_size: the module docstring)
                   "enable_memory_saver": bool(config.free_cache_engine and config.enable_sleep_mode),
                   "enable_weights_cpu_backup": bool(config.free_cache_engine and config.enable_sleep_mode)}
    else:
        # the CPU engine: torch's own attention, no overlap thread, an idle scheduler that sleeps
        # (it polls a whole core otherwise), a KV cache sized for max_num_seqs full sequences
        kwargs |= {"device": "cpu", "attention_backend": "torch_native", "disable_overlap_schedule": True,
                   "sleep_on_idle": True, "tp_size": 1, "mem_fraction_static": 0.05,
                   "max_total_tokens": max(_CPU_MIN_KV_TOKENS, context * min(int(config.max_num_seqs), 64))}
    extra = config.engine_kwargs.get("sglang") or {}
    kwargs.update({k: v for k, v in dict(extra).items() if v is not None})
    if _REPORT_WEIGHTS not in kwargs["custom_weight_loader"]:  # the user's own loaders, and ours
        kwargs["custom_weight_loader"] = [*kwargs["custom_weight_loader"], _REPORT_WEIGHTS]
    return kwargs


def _import_sglang() -> Any:
    if not torch.cuda.is_available():
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")  # read when sglang is first imported
        try:  # on the CPU the stand-in (setup_sglang_cpu.sh) defines op schemas SGLang's Qwen-VL imports read
            import sgl_kernel  # noqa: F401
        except ImportError:
            pass
    try:
        import sglang
    except ImportError as e:
        raise ImportError(f"actor_rollout_ref.rollout.name=sglang needs SGLang, which is not importable ({e}); "
                          f"{INSTALL_HINT}. Or use rollout.name=hf, which runs everywhere.") from e
    return sglang


class _HostState:
    """What ``sglang.Engine`` changes in the process that starts it and this project relies on: the
    multiprocessing start method (it forces ``spawn``), the root logger (``basicConfig(force=True)``
    at level ERROR) and the SIGTERM/SIGINT/SIGQUIT handlers (moved onto its event loop at the first
    request, after which SIGTERM no longer ends the worker). Saved before, put back after each call."""

    def __init__(self) -> None:
        root = logging.getLogger()
        self.start_method = multiprocessing.get_start_method(allow_none=True)
        self.handlers, self.level = list(root.handlers), root.level
        self.signals = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)}

    def restore(self) -> None:
        if multiprocessing.get_start_method(allow_none=True) != self.start_method:
            multiprocessing.set_start_method(self.start_method, force=True)
        root = logging.getLogger()
        root.handlers[:] = self.handlers
        root.setLevel(self.level)
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers belong to the main thread (the agent loop calls from others)
        for sig, handler in self.signals.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _kill_processes(pids: Iterable[int]) -> None:
    """SIGKILL ``pids`` and their descendants, and reap them; nothing else in the process tree."""
    import psutil

    procs = []
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            procs += [*proc.children(recursive=True), proc]
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


class SGLangRollout(BaseRollout):
    """An SGLang engine started by the actor's worker that samples for it and follows its weights.

    Arguments as ``VLLMRollout``'s: ``module`` (the actor's, weights synced from it) or
    ``weight_source`` (HF-named tensors, e.g. a Megatron actor's or a LoRA actor's merged stream);
    ``model_path`` the HF directory the engine reads its config (and, unless ``load_format`` is
    dummy, its first weights) from.
    """

    def __init__(self, module: nn.Module | None, config: Any, pad_token_id: int, eos_token_id: int | Sequence[int],
                 rank: int = 0, model_path: str | None = None, trust_remote_code: bool = False,
                 hf_overrides: Mapping[str, Any] | None = None, cpu_kernels: bool = False,
                 weight_source: Callable[[], Iterable[tuple[str, torch.Tensor]]] | None = None):
        self.module, self.config, self.rank = module, rollout_config(config), rank
        self.weight_source = weight_source
        self.pad_token_id, self.eos_token_ids = int(pad_token_id), as_id_list(eos_token_id)
        self.calls, self.syncs = 0, 0
        self._weight_layout: FusedNames | None = None  # verify mode
        model_path = model_path or getattr(getattr(module, "config", None), "name_or_path", None)
        if not model_path:
            raise ValueError("SGLangRollout needs model_path (an HF directory) when the module does not carry one")
        sglang = _import_sglang()
        self.model_path, self.trust_remote_code = str(model_path), trust_remote_code
        self._vision = _VisionRequests.of(module, model_path, trust_remote_code)
        self._routing = (_RoutedExperts.of(model_path, trust_remote_code)
                         if self.config.enable_rollout_routing_replay else None)
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.engine_kwargs = build_engine_kwargs(self.config, str(model_path), self.device_type, rank, hf_overrides,
                                                 trust_remote_code)
        self.context_length = int(self.engine_kwargs["context_length"])
        self._memory_saver = bool(self.engine_kwargs.get("enable_memory_saver", False))
        self._host = _HostState()
        before = _children()
        try:
            self.engine = sglang.Engine(**self.engine_kwargs)
        finally:
            self._host.restore()
        self._pids = sorted(_children() - before)  # scheduler, detokenizer: what shutdown may kill
        atexit.unregister(self.engine.shutdown)  # its own kills every child of this process: ours instead
        atexit.register(self.shutdown)
        if self.engine_kwargs["load_format"] == "dummy":
            if module is None and weight_source is None:
                raise ValueError(f"rollout.load_format={self.config.load_format!r} starts from random weights and "
                                 "needs the actor module (or a weight source) to sync from")
            self.sync_weights(None)
        self._release()

    # ---- checkpointable state ------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return {"calls": self.calls}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.calls = int(state["calls"])

    def shutdown(self) -> None:
        """Stop the engine's processes (only those: SGLang's own shutdown kills every descendant of
        this process, which under the process back end are the other ranks)."""
        if self.engine is None:
            return
        import sglang.srt.entrypoints.engine as engine_module

        kill_tree = engine_module.kill_process_tree
        engine_module.kill_process_tree = lambda *a, **k: _kill_processes(self._pids)
        try:
            self.engine.shutdown()
        finally:
            engine_module.kill_process_tree = kill_tree
            self._host.restore()
        self.engine = None

    def _require_engine(self) -> None:
        if self.engine is None:
            raise RuntimeError("the SGLang engine was shut down (SGLangRollout.shutdown); build a new rollout")

    # ---- memory hand-off (GPU) -----------------------------------------------------------

    def _release(self) -> None:
        if self._memory_saver:
            self.engine.release_memory_occupation()

    def _resume(self, tags: list[str] | None = None) -> None:
        if self._memory_saver:
            self.engine.resume_memory_occupation(tags=tags)

    # ---- weights -------------------------------------------------------------------------

    def sync_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]] | None = None) -> None:
        """Load new weights into the engine (HF names; wrapper prefixes stripped here). ``None``: from
        the weight source, or gathered from the actor module. Collective under FSDP2."""
        self._require_engine()
        named_tensors = self._weights(named_tensors)
        if self._vision is not None:  # SGLang's Qwen2-VL loads the hub checkpoint's names
            named_tensors = ((_VisionRequests.checkpoint_name(hf_parameter_name(n)), t) for n, t in named_tensors)
        self._resume(["weights"])
        self.engine.begin_weight_update()
        try:
            for bucket in _buckets(named_tensors, self.config.update_weights_bucket_megabytes << 20):
                ok, message = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
                if not ok:
                    raise RuntimeError(f"SGLang refused a weight update: {message}")
            if self._vision is not None:  # the vision tower's cached outputs came from the old weights
                ok, message = self.engine.update_weights_from_tensor(
                    named_tensors=[("clear_mm_cache:", torch.zeros(1))], load_format=_REPORT_WEIGHTS, flush_cache=False)
                if not ok:
                    raise RuntimeError(f"SGLang did not clear its multimodal embedding cache: {message}")
        finally:
            self.engine.end_weight_update()
        self.engine.flush_cache()  # the cached prefixes' KV blocks were computed by the old weights
        self._release()
        self.syncs += 1

    # ---- verify mode (rollout.checkpoint_engine.verify) ------------------------------------

    def pulls_weights(self) -> bool:
        return True

    def _report(self, what: str) -> Any:
        """``_report_weights(what)`` run in the engine's scheduler process on its model, the answer read back.
        It goes as an ``update_weights_from_tensor`` call whose ``load_format`` is that function (registered
        as the engine's ``custom_weight_loader``) and whose one tensor's name carries the answer's file,
        inside a weight-update session: SGLang restores weights it packed for its kernels (CPU) at the
        session's start, so the model holds them as loaded, and packs them again at its end."""
        import json
        import tempfile

        self._require_engine()
        self._resume(["weights"])
        try:
            with tempfile.TemporaryDirectory(prefix="rlfoundry-sglang-") as tmp:
                path = os.path.join(tmp, "weights.json")
                self.engine.begin_weight_update()
                try:
                    ok, message = self.engine.update_weights_from_tensor(
                        named_tensors=[(f"{what}:{path}", torch.zeros(1))], load_format=_REPORT_WEIGHTS,
                        flush_cache=False)
                finally:
                    self.engine.end_weight_update()
                if not ok or not os.path.exists(path):
                    raise RuntimeError(f"the SGLang engine did not report its weights ({what}): {message}")
                with open(path) as f:
                    return json.load(f)
        finally:
            self._release()

    def _layout(self) -> FusedNames:
        """The engine's names, dtypes and fused tensors (``weight_sync.FusedNames``), read once."""
        if self._weight_layout is None:
            answer = self._report("layout")
            dtypes = {name: getattr(torch, dtype.removeprefix("torch.")) for name, dtype in answer["dtypes"].items()}
            self._weight_layout = FusedNames(dtypes, answer["packed"], answer["tied"], answer["experts"])
        return self._weight_layout

    def weight_dtypes(self) -> dict[str, torch.dtype] | None:
        """{HF name: the engine's dtype}, the fused tensors' parts each under its own name. None with
        tensor parallelism (unverified: each rank holds a shard and its own copy of replicated tensors)."""
        if int(self.engine_kwargs.get("tp_size", 1)) > 1:
            return None
        if self._vision is not None:
            return _VisionRequests.live_dtypes(self._layout())
        return self._layout().hf_dtypes()

    def weight_digests(self) -> dict[str, int] | None:
        """{engine name: digest} of the engine's own weights, computed in its scheduler process over the
        full tensors (``_report_weights``); the trainer's HF-named digests fold into these names by
        ``engine_weight_name``."""
        if int(self.engine_kwargs.get("tp_size", 1)) > 1:
            return None
        return {name: int(d) for name, d in self._report("digests")["digests"].items()}

    def engine_weight_name(self, name: str) -> str | None:
        """q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj (as SGLang's loaders stack them); a tied
        ``lm_head.weight`` -> None (the engine's LM head is its embedding)."""
        name = hf_parameter_name(name)
        if self._vision is not None:
            name = _VisionRequests.checkpoint_name(name)
            if name.startswith("visual."):  # SGLang's vision attention: HF's attn.qkv, whole, as attn.qkv_proj
                return name.replace(".attn.qkv.", ".attn.qkv_proj.")
        return self._layout().engine_name(name)

    # ---- generation ----------------------------------------------------------------------

    def _sampling_params(self, params: SamplingParams, eos_ids: list[int], max_tokens: int) -> dict[str, Any]:
        ignore_eos = self.config.ignore_eos
        return {
            "n": params.n, "max_new_tokens": max_tokens,
            "temperature": 0.0 if params.greedy else params.temperature,
            "top_p": 1.0 if params.greedy else params.top_p,
            "top_k": params.top_k if (params.top_k > 0 and not params.greedy) else -1,
            # SGLang's ignore_eos also turns stop_token_ids off: the same rule as the other engines
            "stop_token_ids": [] if ignore_eos else eos_ids, "ignore_eos": ignore_eos,
        }

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """Sample ``n`` responses per prompt; contract identical to ``HFRollout.generate_sequences``."""
        self._require_engine()
        req = TokenRequests.of(prompts, self.config, self.pad_token_id, self.eos_token_ids)
        req.check_fits(self.context_length, "the SGLang engine's context length")
        sampling = [self._sampling_params(req.params, req.eos_ids, b) for b in req.budgets]
        images = None
        if self._vision is not None:
            images = self._vision.image_data(req.rows, prompts.non_tensor_batch.get("multi_modal_inputs"))
            for params in sampling:
                params["logit_bias"] = self._vision.logit_bias
        elif any(prompts.non_tensor_batch.get("multi_modal_inputs", ())):
            raise ValueError("the batch has multi_modal_inputs (images) but the SGLang engine's model is a text model")
        self.calls += 1
        self._resume()
        try:
            outputs = self.engine.generate(input_ids=req.rows, image_data=images, return_logprob=True,
                                           sampling_params=sampling, **({"return_routed_experts": True}
                                                                        if self._routing is not None else {}))
        finally:
            self._host.restore()
        self._release()
        responses, log_probs, lengths = _collect(outputs, req.params.n, req.params.response_length, req.pad_id)
        out = assemble(prompts, req.params.n, responses, log_probs, lengths, req.position_ids)
        if self._routing is not None:
            out.batch["routed_experts"] = self._routing.routes(outputs, prompts.batch["attention_mask"], req.params.n,
                                                               lengths, req.params.response_length)
        return out


class _RoutedExperts:
    """SGLang's routed experts as the batch's ``routed_experts`` (the HF engine's layout, routing_replay.py).

    SGLang returns, per sample, int32 ids (base64) of shape (prompt + response - 1, num_hidden_layers, k): every
    decoder layer, its dense ones included; the trainer's routing has the MoE layers only, in order."""

    def __init__(self, moe_layers: list[int], num_layers: int, top_k: int, num_experts: int):
        self.moe_layers, self.num_layers, self.top_k, self.num_experts = moe_layers, num_layers, top_k, num_experts

    @classmethod
    def of(cls, model_path: str, trust_remote_code: bool) -> _RoutedExperts:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code).get_text_config()
        if not hasattr(config, "num_experts_per_tok") or not hasattr(config, "num_experts"):
            raise ValueError(f"rollout.enable_rollout_routing_replay=true but {model_path} is not a mixture-of-experts "
                             "model with routing replay (Qwen2-MoE, Qwen3-MoE: docs/moe.md)")
        layers = int(config.num_hidden_layers)
        # transformers' Qwen2/3-MoE rule for which decoder layers hold a sparse MLP
        dense, step = set(getattr(config, "mlp_only_layers", None) or ()), int(getattr(config, "decoder_sparse_step", 1))
        moe = [i for i in range(layers) if i not in dense and (i + 1) % step == 0]
        return cls(moe, layers, int(config.num_experts_per_tok), int(config.num_experts))

    def routes(self, outputs: Sequence[dict[str, Any]], prompt_mask: torch.Tensor, n: int, lengths: torch.Tensor,
               response_length: int) -> torch.Tensor:
        import base64

        import numpy as np

        from rlfoundry.models.routing_replay import engine_routes

        samples = []
        for i, out in enumerate(outputs):
            encoded = out["meta_info"].get("routed_experts")
            if encoded is None:
                raise RuntimeError(f"SGLang returned no routed experts for sample {i} (return_routed_experts was set)")
            ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
            per_token = torch.from_numpy(ids.copy()).view(-1, self.num_layers, self.top_k)
            samples.append(per_token[:, self.moe_layers])
        return engine_routes(samples, prompt_mask.cpu(), n, lengths, response_length, self.num_experts)


class _VisionRequests:
    """Image rows of a vision-language model as SGLang requests (see the module docstring)."""

    def __init__(self, image_token_id: int, placeholders: list[int]):
        self.image_token_id = image_token_id
        self.logit_bias = {str(i): -1e30 for i in placeholders}  # never sampled, out of the log-probs' softmax

    @classmethod
    def of(cls, module: nn.Module | None, model_path: str, trust_remote_code: bool) -> _VisionRequests | None:
        from transformers import AutoConfig

        from rlfoundry.models.vision import is_vision_language, register_image_text_processor

        config = getattr(module, "config", None) or AutoConfig.from_pretrained(model_path,
                                                                               trust_remote_code=trust_remote_code)
        if not is_vision_language(config):
            return None
        register_image_text_processor()  # SGLang builds the directory's processor with AutoProcessor, here
        placeholders = [int(i) for i in (getattr(config, "image_token_id", None),
                                         getattr(config, "video_token_id", None)) if i is not None]
        return cls(int(config.image_token_id), placeholders)

    # transformers' module-name prefixes <-> the Qwen2-VL checkpoint's, the names SGLang's loader takes
    NAMES = (("model.visual.", "visual."), ("model.language_model.", "model."))

    @classmethod
    def checkpoint_name(cls, name: str) -> str:
        """transformers' module name -> the checkpoint's (``model.visual.*`` -> ``visual.*``,
        ``model.language_model.*`` -> ``model.*``)."""
        return next((saved + name[len(live):] for live, saved in cls.NAMES if name.startswith(live)), name)

    @classmethod
    def live_name(cls, name: str) -> str:
        """The checkpoint's name -> transformers' (``checkpoint_name``'s inverse)."""
        return next((live + name[len(saved):] for live, saved in cls.NAMES if name.startswith(saved)), name)

    @staticmethod
    def live_dtypes(layout: FusedNames) -> dict[str, torch.dtype]:
        """Verify mode's {transformers' name: the engine's dtype}: the language model's fused tensors split
        into their parts (``FusedNames.hf_dtypes``), the vision tower's tensors one for one (its
        ``attn.qkv_proj`` is HF's ``attn.qkv``), under the live module's names."""
        text = FusedNames({k: v for k, v in layout.dtypes.items() if not k.startswith("visual.")}, layout.packed,
                          layout.tied).hf_dtypes()
        out = {_VisionRequests.live_name(k): v for k, v in text.items()}
        for name, dtype in layout.dtypes.items():
            if name.startswith("visual."):
                out[_VisionRequests.live_name(name.replace(".attn.qkv_proj.", ".attn.qkv."))] = dtype
        return out

    def image_data(self, rows: list[list[int]], inputs: Sequence[Any] | None) -> list[Any]:
        """One ``image_data`` entry per row: its processor output, or None for a text row."""
        data = []
        for i, ids in enumerate(rows):
            row = inputs[i] if inputs is not None else None
            has_tokens = self.image_token_id in ids
            if has_tokens != bool(row):
                raise ValueError(f"prompt row {i} has {'image tokens but no' if has_tokens else 'no image tokens but'} "
                                 "multi_modal_inputs: an image row needs both (RLHFDataset with the model's processor)")
            if row and row.get("pixel_values_videos") is not None:
                raise ValueError("video prompts are not built for the SGLang rollout (images only)")
            data.append([{"format": "processor_output", "pixel_values": row["pixel_values"],
                          "image_grid_thw": row["image_grid_thw"]}] if row else None)
        return data


def _report_weights(model: nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Run by SGLang's scheduler as a custom weight loader (``SGLangRollout._report``): loads nothing; the
    one tensor's name is ``what:path``, and the answer (``layout``: ``weight_sync.module_layout``;
    ``digests``: ``module_digests`` of the model's own tensors) goes to ``path`` as JSON.
    ``clear_mm_cache:`` (no answer) empties SGLang's multimodal embedding cache, which holds the vision
    tower's outputs by image and which SGLang's ``flush_cache`` leaves: after a sync they are stale."""
    import json

    from rlfoundry.workers.weight_sync import module_digests, module_layout

    for name, _ in named_tensors:
        what, _, path = name.partition(":")
        if what == "clear_mm_cache":
            from sglang.srt.managers import mm_schedule

            if mm_schedule.embedding_cache is not None:
                mm_schedule.embedding_cache.clear()
            continue
        if what == "layout":
            dtypes, packed, tied, experts = module_layout(model)
            answer: dict[str, Any] = {"dtypes": {k: str(v) for k, v in dtypes.items()}, "packed": packed, "tied": tied,
                                      "experts": experts}
        elif what == "digests":
            answer = {"digests": module_digests(model)}
        else:
            raise ValueError(f"_report_weights: unknown request {what!r}")
        with open(path + ".part", "w") as f:
            json.dump(answer, f)
        os.replace(path + ".part", path)


_REPORT_WEIGHTS = f"{__name__}.{_report_weights.__name__}"


def _buckets(named: Iterable[tuple[str, torch.Tensor]], limit: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """(HF name, CPU copy) lists of at most ``limit`` bytes (a larger tensor alone). Copies: SGLang
    moves a CPU tensor's storage into shared memory in place, which must not happen to the actor's."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((hf_parameter_name(name), tensor.detach().to("cpu", copy=True)))
        size += nbytes
    if bucket:
        yield bucket


def _collect(outputs: Sequence[dict[str, Any]], n: int, width: int, pad_id: int) -> tuple[torch.Tensor, ...]:
    """SGLang outputs (prompt-major, n per prompt) -> responses (B·n, Tr), log-probs (B·n, Tr), lengths."""
    responses = torch.full((len(outputs), width), pad_id, dtype=torch.long)
    log_probs = torch.zeros((len(outputs), width), dtype=torch.float32)
    lengths = torch.zeros(len(outputs), dtype=torch.long)
    for i, out in enumerate(outputs):
        ids = list(out["output_ids"])[:width]
        lps = [float(lp) for lp, _, _ in out["meta_info"]["output_token_logprobs"]][:width]
        if len(lps) != len(ids):
            raise RuntimeError(f"SGLang returned {len(ids)} tokens but {len(lps)} log-probs for sample {i}")
        responses[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        log_probs[i, :len(lps)] = torch.tensor(lps, dtype=torch.float32)
        lengths[i] = len(ids)
    if len(outputs) % n:
        raise RuntimeError(f"SGLang returned {len(outputs)} samples, not a multiple of n={n}")
    return responses, log_probs, lengths
