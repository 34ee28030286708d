"""The reward-model role: a Hugging Face sequence classifier scores each (prompt, response).

Config: the ``reward_model`` subtree, verl's keys (defaults: ``RewardModelConfig`` in ``config/schema.py``):

| key | meaning |
|---|---|
| ``enable`` | the trainer creates this worker only when True |
| ``model.path`` | local HF directory of an ``AutoModelForSequenceClassification`` (``num_labels=1``) |
| ``model.input_tokenizer`` | the *policy's* tokenizer path; when its vocabulary or chat template differs from the RM's, responses are decoded and re-tokenised (below) |
| ``model.trust_remote_code`` | passed to ``from_pretrained`` |
| ``model.fsdp_config.model_dtype`` | weights dtype (bf16 on GPUs) |
| ``model.cpu_kernels`` | CPU speed-ups (``auto``: on the CPU only; ``off``: the plain path), ``rlfoundry/cpu`` |
| ``micro_batch_size_per_gpu`` | rows per forward pass |
| ``max_length`` | token budget of a re-tokenised sequence (null: the batch width); longer ones lose their *start* (the score is read at the end) |

Which token is scored. The RM's score is the classification head's output at the *last real token*
of each sequence (the end of the response, usually EOS), found from the attention mask. For
decoder classifiers (Llama, Qwen2, Mistral, ... whose head is ``model.score``) the head is read per
token through a forward hook, so pad-id conventions (pad == eos, left padding) cannot shift it;
other models' own pooled logits are used.

Re-tokenisation. When ``model.input_tokenizer`` is set and tokenises differently from the RM, each
row's chat (``raw_prompt``, needs ``data.return_raw_chat=True``) plus the decoded response as an
assistant message is rendered with the RM's chat template (plain newline-joined contents if it has
none), tokenised with the RM tokenizer and right-padded. Otherwise the policy's ``input_ids`` are
scored as they are.

Output: ``rm_scores`` (B, Tr), the score on the last valid response token and 0 elsewhere, the same
layout as ``token_level_scores``. How it combines with rule rewards is the reward manager's
``rm_combine`` option: ``replace`` (verl's default: rule scorer not called) or ``add``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch
from torch import nn

from rlfoundry.config.schema import RewardModelConfig
from rlfoundry.config.typed import to_typed
from rlfoundry.protocol import DataProto
from rlfoundry.rewards.reward_manager import place_scores, response_lengths
from rlfoundry.single_controller.base import Dispatch, Worker, register
from rlfoundry.single_controller.base.worker import WorkerRuntime
from rlfoundry.engines.base import MicroBatching
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.hf import check_model_dir
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.workers.utils.device import on_device

logger = logging.getLogger(__name__)


def _same_tokenization(a: Any, b: Any) -> bool:
    return a.get_vocab() == b.get_vocab() and getattr(a, "chat_template", None) == getattr(b, "chat_template", None)


def _position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    return torch.clamp(attention_mask.long().cumsum(-1) - 1, min=0)


def _last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the last 1 in each row (works for left, right and both-sided padding)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device)
    return (positions * attention_mask.long()).argmax(-1)


class RewardModelWorker(Worker):
    """Loads the RM on ``init_model``; ``compute_rm_score`` returns ``rm_scores`` per row."""

    def __init__(self, config: Any, runtime: WorkerRuntime | None = None) -> None:
        super().__init__(runtime)
        self.config = to_typed(RewardModelConfig, config, name="reward_model")
        self.model: nn.Module | None = None
        self.engine: FSDPEngine | None = None
        self.tokenizer: Any = None
        self.input_tokenizer: Any = None
        self.retokenize = False

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self) -> None:
        from transformers import AutoConfig, AutoTokenizer

        self.init_distributed()
        model = self.config.model
        path = check_model_dir(model.path)
        remote = model.trust_remote_code
        labels = AutoConfig.from_pretrained(path, trust_remote_code=remote).num_labels
        if labels != 1:  # checked before any weights load
            raise ValueError(f"reward model {path} has num_labels={labels}; a reward model needs 1")
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=remote)
        engine_config = FSDPEngineConfig.for_model(model, model.fsdp_config, path=str(path),
                                                   model_kind="sequence_classification")
        self.engine = FSDPEngine.build(engine_config, self.device, role="reward_model")
        self.model = self.engine.module
        source = model.input_tokenizer
        if source:
            self.input_tokenizer = AutoTokenizer.from_pretrained(str(source), trust_remote_code=remote)
            self.retokenize = not _same_tokenization(self.input_tokenizer, self.tokenizer)
        logger.info("reward model %s loaded (re-tokenise responses: %s)", path, self.retokenize)

    @register(dispatch_mode=Dispatch.DP_COMPUTE_PROTO)
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """``rm_scores`` (B, Tr): the RM score of each full sequence on its last response token."""
        if self.model is None:
            raise RuntimeError("RewardModelWorker.compute_rm_score called before init_model")
        input_ids, attention_mask = self._model_inputs(data)
        scores = self._score(input_ids, attention_mask)
        width = data.batch["responses"].shape[-1]
        rm_scores = place_scores(scores.tolist(), response_lengths(data), width)
        return DataProto.from_dict(tensors={"rm_scores": rm_scores})

    # ---- inputs ------------------------------------------------------------------------------

    def _model_inputs(self, data: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.retokenize:
            return data.batch["input_ids"], data.batch["attention_mask"]
        if "raw_prompt" not in data.non_tensor_batch:
            raise KeyError(
                "the reward model tokenises differently from the policy, so it needs each prompt's chat "
                "messages: set data.return_raw_chat=True (or reward_model.model.input_tokenizer=null if "
                "the two tokenizers are in fact the same)"
            )
        texts = [self._rm_text(data, i) for i in range(len(data))]
        max_length = self.config.max_length or data.batch["input_ids"].shape[-1]
        return self._tokenize(texts, max_length)

    def _rm_text(self, data: DataProto, i: int) -> str:
        """Row i as the RM expects it: its chat plus the decoded response, in the RM's chat template."""
        n_valid = int(response_lengths(data)[i])
        response = self.input_tokenizer.decode(data.batch["responses"][i, :n_valid].tolist(), skip_special_tokens=True)
        chat = [dict(m) for m in data.non_tensor_batch["raw_prompt"][i]] + [{"role": "assistant", "content": response}]
        if getattr(self.tokenizer, "chat_template", None):
            return self.tokenizer.apply_chat_template(chat, tokenize=False)
        return "\n".join(m["content"] for m in chat)

    def _tokenize(self, texts: list[str], max_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ids and mask; an over-long text keeps its last ``max_length`` tokens."""
        ids = [row[-max_length:] for row in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]
        width = max(len(row) for row in ids)
        input_ids = torch.full((len(ids), width), pad_id(self.tokenizer), dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row, dtype=torch.long), 1
        return input_ids, mask

    # ---- scoring -----------------------------------------------------------------------------

    def _score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        micro = self.config.micro_batch_size_per_gpu or 1
        data = DataProto.from_dict(tensors={"input_ids": input_ids, "attention_mask": attention_mask})
        data = on_device(data, self.device)
        out = self.engine.infer_batch(data, _last_token_scores, MicroBatching(size=micro))
        return out["scores"].float().cpu()


def _last_token_scores(model: nn.Module, micro: Any) -> dict[str, torch.Tensor]:
    """(b,) scores of one micro-batch, read at each row's last real token."""
    input_ids, attention_mask = micro["input_ids"], micro["attention_mask"]
    kwargs = {"input_ids": input_ids, "attention_mask": attention_mask}
    accepted = inspect.signature(model.forward).parameters  # encoder classifiers lack some
    if "position_ids" in accepted:
        kwargs["position_ids"] = _position_ids(attention_mask)
    if "use_cache" in accepted:
        kwargs["use_cache"] = False
    head = getattr(model, "score", None)
    if not isinstance(head, nn.Module):
        return {"scores": model(**kwargs).logits[:, 0]}
    captured: list[torch.Tensor] = []
    handle = head.register_forward_hook(lambda _m, _i, out: captured.append(out))
    try:
        model(**kwargs)
    finally:
        handle.remove()
    per_token = captured[0][..., 0]  # (b, T): the head applied to every position
    return {"scores": per_token[torch.arange(len(per_token)), _last_token_index(attention_mask)]}
