"""Vision-language models (Qwen2-VL / Qwen2.5-VL family): their processor, their 3-D rotary
positions, and the pixel inputs a forward takes (docs/vision.md).

transformers builds Qwen2-VL's processor with a video processor, and that one needs torchvision.
Where torchvision is missing, ``load_processor`` builds the same processor without it
(``ImageTextProcessor``: the model's image processor, tokenizer and chat template, the processor's
own image-token expansion), so image prompts work everywhere and video is a start-up error.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import ProcessorMixin, Qwen2VLProcessor

__all__ = ["ImageTextProcessor", "VISION_TOKENS", "continued_positions", "freeze_vision_tower", "idle_vision_tower", "is_vision_language",
           "load_processor", "mask_placeholders", "model_multimodal_kwargs", "model_position_ids", "placeholder_ids",
           "RopeIndex"]

logger = logging.getLogger(__name__)

# Qwen2-VL's vision special tokens: an image is <|vision_start|> <|image_pad|> x N <|vision_end|>
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


class ImageTextProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor with its image processor and tokenizer only (no video processor).

    Same ``__call__`` as ``Qwen2VLProcessor`` (each image token expanded to grid_t·grid_h·grid_w /
    merge² copies, ``mm_token_type_ids`` returned); it exists because transformers cannot build a
    video processor without torchvision, and so no Qwen2-VL processor at all.
    """

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token = getattr(tokenizer, "image_token", None) or "<|image_pad|>"
        self.video_token = getattr(tokenizer, "video_token", None) or "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def register_image_text_processor() -> None:
    """Let ``AutoProcessor`` resolve a directory whose ``processor_class`` is ``ImageTextProcessor`` (the tiny
    VLM's) in this process: engines that build the processor themselves with ``AutoProcessor`` (SGLang)
    otherwise get the bare tokenizer. Registered under a config class of its own, so no model type's
    processor changes."""
    from transformers import AutoProcessor, PretrainedConfig

    if getattr(register_image_text_processor, "done", False):
        return

    class _ImageTextProcessorConfig(PretrainedConfig):
        model_type = "rlfoundry_image_text_processor"

    AutoProcessor.register(_ImageTextProcessorConfig, ImageTextProcessor, exist_ok=True)
    register_image_text_processor.done = True


def is_vision_language(config: Any) -> bool:
    """A config with a vision tower (Qwen2-VL, Qwen2.5-VL, …)."""
    return getattr(config, "vision_config", None) is not None


def _model_type(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None


def load_processor(path: str | Path, trust_remote_code: bool = False) -> Any:
    """The model directory's processor, or None for a text-only model.

    ``AutoProcessor`` first; where it cannot build a Qwen2-VL processor (no torchvision for its video
    processor), the image-only ``ImageTextProcessor`` from the same files.
    """
    from transformers import AutoConfig, AutoProcessor

    path = Path(path)
    config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    if not is_vision_language(config):
        return None
    saved = path / "processor_config.json"
    ours = saved.is_file() and json.loads(saved.read_text()).get("processor_class") == "ImageTextProcessor"
    processor = None
    if not ours:
        try:
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (ImportError, AttributeError, TypeError, ValueError) as err:
            if _model_type(path) not in ("qwen2_vl", "qwen2_5_vl"):
                raise
            logger.warning("AutoProcessor could not build %s's processor (%s); using its image processor and "
                           "tokenizer without video (install torchvision for video)", path, err)
    processor = processor or ImageTextProcessor.from_pretrained(path)
    if _torchvision_is_a_standin() and getattr(processor.image_processor, "backend", None) == "torchvision":
        # the SGLang CPU environment's import-only torchvision: transformers takes it for torchvision and
        # would call it to resize; the PIL backend does the same work (the main environment's, no torchvision)
        from transformers import AutoImageProcessor

        processor.image_processor = AutoImageProcessor.from_pretrained(path, backend="pil",
                                                                       trust_remote_code=trust_remote_code)
    return processor


def _torchvision_is_a_standin() -> bool:
    """Whether ``torchvision`` is rlfoundry's import-only stand-in (scripts/sglang_cpu_standins/)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return False
    return bool(getattr(importlib.import_module("torchvision"), "STANDIN", False))


class RopeIndex:
    """The model's own ``get_rope_index`` (Qwen2-VL's multimodal rotary positions), without weights.

    The model is built on the meta device (no memory): ``get_rope_index`` reads only its config.
    ``__call__`` returns (3, B, T) positions for one left-padded batch of prompts.
    """

    def __init__(self, config: Any):
        from transformers import AutoModel

        with torch.device("meta"):
            model = AutoModel.from_config(config)
        self._get_rope_index = model.get_rope_index

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, mm_token_type_ids: torch.Tensor,
                 image_grid_thw: torch.Tensor | None) -> torch.Tensor:
        positions, _ = self._get_rope_index(input_ids, mm_token_type_ids=mm_token_type_ids,
                                            image_grid_thw=image_grid_thw, attention_mask=attention_mask)
        return positions


def continued_positions(prompt_pos: torch.Tensor, extra: int) -> torch.Tensor:
    """(..., T) positions followed by ``extra`` more, each one past the last: text after a prompt, in
    each of the 3 rotary axes of an image row's (..., 3, T) positions as in a text row's (..., T)."""
    steps = torch.arange(1, extra + 1, dtype=prompt_pos.dtype, device=prompt_pos.device)
    return torch.cat([prompt_pos, prompt_pos[..., -1:] + steps], dim=-1)


def model_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Batch-first positions as the model takes them: (B, 3, T) multimodal ones become (3, B, T)."""
    return position_ids.transpose(0, 1) if position_ids.dim() == 3 else position_ids


