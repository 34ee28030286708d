"""Prompt/response pairs for supervised fine-tuning (``rlfoundry sft``), laid out as verl's RL batch.

Pairs come from parquet / jsonl / json files (``data.prompt_key`` / ``data.response_key``, with
verl's ``prompt_dict_keys`` / ``response_dict_keys`` for nested columns; a prompt is a string or a
list of chat messages, so verl's RL parquet serves SFT too) or from the built-in arithmetic task.
The prompt goes through the tokenizer's chat template (with the generation prompt); the response
gets EOS appended; ``loss_mask`` is 1 on the response tokens. ``collate_sft`` makes the rows the
engine's causal-LM layout: left-padded prompt | right-padded response, with ``response_mask``.

Conversation rows (verl's multi-turn SFT: ``data.multiturn.enable=true`` or its newer trainer's
``data.messages_key``): a row is a list of chat messages (optionally with tools, ``tools_key``), and
every assistant turn is trained: ``loss_mask`` is 1 on the tokens the chat template writes for each
assistant message (its end-of-turn marker included), 0 on system, user and tool turns. Such a
"pair" carries ``None`` as its response.

Image rows (verl's multimodal layout, ``data.image_key``, ``<image>`` markers; docs/vision.md): the
images are decoded when the file is read (a row whose image does not load is reported and skipped,
as ``RLHFDataset`` does) and ride in the prompt's ``{"type": "image"}`` content parts. With a
vision-language model's processor every row is encoded by it: the processor's chat template and image
tokens, the pixel inputs (``multi_modal_inputs``) and the model's own 3-D rotary positions over prompt
+ response, so text rows and image rows share one batch layout.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from rlfoundry.data import multimodal as mm
from rlfoundry.data.rl_dataset import position_ids_from_mask

__all__ = ["Pair", "SFTDataError", "SFTDataset", "VisionEncoder", "collate_sft", "conversation_keys", "encode_conversation",
           "encode_pair", "images_of", "load_pairs", "synthetic_pairs", "with_images"]

logger = logging.getLogger(__name__)

# (chat messages of the prompt, response text); an image row's messages hold its images in their
# {"type": "image", "image": PIL image} content parts. A conversation row: (its messages, None), led by
# {"role": TEMPLATE_ARGS, ...} holding the chat template's arguments for the row (tools, enable_thinking)
TEMPLATE_ARGS = "_template_args"
Pair = tuple[list[dict], str | None]


class SFTDataError(ValueError):
    """A data file or row the SFT trainer cannot use; the message names the file/row and the fix."""


def _read_rows(path: Path) -> list[dict]:
    """Rows of a parquet, jsonl or json (list of objects) file."""
    from rlfoundry.data.preprocess.common import read_records

    if not path.is_file():
        raise SFTDataError(f"data file {str(path)!r} does not exist; check data.train_files / data.val_files")
    return read_records(path, error=SFTDataError)


def _field(row: Mapping, key: str, dict_keys: Sequence[str] | None, where: str, config_key: str) -> Any:
    """``row[key]``, then down through ``dict_keys`` (verl's prompt_dict_keys for nested columns)."""
    if key not in row:
        raise SFTDataError(f"{where}: no column {key!r} (columns: {sorted(row)}); set {config_key}")
    value = row[key]
    for sub in dict_keys or ():
        if not isinstance(value, Mapping) or sub not in value:
            raise SFTDataError(f"{where}: column {key!r} has no field {sub!r} (set {config_key.replace('key', 'dict_keys')})")
        value = value[sub]
    return value


def _as_messages(prompt: Any, where: str) -> list[dict]:
    """A plain string is one user turn; a list of ``{"role", "content"}`` is used as it is (verl's
    RL parquet stores prompts that way, so the same files serve SFT and RL)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, (list, tuple)) and all(isinstance(m, Mapping) and "content" in m for m in prompt):
        return [dict(m) for m in prompt]
    raise SFTDataError(f"{where}: the prompt must be a string or a list of chat messages, got {type(prompt).__name__}")


def conversation_keys(data_cfg: Any) -> tuple[str, str, str] | None:
    """The (messages, tools, enable_thinking) columns when rows are conversations (verl's ``data.multiturn.enable`` or its
    newer ``data.messages_key``), else None (prompt/response pairs)."""
    multiturn = data_cfg.get("multiturn") or {}
    thinking = multiturn.get("enable_thinking_key", "enable_thinking")
    if data_cfg.get("messages_key"):
        return data_cfg.messages_key, data_cfg.get("tools_key") or multiturn.get("tools_key") or "tools", thinking
    if multiturn.get("enable"):
        return multiturn.get("messages_key", "messages"), multiturn.get("tools_key", "tools"), thinking
    return None


def _conversation(row: Mapping, keys: tuple[str, str, str], where: str) -> Pair:
    """A conversation row as (messages, None), led by the template's arguments: its tools (a list or a
    JSON string) and its ``enable_thinking`` flag (verl's per-row column), where it has them."""
    messages_key, tools_key, thinking_key = keys
    messages = row.get(messages_key)
    if messages_key not in row:
        raise SFTDataError(f"{where}: no column {messages_key!r} (columns: {sorted(row)}); set data.messages_key")
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, Mapping) and "role" in m for m in messages):
        raise SFTDataError(f"{where}: column {messages_key!r} must be a list of chat messages with roles")
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: the conversation has no assistant turn, so nothing to train on")
    tools = row.get(tools_key)
    tools = json.loads(tools) if isinstance(tools, str) else tools
    args = {"tools": list(tools) if tools else None}
    if row.get(thinking_key) is not None:
        args["enable_thinking"] = bool(row[thinking_key])
    return [{"role": TEMPLATE_ARGS, **args}] + [{k: v for k, v in m.items() if v is not None} for m in messages], None


