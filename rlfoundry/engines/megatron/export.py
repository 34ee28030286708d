"""Offline export of a Megatron engine checkpoint (one role's directory) to a Hugging Face directory.

One CPU process, whatever layout saved it: the model is rebuilt at tensor = pipeline = 1 from the
HF config the checkpoint carries (``huggingface/``), megatron-core's dist-checkpointing reshards the
saved tensor / pipeline / virtual-pipeline shards onto it, and the engine's own exporter writes
HF-named safetensors (``score.*`` for a critic), the config and the tokenizer. Backs
``rlfoundry export`` for ``strategy=megatron`` runs (``checkpoint/export.py``'s ``ENGINE_EXPORTERS``).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch.distributed as dist

__all__ = ["export_megatron_checkpoint"]


@contextlib.contextmanager
def _single_process_group() -> Iterator[None]:
    """A one-rank gloo group (and megatron-core's parallel state on it) for the duration, unless
    this process already has a group."""
    from megatron.core import parallel_state as ps

    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory(prefix="rlfoundry-export-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            ps.destroy_model_parallel()
            dist.destroy_process_group()


def export_megatron_checkpoint(local_path: str | os.PathLike, out_path: str | os.PathLike,
                               adapter_only: bool = False) -> Path:
    """``.../global_step_N/<role>`` written by the Megatron engine -> an HF directory at ``out_path``; a
    LoRA actor's or critic's (its marker records the adapter) merged, or with ``adapter_only`` its peft adapter directory."""
    from transformers import AutoConfig, AutoTokenizer

    from rlfoundry.config.schema import MegatronConfig, MtpConfig
    from rlfoundry import checkpoint as ckpt
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    path = Path(local_path)
    meta = ckpt.read_component_marker(path)
    hf_dir = path / ckpt.HF_CONFIG_DIR
    from rlfoundry.engines.megatron.mtp import hf_mtp_layers
    from rlfoundry.models import mimo  # noqa: F401  (model_type "mimo" for AutoConfig)

    hf_config = AutoConfig.from_pretrained(hf_dir)
    arch = (hf_config.architectures or ["ForCausalLM"])[0]
    kind = "token_classification" if arch.endswith("ForTokenClassification") else "causal_lm"
    # the dtype it trained in: the exported tensors are those the model held
    megatron = MegatronConfig(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                              use_distributed_optimizer=False, dtype=meta.get("dtype", "float32"))
    config = MegatronEngineConfig(str(hf_dir), megatron, optim=None, model_kind=kind, load_hf_weights=False,
                                  lora=_lora_spec(meta.get("lora")),
                                  # the config an engine writes counts MTP layers only where it built them (mtp.py)
                                  mtp=MtpConfig(enable=True) if hf_mtp_layers(hf_config) else None)
    with _single_process_group():
        engine = MegatronEngine(config, "cpu", role=path.name)
        engine.load_checkpoint(str(path))
        tokenizer = AutoTokenizer.from_pretrained(hf_dir) if (hf_dir / "tokenizer_config.json").is_file() else None
        engine.save_hf_model(str(out_path), tokenizer, adapter_only=adapter_only)
    return Path(out_path)


def _lora_spec(saved: dict | None):
    """The adapter the checkpoint's marker records (peft's config keys), or None."""
    from rlfoundry.models.lora import LoraSpec

    if not saved:
        return None
    # a critic's marker: TOKEN_CLS with its value head saved in full (the adapter export carries it)
    return LoraSpec(rank=int(saved["r"]), alpha=float(saved["lora_alpha"]), target_modules=list(saved["target_modules"]),
                    task_type=saved.get("task_type") or "CAUSAL_LM", modules_to_save=tuple(saved.get("modules_to_save") or ()))