def model_multimodal_kwargs(rows: Any, device: torch.device | None = None) -> dict[str, torch.Tensor]:
    """The pixel inputs of a micro-batch: each row's ``multi_modal_inputs`` dict, concatenated in row
    order (``pixel_values`` (patches, C·t·p·p), ``image_grid_thw`` (images, 3)); {} for text rows."""
    if rows is None:
        return {}
    dicts = [r for r in rows if r]
    if not dicts:
        return {}
    keys = sorted({k for r in dicts for k in r})
    return {k: torch.cat([torch.as_tensor(r[k]) for r in dicts if k in r]).to(device) for k in keys}


def placeholder_ids(module: nn.Module) -> list[int]:
    """The image / video placeholder token ids of a vision-language model ([] for a text model).

    The policy never samples them (``mask_placeholders``): a placeholder in a response would be one
    more image token than the prompt's pixels fill, and the model's forward refuses that."""
    config = getattr(module, "config", None)
    if not is_vision_language(config):
        return []
    return [i for i in (getattr(config, "image_token_id", None), getattr(config, "video_token_id", None)) if i is not None]


def mask_placeholders(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """Logits with the placeholder ids at the dtype's lowest value (probability 0, and unlike -inf no
    NaN in the entropy's p·logit): the sampling rule and the trainer's log-probs agree."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), torch.finfo(logits.dtype).min)


def idle_vision_tower(model: nn.Module) -> torch.Tensor:
    """0 × the vision tower's output on the smallest image it takes (one merged patch of zeros).

    FSDP2 gathers a sharded unit's weights when the unit runs, as a collective of every rank: a
    micro-batch of text rows on one rank while another rank's holds images would run the tower on
    that rank only, and the ranks' collectives part (gloo aborts: "Received data size doesn't match").
    Added to such a micro-batch's embeddings it changes no value and gives the tower a zero
    gradient, so the tower's gathers and gradient reductions happen on every rank alike."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)
    vision = model.config.vision_config
    merge = int(getattr(vision, "spatial_merge_size", 2))
    channels = int(getattr(vision, "in_channels", None) or getattr(vision, "in_chans", 3))
    width = channels * int(getattr(vision, "temporal_patch_size", 1)) * int(vision.patch_size) ** 2
    device = next(tower.parameters()).device
    pixels = torch.zeros(merge * merge, width, device=device)
    out = tower(pixels, grid_thw=torch.tensor([[1, merge, merge]], device=device))
    parts = [out] if isinstance(out, torch.Tensor) else [v for v in (out.values() if hasattr(out, "values") else out)
                                                         if isinstance(v, torch.Tensor)]
    return sum(part.float().sum() for part in parts) * 0.0


def freeze_vision_tower(model: nn.Module) -> int:
    """``model.freeze_vision_tower`` (verl's key): the vision encoder and its merger take no gradient.

    Returns the number of parameters frozen. The tower is ``model.visual`` (transformers 5.x) or
    ``visual`` on older layouts."""
    inner = getattr(model, "model", model)
    tower = getattr(inner, "visual", None) or getattr(model, "visual", None)
    if tower is None:
        raise ValueError(f"model.freeze_vision_tower=true but {type(model).__name__} has no vision tower "
                         "(a text-only model); set it to false")
    tower.requires_grad_(False)
    return sum(p.numel() for p in tower.parameters())