def load_pairs(files: str | Sequence[str], data_cfg: Any) -> list[Pair]:
    """(messages, response) pairs from the files named by ``data.train_files`` / ``data.val_files``;
    a row with images in ``data.image_key`` gets them in its messages (``with_images``); conversation
    rows (``conversation_keys``) come as (messages, None)."""
    pairs: list[Pair] = []
    conversations = conversation_keys(data_cfg)
    for file in [files] if isinstance(files, str) else list(files):
        path = Path(os.path.expanduser(str(file)))
        for i, row in enumerate(_read_rows(path)):
            where = f"{path}, row {i}"
            if conversations is not None:
                pairs.append(_conversation(row, conversations, where))
                continue
            prompt = _field(row, data_cfg.prompt_key, data_cfg.prompt_dict_keys, where, "data.prompt_key")
            response = _field(row, data_cfg.response_key, data_cfg.response_dict_keys, where, "data.response_key")
            try:
                messages = with_images(_as_messages(prompt, where), row.get(data_cfg.image_key), path.parent, where)
            except mm.ImageDecodeError as err:  # one bad image costs its row, never the run
                logger.warning("%s: skipped, its image does not load (%s)", where, err)
                continue
            pairs.append((messages, str(response)))
    if not pairs:
        raise SFTDataError(f"no rows in {files}")
    return pairs


def with_images(messages: list[dict], images: Any, base_dir: Path, where: str) -> list[dict]:
    """``messages`` with the row's decoded images in ``{"type": "image", "image": ...}`` parts where its
    ``<image>`` markers are (``data/multimodal.py``'s rule); unchanged for a row without images."""
    decoded = mm.row_images(images, base_dir)
    if not decoded:
        return messages
    try:
        parts = mm.vision_messages(messages, len(decoded))
    except ValueError as err:
        raise SFTDataError(f"{where}: {err}") from None
    found = iter(decoded)
    return [{**m, "content": [{**c, "image": next(found)} if c["type"] == "image" else c for c in m["content"]]}
            for m in parts]


def images_of(messages: list[dict]) -> list:
    """The images in a pair's message parts, in order (``with_images``)."""
    return [c["image"] for m in messages if isinstance(m.get("content"), list) for c in m["content"]
            if c["type"] == "image"]


def synthetic_pairs(syn: Any) -> tuple[list[Pair], list[Pair]]:
    """(train, val) pairs of the built-in arithmetic task; validation is drawn first and excluded
    from training, so with the RL demo's seed and size it is exactly the RL validation set."""
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits

    spec = ArithmeticSpec(digits=syn.digits, ops=syn.ops, num_operands=syn.num_operands)
    splits = generate_splits(syn.train_size, syn.val_size, seed=syn.seed, spec=spec)
    return tuple([([{"role": "user", "content": p}], a) for p, a in splits[s]] for s in ("train", "test"))


