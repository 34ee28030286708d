"""Multi-token prediction (MTP) on the Megatron engine: verl's ``model.mtp.*``.

A model with MTP layers (MiMo: ``num_nextn_predict_layers``; megatron-core's
``MultiTokenPredictionBlock``) has, after its decoder, D small blocks: block k combines the main
model's (or block k-1's) hidden state at position t with the embedding of token t+k and predicts
token t+k+1 through the shared output layer. verl trains them beside the policy:

- ``mtp.enable``: the model is built with its MTP layers, their weights loaded from and saved to the
  HF checkpoint through mbridge (MiMo's ``model.mtp_layers.*``). Without it they are not built
  (verl's ``check_mtp_config`` clears the count), and the HF config written back says so.
- ``mtp.enable_train``: each update's forward also runs the MTP block and adds
  ``mtp_loss_scaling_factor / D · Σ_k CE_k`` to the actor's loss, CE_k a language-model cross-entropy
  on the response tokens (verl passes ``label`` = the next tokens and ``loss_mask`` = the response mask
  over the prompt+response row to megatron-core's MTP loss, whatever the RL loss is). The output layer
  takes no gradient from it (verl's patch detaches it), the embedding and decoder do, unless
  ``detach_encoder``: then the block sees the decoder's hidden states and the token embeddings
  detached, and only the MTP layers learn from it. Log-prob passes never run the block.
  Without ``enable_train`` the MTP layers are frozen (no gradient, no weight decay: they stay as loaded).
- ``mtp.enable_rollout``: the HF rollout drafts with the MTP layers (``workers/rollout/mtp_speculative.py``),
  and the rollout's weight sync then carries them (``engine.iter_hf_weights(mtp=True)``, the worker's
  ``_hf_weights``); without it the sync leaves them out. Checkpoints and ``save_hf_model`` keep them.

Normalisation (where this differs from verl, on purpose): CE_k is a token mean over the whole
mini-batch on every data-parallel rank, as the policy loss's ``token-mean`` (``engines/loop.py``), so
the update does not depend on how the mini-batch is cut into micro-batches; verl averages per-micro-batch
token means. They agree when the micro-batches hold as many MTP tokens each. Metrics: verl's
``mtp_losses/mtp_{k}_loss`` (CE_k, unscaled).

Layouts: tensor (with sequence parallelism), pipeline (the block on the last stage, which keeps
megatron-core's copy of the embedding), context (the block's inputs rolled across the CP ranks by
megatron-core, its log-probs gathered into whole rows as the policy's) and data parallelism.

Which positions count for block k (1-based): position t with token t+k+1 a response token
(``response_mask``) and t itself a real token (so a prompt shorter than k+1 tokens does not feed a
padded position's hidden state to it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["MTP_FAMILIES", "MtpTraining", "hf_mtp_layers", "is_mtp_weight", "layout_problems", "mtp_bridge", "targets",
           "without_mtp"]

# mbridge families whose MTP block this module builds and names (tested on megatron-core's local layers; the
# TransformerEngine spec, a GPU's, goes the same way and is not run here)
MTP_FAMILIES = ("mimo",)
_HF_MTP_PREFIX = "model.mtp_layers."  # MiMo's names (mbridge/models/mimo.py)


def hf_mtp_layers(hf_config: Any) -> int:
    """How many MTP layers the HF config declares (MiMo / DeepSeek-V3: ``num_nextn_predict_layers``;
    Qwen3.5: ``mtp_num_hidden_layers``, maybe under ``text_config``)."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            if int(getattr(config, key, 0) or 0) > 0:
                return int(getattr(config, key))
    return 0


def layout_problems(key: str, mtp: Any, hf_config: Any, megatron: Any) -> list[str]:
    """Start-up errors for ``{key}.mtp`` on the Megatron engine (``megatron``: the actor's layout)."""
    if not mtp.enable:
        return []
    errors = []
    if hf_mtp_layers(hf_config) == 0:
        errors.append(f"{key}.mtp.enable=true: the model has no MTP layers (its config has no "
                      "num_nextn_predict_layers); use a model with MTP layers or set it false (verl refuses so too).")
    elif hf_config.model_type not in MTP_FAMILIES:
        errors.append(f"{key}.mtp.enable=true: MTP layers are built for {list(MTP_FAMILIES)} models here, not "
                      f"model_type {hf_config.model_type!r} (mbridge builds its MTP block with TransformerEngine "
                      "layers only).")
    return errors


def without_mtp(hf_config: Any) -> Any:
    """``hf_config`` saying it has no MTP layers (what an engine built without them writes back)."""
    for config in (hf_config, getattr(hf_config, "text_config", None)):
        for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers"):
            if config is not None and getattr(config, key, None):
                setattr(config, key, 0)
    return hf_config


def is_mtp_weight(name: str) -> bool:
    """An HF tensor of the MTP layers (MiMo's names)."""
    return name.startswith(_HF_MTP_PREFIX)


