"""Weight syncs that prove themselves: per-tensor digests of what the trainer sent and of what the
rollout engine holds, compared after every sync (``rollout.checkpoint_engine.verify``).

A digest is a 64-bit multiset hash of a tensor's bit patterns *in the engine's dtype*: the trainer's
fp32 tensor is cast to the dtype the engine stores (bf16 for vLLM / SGLang) before hashing, exactly
as the engine's loader casts it, so an exact load hashes equal and anything else (a skipped sync, a
tensor left out, a partial or corrupted copy) does not. Each element's bits go through splitmix64's
mixer and the results are summed modulo 2**64:

- *cheap*: a few element-wise integer ops per weight, chunked, no sort, no host copy of the tensor;
- *additive*: the digest of a fused engine tensor (``qkv_proj``) is the sum of its parts' digests and
  a tensor-parallel shard's digests add up to the whole one's, so an engine that fuses or shards can
  be compared without undoing it;
- *order-insensitive* as a consequence: a load that permutes the elements of one tensor (a transposed
  copy) hashes equal. That is the price of the two points above; staleness is what this guards.

Pitfalls seen elsewhere and avoided here: comparing fp32 sums of values (cancels, and depends on the
reduction order); hashing before the dtype cast (bf16 engines never match); checking only the first
few elements; and checking only the first sync (a resume that reloads the initial weights passes).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from rlfoundry.utils import faults
from rlfoundry.utils.errors import StaleWeightsError

__all__ = ["DigestRecorder", "FusedNames", "compare_digests", "fold_digests", "module_digests", "module_layout",
           "tensor_digest", "weight_digests"]

_MASK = (1 << 64) - 1
_CHUNK = 1 << 22  # elements hashed at once: bounds the int64 temporaries to 32 MiB


def _signed(x: int) -> int:
    x &= _MASK
    return x - (1 << 64) if x >= 1 << 63 else x


_GOLDEN, _M1, _M2 = _signed(0x9E3779B97F4A7C15), _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _mix_sum(bits: torch.Tensor) -> int:
    """Σ splitmix64(bits) mod 2**64 over an int64 tensor (wrapping integer arithmetic, any device)."""
    z = bits + _GOLDEN
    z = (z ^ (z >> 30)) * _M1
    z = (z ^ (z >> 27)) * _M2
    z = z ^ (z >> 31)
    return int(z.sum()) & _MASK


def tensor_digest(tensor: torch.Tensor, dtype: torch.dtype | None = None) -> int:
    """The tensor's digest after a cast to ``dtype`` (default: its own), as an unsigned 64-bit int."""
    t = tensor.detach()
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    flat = t.reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    bits_dtype = _INT_OF_WIDTH[flat.element_size()]
    flat = flat.view(bits_dtype) if flat.dtype != bits_dtype else flat
    total = flat.numel()  # the element count enters too: an empty or truncated tensor differs
    for start in range(0, flat.numel(), _CHUNK):
        total += _mix_sum(flat[start:start + _CHUNK].to(torch.int64))
    return total & _MASK


def weight_digests(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, int]:
    """{name: digest} of tensors as they are (an engine's own weights)."""
    return {name: tensor_digest(t) for name, t in named_tensors}


# --------------------------------------------------------------------------- the stream an engine loads

def is_fused_experts(name: str, tensor: torch.Tensor) -> bool:
    """transformers 5 keeps a MoE layer's experts fused in 3-D tensors (``mlp.experts.gate_up_proj`` (E, 2I, H),
    ``down_proj`` (E, H, I)); vLLM's and SGLang's loaders read the checkpoint's per-expert names."""
    return ".experts." in name and tensor.dim() == 3