def _truncate(ids: list[int], mask: list[int], max_length: int, truncation: str, where: str) -> tuple[list[int], list[int]]:
    if len(ids) <= max_length:
        return ids, mask
    if truncation == "left":  # keeps the response (and its EOS) whole; loses the start of the prompt
        return ids[-max_length:], mask[-max_length:]
    if truncation == "right":
        return ids[:max_length], mask[:max_length]
    raise SFTDataError(f"{where}: {len(ids)} tokens (prompt + response + EOS) > data.max_length={max_length}; "
                       "raise data.max_length or set data.truncation=left|right")


def encode_pair(tokenizer: Any, messages: list[dict], response: str, max_length: int,
                truncation: str = "error", where: str = "example") -> dict[str, torch.Tensor]:
    """Token ids of chat-templated prompt + response + EOS, and ``loss_mask`` (1 on every response
    token, EOS included: those are the tokens the model must learn to produce; 0 on the prompt)."""
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids, mask = _truncate(prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids),
                          max_length, truncation, where)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


def encode_conversation(tokenizer: Any, messages: list[dict], max_length: int, truncation: str = "error",
                        where: str = "example", ignore_mismatch: bool = False) -> dict[str, torch.Tensor]:
    """Token ids of a chat-templated conversation and ``loss_mask``: 1 on what the template writes for
    each assistant message, 0 elsewhere. An assistant turn's text is the template of the messages up
    to it minus the template of those before it with the generation prompt; a template for which that
    is not a prefix (it rewrites earlier turns, e.g. drops past reasoning) is an error naming the row.
    The turns are tokenised piece by piece; where that differs from tokenising the whole text (a token
    across a turn boundary) it is an error, as in verl, unless ``ignore_mismatch``
    (``data.ignore_input_ids_mismatch``), which keeps the pieces' tokens."""
    lead = messages[0] if messages and messages[0]["role"] == TEMPLATE_ARGS else {"role": TEMPLATE_ARGS}
    args = {k: v for k, v in lead.items() if k != "role" and v is not None}
    turns = messages[1:] if messages and messages[0] is lead else messages

    def render(upto: list[dict], generation_prompt: bool = False) -> str:
        return tokenizer.apply_chat_template(upto, add_generation_prompt=generation_prompt, tokenize=False,
                                             **args) if upto else ""

    ids, mask, done = [], [], ""
    for i, message in enumerate(turns):
        if message["role"] != "assistant":
            continue
        before, upto = render(turns[:i], generation_prompt=True), render(turns[: i + 1])
        if not before.startswith(done) or not upto.startswith(before):
            raise SFTDataError(f"{where}: the chat template rewrites earlier turns when assistant turn {i} is added, "
                               "so its tokens cannot be told apart; use a template that appends (data.chat_template)")
        for text, trained in ((before[len(done):], 0), (upto[len(before):], 1)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"] if text else []
            ids, mask, done = ids + piece, mask + [trained] * len(piece), upto
    if not ignore_mismatch and tokenizer(done, add_special_tokens=False)["input_ids"] != ids:
        raise SFTDataError(f"{where}: the conversation's turns tokenised one by one differ from the whole text "
                           "tokenised at once (a token spans a turn boundary); set data.ignore_input_ids_mismatch=true "
                           "to train on the turn-by-turn tokens, as verl does with it")
    ids, mask = _truncate(ids, mask, max_length, truncation, where)
    return {"input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


class VisionEncoder:
    """Pairs encoded by a vision-language model's processor: its chat template and image tokens, the
    pixel inputs, and the model's own 3-D rotary positions (``get_rope_index``) over prompt + response."""

    def __init__(self, processor: Any):
        from rlfoundry.data.rl_dataset import mm_rope_index

        self.processor, self.tokenizer = processor, processor.tokenizer
        self.rope_index = mm_rope_index(processor)

    def __call__(self, messages: list[dict], response: str, max_length: int, where: str) -> dict[str, Any]:
        images = images_of(messages)
        bare = [{**m, "content": [{k: v for k, v in c.items() if k != "image"} for c in m["content"]]}
                if isinstance(m["content"], list) else m for m in messages]
        text = self.processor.apply_chat_template(bare, add_generation_prompt=True, tokenize=False)
        prompt = mm.process_prompt(self.processor, text, images)
        response_ids = torch.tensor(self.tokenizer(response, add_special_tokens=False)["input_ids"]
                                    + [self.tokenizer.eos_token_id], dtype=torch.long)
        ids = torch.cat([prompt["input_ids"], response_ids])
        if len(ids) > max_length:  # never cut: a cut would part image tokens from their pixels
            raise SFTDataError(f"{where}: {len(ids)} tokens (prompt with its image tokens + response + EOS) > "
                               f"data.max_length={max_length}; raise data.max_length (image rows are not truncated)")
        types = torch.cat([prompt["mm_token_type_ids"], response_ids.new_zeros(len(response_ids))])
        grid = prompt.get("image_grid_thw")
        positions = self.rope_index(ids[None], torch.ones_like(ids)[None], types[None], grid)[:, 0]
        loss_mask = torch.cat([torch.zeros_like(prompt["input_ids"]), torch.ones_like(response_ids)])
        inputs = {k: prompt[k] for k in ("pixel_values", "image_grid_thw") if k in prompt}
        return {"input_ids": ids, "loss_mask": loss_mask, "position_ids": positions, "multi_modal_inputs": inputs}


class SFTDataset(Dataset):
    """Pairs tokenised once up front (SFT sets for this trainer are small; it keeps epochs cheap).
    With ``processor`` (a vision-language model's) every pair goes through ``VisionEncoder``."""

    def __init__(self, pairs: Sequence[Pair], tokenizer: Any, max_length: int, truncation: str = "error",
                 processor: Any = None, ignore_mismatch: bool = False) -> None:
        if processor is None and any(images_of(m) for m, _ in pairs):
            raise SFTDataError("the data has image rows (data.image_key) but the model has no processor (a text-only "
                               "model): use a vision-language model such as Qwen2-VL, or drop the images")
        if processor is not None and any(r is None for _, r in pairs):
            raise SFTDataError("conversation rows (data.messages_key / data.multiturn) on a vision-language model are "
                               "not built; give prompt/response pairs, or a text model")
        if processor is not None:
            encode = VisionEncoder(processor)
            self.examples = [encode(m, r, max_length, f"example {i}") for i, (m, r) in enumerate(pairs)]
            return
        self.examples = [encode_pair(tokenizer, m, r, max_length, truncation, where=f"example {i}") if r is not None
                         else encode_conversation(tokenizer, m, max_length, truncation, f"example {i}", ignore_mismatch)
                         for i, (m, r) in enumerate(pairs)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


def _response_start(loss_mask: torch.Tensor) -> int:
    """Where the targets begin: the first loss-mask token, but never token 0 (nothing predicts it)."""
    targets = loss_mask.nonzero()
    return max(1, int(targets[0]) if len(targets) else len(loss_mask))


def collate_sft(examples: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """verl's RL batch layout: ``input_ids``/``attention_mask``/``position_ids`` (B, Tp+Tr) =
    left-padded prompt | right-padded response, ``responses`` (B, Tr), and ``response_mask`` (B, Tr)
    = the loss mask over the response (padding is never a target). Rows a processor encoded add
    ``multi_modal_inputs`` (B,) and have (B, 3, Tp+Tr) positions (0 on the padding)."""
    starts = [_response_start(e["loss_mask"]) for e in examples]
    tp = max(starts)
    tr = max([1] + [len(e["input_ids"]) - s for e, s in zip(examples, starts)])
    ids = torch.full((len(examples), tp + tr), pad_token_id, dtype=torch.long)
    attention, loss = torch.zeros_like(ids), torch.zeros_like(ids)
    vision = "multi_modal_inputs" in examples[0]
    positions = torch.zeros(len(examples), 3, tp + tr, dtype=torch.long) if vision else None  # (B, 3, T)
    for i, (e, s) in enumerate(zip(examples, starts)):
        n = len(e["input_ids"])
        cols = slice(tp - s, tp - s + n)  # the prompt ends at column tp, the response starts there
        ids[i, cols], attention[i, cols], loss[i, cols] = e["input_ids"], 1, e["loss_mask"]
        if vision:
            positions[i, :, cols] = e["position_ids"]
    out = {"input_ids": ids, "attention_mask": attention,
           "position_ids": positions if vision else position_ids_from_mask(attention),
           "responses": ids[:, tp:], "response_mask": loss[:, tp:]}
    if vision:  # one dict per row, a non-tensor column (verl's name)
        out["multi_modal_inputs"] = np.array([e["multi_modal_inputs"] for e in examples] + [None], dtype=object)[:-1]
    return out