def mtp_bridge(cls: type, use_te: bool) -> type:
    """``cls`` (an mbridge bridge, maybe the local-spec one) building its MTP block on the decoder's own
    layer spec (mbridge 0.15's MiMo passes the config where megatron-core 0.16 wants the spec), and
    naming the block's transformer layer as the decoder's layers are named (the local spec's norms too)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    class MtpBridge(cls):
        def _get_transformer_layer_spec(self, vp_stage: int | None = None):
            spec = super()._get_transformer_layer_spec(vp_stage)
            self._mtp_decoder_spec, self._mtp_vp_stage = spec, vp_stage  # the provider asks for it first
            return spec

        def _get_gptmodel_args(self) -> dict:
            count, self.config.mtp_num_layers = self.config.mtp_num_layers, None
            try:  # the family's arguments without its own MTP spec
                args = super()._get_gptmodel_args()
            finally:
                self.config.mtp_num_layers = count
            spec = get_gpt_mtp_block_spec(self.config, self._mtp_decoder_spec, use_transformer_engine=use_te,
                                          vp_stage=self._mtp_vp_stage)
            if spec is not None and not use_te and self.config.sequence_parallel:  # the block's own three norms too
                from rlfoundry.engines.megatron import sequence_parallel

                spec = sequence_parallel.use_in_spec(spec)
            args["mtp_block_spec"] = spec
            return args

        def _convert_mtp_param(self, name: str) -> list[str]:
            parts = name.split(".")  # mtp.layers.{i}.transformer_layer.*
            if len(parts) > 4 and parts[3] == "transformer_layer":
                i = parts[2]
                proxy = name.replace(f"mtp.layers.{i}.transformer_layer.", f"decoder.layers.{i}.")
                return [n.replace(f"model.layers.{i}.", f"{_HF_MTP_PREFIX}{i}.")
                        for n in self._weight_name_mapping_mcore_to_hf(proxy)]
            return super()._convert_mtp_param(name)

    MtpBridge.__name__ = MtpBridge.__qualname__ = f"Mtp{cls.__name__}"
    return MtpBridge


def full_row_mask(micro: dict[str, torch.Tensor], mask_key: str) -> torch.Tensor:
    """(B, S): the response mask on the response columns of the prompt+response row, 0 on the prompt."""
    ids, mask = micro["input_ids"], micro[mask_key]
    return torch.cat([torch.zeros(ids.shape[0], ids.shape[1] - mask.shape[1], dtype=mask.dtype, device=mask.device),
                      mask], dim=1)


def targets(micro: dict[str, torch.Tensor], mask_key: str, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Block ``depth``'s (1-based) targets and counted positions, (B, S) each: position t predicts token
    t + depth + 1, counted where that is a response token and t a real one."""
    ids, attention = micro["input_ids"], micro["attention_mask"]
    shift = depth + 1
    labels = torch.nn.functional.pad(ids[:, shift:], (0, shift))
    counted = torch.nn.functional.pad(full_row_mask(micro, mask_key)[:, shift:], (0, shift)) * attention
    return labels, counted.to(torch.float32)


