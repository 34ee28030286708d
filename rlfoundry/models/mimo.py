"""MiMo (Xiaomi's MiMo-7B) for transformers, which has no MiMo class: a Qwen2 model plus
``num_nextn_predict_layers`` multi-token-prediction (MTP) layers, ``model.mtp_layers.{i}.*``.

MiMo's checkpoints ship their own code (``auto_map``, trust_remote_code); the engines here load
models without remote code, so this module registers ``model_type="mimo"`` with transformers'
Auto classes: the config is Qwen2's with the MTP count, and the causal LM is Qwen2's, which runs
the main model and leaves the MTP tensors on disk (they only feed the Megatron engine's MTP loss,
``engines/megatron/mtp.py``; no rollout here drafts with them). A transformers that knows MiMo
keeps its own classes.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

__all__ = ["MTP_LAYER_PREFIX", "MimoConfig", "MimoForCausalLM", "register"]

MTP_LAYER_PREFIX = "model.mtp_layers."  # mbridge's MiMo names (mbridge/models/mimo.py)


class MimoConfig(Qwen2Config):
    model_type = "mimo"

    def __init__(self, num_nextn_predict_layers: int = 0, **kwargs):
        self.num_nextn_predict_layers = num_nextn_predict_layers
        super().__init__(**kwargs)


class MimoForCausalLM(Qwen2ForCausalLM):
    config_class = MimoConfig
    # the MTP layers have no module here: loading them is not an error, only unused
    _keys_to_ignore_on_load_unexpected = [r"model\.mtp_layers\."]


def register() -> None:
    if "mimo" in CONFIG_MAPPING:
        return
    AutoConfig.register("mimo", MimoConfig)
    AutoModelForCausalLM.register(MimoConfig, MimoForCausalLM)


register()


def save_tiny_mimo(out_dir, mtp_layers: int = 1, seed: int = 0, **kwargs):
    """A tiny MiMo directory (tests, CPU runs): ``models.tiny``'s Qwen2 model and tokenizer, its config
    turned into MiMo's, plus ``mtp_layers`` MTP layers of random weights in MiMo's names (norm weights
    near, not at, 1, so that a norm used in the wrong place shows). ``kwargs``: ``save_tiny_model``'s."""
    import json
    from pathlib import Path

    import torch
    from safetensors.torch import load_file, save_file
    from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

    from rlfoundry.models.tiny import save_tiny_model

    out = Path(save_tiny_model(out_dir, **kwargs))
    config = json.loads((out / "config.json").read_text())
    config.update(model_type="mimo", architectures=["MiMoForCausalLM"], num_nextn_predict_layers=mtp_layers)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    qwen = Qwen2Config(**{k: v for k, v in config.items() if k not in ("model_type", "architectures")})
    hidden = qwen.hidden_size
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(str(out / "model.safetensors"))
    for i in range(mtp_layers):
        torch.manual_seed(seed + 1 + i)
        layer = Qwen2DecoderLayer(qwen, layer_idx=0)
        for name, value in layer.state_dict().items():
            value = torch.randn(value.shape, generator=g) * 0.05 + (1.0 if "norm" in name else 0.0)
            tensors[f"{MTP_LAYER_PREFIX}{i}.{name}"] = value.contiguous()
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            tensors[f"{MTP_LAYER_PREFIX}{i}.{norm}.weight"] = 1.0 + 0.1 * torch.randn(hidden, generator=g)
        tensors[f"{MTP_LAYER_PREFIX}{i}.input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g) * 0.05
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
