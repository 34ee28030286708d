"""The critic's model for a vision-language directory: its backbone (vision tower + language model)
with a one-label value head, ``score``, on every token — the VLM counterpart of
``AutoModelForTokenClassification``, which transformers has no class for (docs/vision.md).

verl loads a VLM critic as trl's ``AutoModelForCausalLMWithValueHead`` around
``AutoModelForVision2Seq`` (``verl/utils/model.py`` ``load_valuehead_model``: the LM head kept, a
``v_head`` beside it). Here the value model is the token classifier the text critic already is: the
family's own backbone (``Qwen2VLModel``) under the attribute ``model``, so a VLM directory's
``model.visual.*`` and ``model.language_model.*`` weights load as they are (its ``lm_head`` is left
out), and ``score`` (hidden → 1), which the critic zeroes when the directory has none. The classes
are registered with ``AutoModelForTokenClassification``, so ``load_hf_model(...,
"token_classification")``, LoRA's ``TOKEN_CLS`` task, FSDP2's per-layer units (the family's
``_no_split_modules``) and HF exports treat it as any critic.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoModelForTokenClassification
from transformers.modeling_outputs import TokenClassifierOutput
from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLConfig
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
    Qwen2_5_VLModel,
    Qwen2_5_VLPreTrainedModel,
)
from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLConfig
from transformers.models.qwen2_vl.modeling_qwen2_vl import (
    Qwen2VLModel,
    Qwen2VLPreTrainedModel,
)

from rlfoundry.models.vision import idle_vision_tower

__all__ = ["Qwen2VLForTokenClassification", "Qwen2_5_VLForTokenClassification", "register_value_models"]


class _VisionValueModel:
    """Shared body of the value models below: ``backbone`` is the family's multimodal base model."""

    backbone: type[nn.Module]

    def __init__(self, config: Any):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = self.backbone(config)
        self.score = nn.Linear(config.text_config.hidden_size, config.num_labels)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.model.get_input_embeddings()

    def forward(self, input_ids: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, pixel_values: torch.Tensor | None = None,
                image_grid_thw: torch.Tensor | None = None, inputs_embeds: torch.Tensor | None = None,
                **kwargs: Any) -> TokenClassifierOutput:
        """(B, T, num_labels) logits; ``position_ids`` (3, B, T) rotary positions as the model takes them."""
        kwargs.pop("use_cache", None)
        if pixel_values is None and input_ids is not None and _sharded():
            # a text micro-batch of a sharded model still runs the tower where the model would (after the
            # embeddings, before the language model), so every rank's FSDP2 collectives come in one order
            embeds = self.get_input_embeddings()(input_ids)
            inputs_embeds, input_ids = embeds + idle_vision_tower(self).to(embeds.dtype), None
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         pixel_values=pixel_values, image_grid_thw=image_grid_thw, inputs_embeds=inputs_embeds,
                         use_cache=False, **kwargs)
        return TokenClassifierOutput(logits=self.score(out.last_hidden_state))


def _sharded() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class Qwen2VLForTokenClassification(_VisionValueModel, Qwen2VLPreTrainedModel):
    backbone = Qwen2VLModel


class Qwen2_5_VLForTokenClassification(_VisionValueModel, Qwen2_5_VLPreTrainedModel):
    backbone = Qwen2_5_VLModel


def register_value_models() -> None:
    """Make ``AutoModelForTokenClassification`` build these for Qwen2-VL / Qwen2.5-VL configs (idempotent)."""
    for config, model in ((Qwen2VLConfig, Qwen2VLForTokenClassification),
                          (Qwen2_5_VLConfig, Qwen2_5_VLForTokenClassification)):
        if config not in AutoModelForTokenClassification._model_mapping:
            # exist_ok: transformers skips a registration for its own config classes without it
            AutoModelForTokenClassification.register(config, model, exist_ok=True)