class MtpTraining:
    """The MTP loss of one engine: installed on the last stage's GPTModel (its ``_postprocess``), fed each
    training micro-batch by :meth:`micro_batch`, read by the engine's loss with :meth:`take`."""

    def __init__(self, chunks: list[nn.Module], scaling_factor: float, detach_encoder: bool):
        self.model = next(c for c in chunks if getattr(c, "mtp_process", False))
        self.layers = int(self.model.config.mtp_num_layers)
        self.scaling_factor, self.detach_encoder = float(scaling_factor), bool(detach_encoder)
        self._micro: dict[str, torch.Tensor] | None = None
        self._pending: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._dp_size = 1
        self._sums = torch.zeros(self.layers, dtype=torch.float64)
        self.model._postprocess = _postprocess.__get__(self.model, type(self.model))
        self.model._rlfoundry_mtp = self
        if detach_encoder:
            for layer in self.model.mtp.layers:
                layer._get_embeddings = _detached_embeddings.__get__(layer, type(layer))

    def begin(self, mini: dict[str, torch.Tensor], mask_key: str, dp_size: int, dp_group: Any) -> None:
        """A mini-batch starts: its MTP-counted tokens per block over every data-parallel rank."""
        from rlfoundry.engines.loop import collective_device

        self.mask_key, self._dp_size = mask_key, dp_size
        counts = torch.stack([targets(mini, mask_key, k)[1].sum() for k in range(1, self.layers + 1)]).double()
        if dp_size > 1:
            counts = counts.to(collective_device(dp_group))
            dist.all_reduce(counts, group=dp_group)
        self._counts = counts.cpu()
        self._sums = torch.zeros(self.layers, dtype=torch.float64)

    @contextlib.contextmanager
    def micro_batch(self, micro: dict[str, torch.Tensor]) -> Iterator[None]:
        self._micro = micro
        try:
            yield
        finally:
            self._micro = None

    def take(self) -> torch.Tensor | None:
        """The loss the last micro-batch's forward left (already scaled), once."""
        pending, self._pending = self._pending, None
        return pending

    def metrics(self, dp_group: Any) -> dict[str, float]:
        """CE_k of the mini-batch (token mean over every data-parallel rank), verl's names."""
        from rlfoundry.engines.loop import collective_device

        sums = self._sums
        if self._dp_size > 1:
            sums = sums.to(collective_device(dp_group))
            dist.all_reduce(sums, group=dp_group)
        mean = sums.cpu() / self._counts.clamp(min=1)
        return {f"mtp_losses/mtp_{k + 1}_loss": float(mean[k]) for k in range(self.layers)}

    def loss(self, model: nn.Module, chunks: tuple[torch.Tensor, ...], runtime_gather_output: Any) -> torch.Tensor:
        """Σ_k factor/D · dp · (Σ counted CE_k on this micro-batch) / (the mini-batch's counted tokens for k):
        summed over micro-batches and averaged over the data-parallel ranks by DDP, factor/D · Σ_k CE_k."""
        from rlfoundry.engines.megatron import context_parallel as cpl
        from rlfoundry.engines.megatron.forward import context_parallel_size, vocab_parallel_log_probs

        micro = self._micro
        width = micro["input_ids"].shape[1]
        cp = context_parallel_size()
        layer = model.output_layer
        # verl: the output layer takes no gradient from the MTP loss (its weights enter detached)
        weight = (model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights
                  else layer.weight).detach()
        total = None
        for k in range(self.layers):
            logits, _ = layer(chunks[k + 1], weight=weight, runtime_gather_output=runtime_gather_output)
            logits = logits.transpose(0, 1)  # [s b v] -> [b s v]
            labels, counted = targets(micro, self.mask_key, k + 1)
            if cp > 1:  # this rank's two chunks of the (padded) row; the log-probs gathered into whole rows, the
                # same on every CP rank, as the policy's (context_parallel.py)
                labels = cpl.split(torch.nn.functional.pad(labels, (0, logits.shape[1] * cp - width)))
                log_probs = cpl.gather(vocab_parallel_log_probs(logits, labels)[0])[:, :width]
            else:  # the positions padded for sequence parallelism dropped
                log_probs, _, _ = vocab_parallel_log_probs(logits[:, :width], labels)
            local = -torch.where(counted > 0, log_probs, 0.0).sum()  # uncounted positions may hold anything
            self._sums[k] += local.detach().double().cpu()
            term = local * (self.scaling_factor / self.layers * self._dp_size / float(self._counts[k].clamp(min=1)))
            total = term if total is None else total + term
        return total


def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin,
                 mtp_in_postprocess=None, loss_mask=None, decoder_input=None, attention_mask=None, inference_params=None,
                 packed_seq_params=None, sequence_len_offset=None, runtime_gather_output=None, extra_block_kwargs=None,
                 inference_context=None, **_):
    """GPTModel's ``_postprocess`` for the engine's calls (no labels, no inference context): the logits, and
    on a training micro-batch the MTP block's loss left for the engine's loss (megatron-core 0.16's own
    runs the block on every call and wants labels)."""
    mtp: MtpTraining = self._rlfoundry_mtp
    if mtp._micro is not None and mtp_in_postprocess and self.training:
        stacked = self.mtp(input_ids=input_ids, position_ids=position_ids, hidden_states=hidden_states,
                           attention_mask=attention_mask, inference_params=inference_params, rotary_pos_emb=rotary_pos_emb,
                           rotary_pos_cos=rotary_pos_cos, rotary_pos_sin=rotary_pos_sin,
                           packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                           embedding=self.embedding, **(extra_block_kwargs or {}))
        chunks = torch.chunk(stacked, 1 + mtp.layers, dim=0)
        hidden_states = chunks[0]
        mtp._pending = mtp.loss(self, chunks, runtime_gather_output)
    weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
    logits, _ = self.output_layer(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
    return logits.transpose(0, 1).contiguous()


def _detached_embeddings(self, input_ids, position_ids, embedding, hidden_states, packed_seq_params=None, **_):
    """``MultiTokenPredictionLayer._get_embeddings`` with ``detach_encoder``: the next tokens' embeddings and
    the decoder's hidden states enter the block detached (verl's patch), so the MTP loss trains the block only."""
    from megatron.core.transformer.multi_token_prediction import roll_tensor

    input_ids, _ = roll_tensor(input_ids, shifts=-1, dims=-1, cp_group=self.cp_group, packed_seq_params=packed_seq_params)
    position_ids, _ = roll_tensor(position_ids, shifts=-1, dims=-1, cp_group=self.cp_group,
                                  packed_seq_params=packed_seq_params)
    decoder_input = embedding(input_ids=input_ids, position_ids=position_ids).detach()
    return input_ids, position_ids, decoder_input, hidden_states.detach()
