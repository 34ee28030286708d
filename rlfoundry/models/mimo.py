"""MiMo (Xiaomi's MiMo-7B) for transformers, which has no MiMo class: a Qwen2 model plus
``num_nextn_predict_layers`` multi-token-prediction (MTP) layers, ``model.mtp_layers.{i}.*``.

MiMo's checkpoints ship their own code (``auto_map``, trust_remote_code); the engines here load
models without remote code, so this module registers ``model_type="mimo"`` with transformers'
Auto classes: the config is Qwen2's with the MTP count, and the causal LM is Qwen2's, which runs
the main model and leaves the MTP tensors out of it. They feed the Megatron engine's MTP loss
(``engines/megatron/mtp.py``) and, as :class:`MtpDraft` (loaded by :func:`load_mtp_draft`), the HF
rollout's speculative decoding (``workers/rollout/mtp_speculative.py``). A transformers that knows
MiMo keeps its own classes.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RMSNorm

__all__ = ["MTP_LAYER_PREFIX", "MimoConfig", "MimoForCausalLM", "MtpDraft", "MtpLayer", "add_mtp_layers", "draft_problem",
           "load_mtp_draft", "register", "save_tiny_mimo"]

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


class MtpLayer(Qwen2DecoderLayer):
    """One MTP layer, in MiMo's names (mbridge's map of megatron-core's ``MultiTokenPredictionLayer``):
    ``token_layernorm`` (megatron's enorm), ``hidden_layernorm`` (hnorm), ``input_proj`` (eh_proj), a Qwen2
    decoder layer's own tensors, ``final_layernorm``.

    At position t, with h_t the main model's last hidden state *after* its final norm (megatron-core's
    decoder output, which its MTP block takes) and e the embedding of token t+1::

        out_t = final_layernorm(decoder_layer(input_proj([token_layernorm(e) ; hidden_layernorm(h_t)])))

    and ``lm_head(out_t)`` predicts token t+2. The attention is causal over the layer's own inputs (a KV cache
    of its own); rotary positions are the main model's (megatron-core passes the decoder's rotary embedding
    unrolled, and a common shift would not change the attention anyway)."""

    def __init__(self, config: Qwen2Config, index: int):
        super().__init__(config, layer_idx=0)  # layer 0's attention type (MiMo's layers are all full attention)
        self.self_attn.layer_idx = index  # its slot in the draft's own cache
        hidden = config.hidden_size
        self.token_layernorm = Qwen2RMSNorm(hidden, eps=config.rms_norm_eps)
        self.hidden_layernorm = Qwen2RMSNorm(hidden, eps=config.rms_norm_eps)
        self.input_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.final_layernorm = Qwen2RMSNorm(hidden, eps=config.rms_norm_eps)

    def forward(self, hidden: torch.Tensor, token_embeds: torch.Tensor, attention_mask: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], cache) -> torch.Tensor:
        """(N, m, H) hidden states and next-token embeddings -> (N, m, H) ``out``; ``attention_mask`` (N, 1, m,
        cached + m) additive; ``cache``: the draft's DynamicCache (this layer's slot grows by m)."""
        x = self.input_proj(torch.cat([self.token_layernorm(token_embeds), self.hidden_layernorm(hidden)], dim=-1))
        x = super().forward(x, attention_mask=attention_mask, cache=cache, use_cache=True,
                            position_embeddings=position_embeddings)
        return self.final_layernorm(x)


class MtpDraft(nn.Module):
    """MiMo's MTP layers as a draft model: ``layers.{i}.*`` hold ``model.mtp_layers.{i}.*``. It shares the
    target's token embedding, rotary embedding and ``lm_head`` (passed per call, never copied)."""

    def __init__(self, config: Qwen2Config, count: int):
        super().__init__()
        self.layers = nn.ModuleList(MtpLayer(config, i) for i in range(count))

    @staticmethod
    def hf_name(name: str) -> str:
        """``layers.0.input_proj.weight`` -> ``model.mtp_layers.0.input_proj.weight``."""
        return MTP_LAYER_PREFIX + name.removeprefix("layers.")

    def load_hf_tensors(self, named_tensors) -> set[str]:
        """Copy (MiMo name, tensor) pairs in; returns the HF names of the draft's tensors not given."""
        params = {self.hf_name(n): p for n, p in self.named_parameters()}
        missing = set(params)
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
                missing.discard(name)
        return missing


def draft_problem(path) -> str | None:
    """Why the model directory at ``path`` has no MTP draft :func:`load_mtp_draft` builds (None: it has one, or
    there is no local ``config.json`` to read: the load says then)."""
    import json
    from pathlib import Path

    file = Path(path) / "config.json"
    if not file.is_file():
        return None
    config = json.loads(file.read_text())
    model_type, count = config.get("model_type"), int(config.get("num_nextn_predict_layers") or 0)
    if model_type != "mimo":
        return f"the draft is built for MiMo's MTP layers (model_type mimo), not model_type {model_type!r}"
    if count < 1:
        return "the model has no MTP layers (num_nextn_predict_layers=0)"
    return None


def load_mtp_draft(path, config: Qwen2Config, dtype: torch.dtype, device: torch.device) -> MtpDraft:
    """The MTP layers of the MiMo checkpoint at ``path`` (safetensors, any shards) as an :class:`MtpDraft`."""
    from pathlib import Path

    from safetensors import safe_open

    count = int(getattr(config, "num_nextn_predict_layers", 0) or 0)
    if count < 1:
        raise ValueError(f"{path}: the model has no MTP layers (num_nextn_predict_layers={count})")
    draft = MtpDraft(config, count).to(dtype=dtype)
    files = sorted(Path(path).glob("*.safetensors"))
    tensors = []
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            tensors += [(k, f.get_tensor(k)) for k in f.keys() if k.startswith(MTP_LAYER_PREFIX)]
    missing = draft.load_hf_tensors(tensors)
    if missing:
        raise ValueError(f"{path}: the checkpoint lacks MTP tensors {sorted(missing)[:4]} (of {len(missing)})")
    return draft.to(device).requires_grad_(False).eval()


def save_tiny_mimo(out_dir, mtp_layers: int = 1, seed: int = 0, **kwargs):
    """A tiny MiMo directory (tests, CPU runs): ``models.tiny``'s Qwen2 model and tokenizer made a MiMo by
    :func:`add_mtp_layers`. ``kwargs``: ``save_tiny_model``'s."""
    from rlfoundry.models.tiny import save_tiny_model

    return add_mtp_layers(save_tiny_model(out_dir, **kwargs), mtp_layers, seed)


def add_mtp_layers(model_dir, mtp_layers: int = 1, seed: int = 0):
    """Turn the Qwen2 directory ``model_dir`` (one safetensors file) into a MiMo, in place: its config MiMo's,
    plus ``mtp_layers`` MTP layers of random weights in MiMo's names (norm weights near, not at, 1, so that a
    norm used in the wrong place shows)."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    out = Path(model_dir)
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