def checkpoint_named(model: Callable[[], torch.nn.Module], named_tensors: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream under the checkpoint's names, as a serving engine's loader reads them: each fused expert
    tensor as its experts' own tensors (``experts.{e}.gate_proj.weight`` …, views of it), by transformers'
    own reversal of the load-time conversion (``revert_weight_conversion``, what ``save_pretrained`` writes);
    every other tensor as it is. ``model()``: the HF model (its class and conversion mapping; a meta-device
    copy will do), asked for at the first fused tensor. One tensor at a time: a fused tensor splits into
    experts, it needs no other."""
    from transformers.core_model_loading import revert_weight_conversion

    for name, tensor in named_tensors:
        if is_fused_experts(name, tensor):
            yield from revert_weight_conversion(model(), {name: tensor}).items()
        else:
            yield name, tensor


# --------------------------------------------------------------------------- an engine's own module
# Run inside an engine's process (vLLM's worker, SGLang's scheduler) on the engine's ``nn.Module``.

# q/k/v and gate/up fused as vLLM's and SGLang's loaders stack them (``stacked_params_mapping``), for a
# model class that declares no ``packed_modules_mapping`` (SGLang's Qwen2)
DEFAULT_PACKED = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def checkpoint_part(layer: torch.nn.Module, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The part of an engine tensor that holds checkpoint values: vLLM and SGLang pad the vocabulary rows
    of their embedding and LM head (``org_vocab_size`` onwards: nothing loaded there)."""
    vocab = getattr(layer, "org_vocab_size", None)
    if name == "weight" and vocab is not None and tensor.dim() == 2 and tensor.shape[0] > vocab:
        return tensor[:vocab]
    return tensor


def module_layout(model: torch.nn.Module, loaded: Mapping[str, tuple[int, torch.dtype, int]] | None = None
                  ) -> tuple[dict[str, torch.dtype], dict[str, list[str]], bool, dict[str, int]]:
    """({engine parameter name: dtype}, the fused modules' parts, tied embeddings, the fused MoE tensors'
    experts): ``FusedNames``'s arguments. ``loaded``: {name: (digest, dtype, numel)} recorded as the loader
    wrote a parameter later processed into kernel form."""
    loaded = loaded or {}
    dtypes = {}
    for prefix, layer in model.named_modules():
        for name, param in layer.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            dtypes[full] = loaded[full][1] if full in loaded else param.dtype
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    packed = dict(getattr(model, "packed_modules_mapping", None) or DEFAULT_PACKED)
    return dtypes, {k: list(v) for k, v in packed.items()}, tied, fused_experts(model)


def module_digests(model: torch.nn.Module, loaded: Mapping[str, tuple[int, torch.dtype, int]] | None = None
                   ) -> dict[str, int]:
    """{engine parameter name: digest} of the parameter itself (its checkpoint part), or, where the engine
    processed it into kernel form after the load (a changed size or dtype), of ``loaded``'s record."""
    loaded = loaded or {}
    out = {}
    for prefix, layer in model.named_modules():
        for name, param in layer.named_parameters(recurse=False):
            full = f"{prefix}.{name}" if prefix else name
            part = checkpoint_part(layer, name, param)
            record = loaded.get(full)
            processed = record is not None and (part.numel() != record[2] or part.dtype != record[1])
            out[full] = record[0] if processed else tensor_digest(part)
    return out


# an expert's checkpoint tensor and the fused MoE tensor of vLLM's and SGLang's ``FusedMoE`` holding it
_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.\d+\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_FUSED_MOE = {"gate_proj": "w13_weight", "up_proj": "w13_weight", "down_proj": "w2_weight"}


def _experts_root(name: str) -> str:
    """``model.layers.0.mlp.experts`` of an engine's ``model.layers.0.mlp.experts[.routed_experts].w13_weight``:
    where the checkpoint names that layer's experts."""
    return name[: name.index(".experts") + len(".experts")]


def fused_experts(model: torch.nn.Module) -> dict[str, int]:
    """{engine parameter name: experts} of an engine's fused MoE tensors (``…experts.w13_weight``, dim 0 the
    experts): what ``FusedNames.hf_dtypes`` needs to name their parts."""
    return {name: int(param.shape[0]) for name, param in model.named_parameters()
            if name.rpartition(".")[2] in _FUSED_MOE.values() and ".experts" in name and param.dim() == 3}


class FusedNames:
    """The trainer's (HF) names against an engine that fuses tensors, from ``module_layout``'s answer."""

    def __init__(self, dtypes: Mapping[str, torch.dtype], packed: Mapping[str, Iterable[str]], tied: bool,
                 experts: Mapping[str, int] | None = None):
        self.dtypes, self.packed, self.tied = dict(dtypes), {k: list(v) for k, v in packed.items()}, tied
        self.experts = dict(experts or {})  # {fused MoE tensor: its experts}
        # (the checkpoint's ``….experts``, w13/w2) -> the engine's tensor (vLLM: ``experts.routed_experts.w13_weight``)
        self._fused_moe = {(_experts_root(name), name.rpartition(".")[2]): name for name in self.experts}
        self.fused = {part: module for module, parts in self.packed.items() for part in parts}

    def hf_dtypes(self) -> dict[str, torch.dtype]:
        """{HF name: the engine's dtype}, a fused tensor's parts each under its own name (a fused MoE layer's
        experts each under theirs, ``experts`` giving how many)."""
        out = {}
        for name, dtype in self.dtypes.items():
            if name in self.experts:
                fused = name.rpartition(".")[2]
                projections = [proj for proj, into in _FUSED_MOE.items() if into == fused]
                out.update({f"{_experts_root(name)}.{e}.{proj}.weight": dtype for e in range(self.experts[name])
                            for proj in projections})
                continue
            head, _, param = name.rpartition(".")
            prefix, _, module = head.rpartition(".")
            for part in self.packed.get(module, [module]):
                out[f"{prefix}.{part}.{param}" if prefix else f"{part}.{param}"] = dtype
        return out

    def engine_name(self, name: str) -> str | None:
        """q/k/v_proj -> qkv_proj, gate/up_proj -> gate_up_proj, an expert's gate/up_proj -> its layer's
        ``experts.w13_weight`` and down_proj -> ``experts.w2_weight`` (vLLM's and SGLang's fused MoE); a tied
        ``lm_head.weight`` -> None (the engine's LM head is its embedding); any other name as it is."""
        if name in self.dtypes:
            return name
        expert = _EXPERT.match(name)
        if expert is not None:
            fused = self._fused_moe.get((expert["layer"], _FUSED_MOE[expert["proj"]]))
            if fused is not None:
                return fused
        head, _, param = name.rpartition(".")
        prefix, _, module = head.rpartition(".")
        if module in self.fused:
            packed = f"{prefix}.{self.fused[module]}.{param}" if prefix else f"{self.fused[module]}.{param}"
            if packed in self.dtypes:
                return packed
        if self.tied and name == "lm_head.weight":
            return None
        return name


class DigestRecorder:
    """Wraps a weight stream on its way into an engine and records what each tensor must hash to there.

    ``dtypes``: the engine's storage dtype per name (a name it does not list keeps the sent dtype).
    The fault point ``sync_weights.tensor`` (``utils/faults.py``, action ``nan``) corrupts a tensor
    *after* its digest was taken, as a broken loader would: the verify tests inject it.
    """

    def __init__(self, dtypes: Mapping[str, torch.dtype] | None = None, sent: Mapping[str, int] | None = None):
        self.dtypes = dict(dtypes or {})
        self.sent = sent  # the sender's digests (the checkpoint engine's), filled as the stream arrives
        self.expected: dict[str, int] = {}

    def _expected(self, name: str, tensor: torch.Tensor) -> int:
        dtype = self.dtypes.get(name, tensor.dtype)
        if self.sent is not None and name in self.sent and dtype == tensor.dtype:
            return self.sent[name]  # the trainer's own digest: the wire is checked too, and no second pass
        return tensor_digest(tensor, dtype)

    def wrap(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in named_tensors:
            self.expected[name] = self._expected(name, tensor)
            box = {"tensor": tensor}
            faults.inject("sync_weights.tensor", tensors=box, nan_key="tensor")  # tests only
            yield name, box["tensor"]


def fold_digests(expected: Mapping[str, int], engine_name: Callable[[str], str | None]
                 ) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The sent digests under the engine's names: ``engine_name(sent name)`` is the engine tensor that holds
    it (q/k/v_proj all map to vLLM's ``qkv_proj``), None when the engine keeps no copy of its own (a tied
    ``lm_head``). Parts of one engine tensor add up (the digest is additive). Returns ({engine name:
    digest}, {engine name: the sent names folded into it}), both in the order the sent names came."""
    folded: dict[str, int] = {}
    parts: dict[str, list[str]] = {}
    for name, digest in expected.items():
        target = engine_name(name)
        if target is None:
            continue
        folded[target] = (folded.get(target, 0) + digest) & _MASK
        parts.setdefault(target, []).append(name)
    return folded, parts


def compare_digests(expected: Mapping[str, int], actual: Mapping[str, int], *, where: str, version: int,
                    engine_name: Callable[[str], str | None] | None = None) -> None:
    """Raise ``StaleWeightsError`` naming the first tensor the engine holds differently (in the
    trainer's order) or did not receive; names only the engine has are the engine's business.
    ``engine_name``: for an engine that fuses or renames tensors, as ``fold_digests`` (``actual`` then
    has the engine's names); the error names the engine's tensor and the sent tensors fused into it."""
    parts: dict[str, list[str]] = {}
    if engine_name is not None:
        expected, parts = fold_digests(expected, engine_name)

    def label(name: str) -> str:
        sent = parts.get(name, [name])
        return repr(name) if sent == [name] else f"{name!r} (the engine's tensor holding {', '.join(sent)})"

    for name, digest in expected.items():
        if name not in actual:
            raise StaleWeightsError(
                f"weight sync to {where} (param_version {version}): the engine has no tensor {label(name)} after the "
                f"sync; it holds {len(actual)} tensors, the trainer sent {len(expected)}.")
        if actual[name] != digest:
            differing = sum(1 for k, d in expected.items() if actual.get(k) != d)
            raise StaleWeightsError(
                f"weight sync to {where} (param_version {version}): tensor {label(name)} differs from the trainer's "
                f"after the sync ({differing} of {len(expected)} tensors differ); the engine would sample from "
                "stale or corrupted weights. Check the engine's weight loader (names, dtypes, LoRA merge).")
