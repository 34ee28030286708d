"""Prompt data sets in verl's parquet format, and the resumable loader that feeds the trainer.

One row per prompt (the format verl's own preprocessing scripts write, so their files load as is):

| column | type | example |
|---|---|---|
| ``data_source`` | str | ``"openai/gsm8k"`` (picks the reward function; ``data.reward_fn_key``) |
| ``prompt`` | list of ``{"role", "content"}`` | ``[{"role": "user", "content": "..."}]`` (``data.prompt_key``) |
| ``ability`` | str | ``"math"`` |
| ``reward_model`` | ``{"style": "rule"|"model", "ground_truth": str}`` | |
| ``extra_info`` | dict | ``{"split": "train", "index": 0, ...}`` |

Any other column is passed through as a non-tensor column.

Config: the ``data`` subtree, typed (``config/schema.py`` ``DataConfig`` holds the defaults; a dict
with a few keys is filled from it). Keys read (verl's names): ``prompt_key``, ``max_prompt_length``,
``truncation`` (``error`` | ``left`` | ``right`` | ``middle``), ``filter_overlong_prompts``,
``return_raw_chat``, ``return_full_prompt``, ``reward_fn_key``, ``shuffle``, ``seed``,
``custom_cls.{path,name}`` (a user's data set class instead of ``RLHFDataset``) and
``sampler.{class_path,class_name}`` (a user's sampler, ``data/sampler.py``), plus two of ours:

- ``apply_chat_template``: render each prompt with the tokenizer's chat template (with the
  generation prompt). False joins the message contents with newlines instead, for tokenizers and
  base models that have no chat template.
- ``apply_chat_template_kwargs``: extra keyword arguments for ``apply_chat_template``.

With a ``processor`` (a vision-language model's), rows may carry images (``data.image_key``,
verl's layout, ``data/multimodal.py``): the processor renders and expands them, each item gains
``multi_modal_data`` (the images, for the rollout) and ``multi_modal_inputs`` (pixel inputs, for
the trainer), and ``position_ids`` are the model's 3-D rotary positions (3, max_prompt_length).

The whole file is tokenised once, up front, with the fast tokenizer's batch call: filtering and the
``truncation=error`` check then happen at start-up, not hours into a run.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch.utils.data import Dataset, Sampler, SequentialSampler
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler

from rlfoundry.config import ConfigError, to_typed
from rlfoundry.config.schema import DataConfig
from rlfoundry.data import multimodal as mm
from rlfoundry.utils.import_utils import ExternObjectError, load_extern_object
from rlfoundry.utils.tokenizer import pad_id

logger = logging.getLogger(__name__)


class DataError(ValueError):
    """A prompt data file or its configuration is unusable; the message says where and how to fix it."""


def typed_data_config(config: Any) -> DataConfig:
    """The typed ``data`` subtree (a DataConfig as is; a DictConfig, a dict with some keys or None
    filled with the schema's defaults); a bad key or value is a ``DataError`` naming it."""
    try:
        cfg = config if isinstance(config, DataConfig) else to_typed(DataConfig, config, name="data")
    except ConfigError as e:
        raise DataError(str(e)) from e
    if cfg.max_prompt_length <= 0:
        raise DataError(f"data.max_prompt_length must be positive, got {cfg.max_prompt_length}")
    return cfg


# ---- reading and checking files --------------------------------------------------------------


def _expand_files(data_files: str | Path | Sequence[str | Path]) -> list[Path]:
    """A path, a list of paths (ListConfig too), or a directory of ``*.parquet`` -> file paths."""
    items = [data_files] if isinstance(data_files, (str, Path)) else list(data_files)
    if not items:
        raise DataError("no data files given (data.train_files / data.val_files is empty)")
    paths: list[Path] = []
    for item in items:
        path = Path(str(item)).expanduser()
        if path.is_dir():
            found = sorted(path.glob("*.parquet"))
            if not found:
                raise DataError(f"directory {path} holds no *.parquet files")
            paths.extend(found)
        elif not path.exists():
            raise DataError(
                f"data file {path} does not exist; check data.train_files / data.val_files, or make one "
                "with `python -m rlfoundry.data.preprocess <task> --output DIR`"
            )
        else:
            paths.append(path)
    return paths


def _read_parquet(path: Path) -> pa.Table:
    try:
        with pq.ParquetFile(path) as parquet:  # not read_table: that imports pyarrow.dataset and pandas (~45 MB)
            return parquet.read()
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(
            f"{path} is not a readable parquet file ({err}). Prompt data must be verl-format parquet; "
            "convert jsonl with `python -m rlfoundry.data.preprocess gsm8k|math --input FILE --output DIR`"
        ) from err


def _check_columns(table: pa.Table, path: Path, opts: DataConfig) -> None:
    for key, option in ((opts.prompt_key, "data.prompt_key"), (opts.reward_fn_key, "data.reward_fn_key")):
        if key not in table.column_names:
            raise DataError(
                f"{path} has no column {key!r} ({option}); its columns are {table.column_names}. "
                f"Set {option} to the right column or re-create the file with rlfoundry.data.preprocess"
            )


def _check_messages(prompt: Any, path: Path, row: int, prompt_key: str) -> list[dict]:
    """The prompt must be a non-empty list of {"role": str, "content": str} dicts."""
    if isinstance(prompt, np.ndarray):
        prompt = prompt.tolist()
    ok = isinstance(prompt, list) and len(prompt) > 0
    ok = ok and all(
        isinstance(m, Mapping) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in prompt
    )
    if not ok:
        raise DataError(
            f"{path}, row {row}: column {prompt_key!r} must be a list of chat messages "
            f'[{{"role": ..., "content": ...}}], got {str(prompt)[:200]!r}. A plain-text prompt '
            f'should be wrapped as [{{"role": "user", "content": text}}]'
        )
    return [{"role": m["role"], "content": m["content"]} for m in prompt]


def load_tables(data_files: Any, opts: DataConfig) -> list[tuple[Path, pa.Table]]:
    """Every data file as (path, Arrow table), with the prompt and reward_fn_key columns checked."""
    tables = []
    for path in _expand_files(data_files):
        table = _read_parquet(path)
        _check_columns(table, path, opts)
        tables.append((path, table))
    return tables


# ---- rendering and token-level helpers -------------------------------------------------------


def render_prompts(messages: list[list[dict]], tokenizer: Any, opts: DataConfig) -> list[str]:
    """Prompt text as the policy sees it: chat template with generation prompt, or plain join."""
    if not opts.apply_chat_template:
        return ["\n".join(m["content"] for m in chat) for chat in messages]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            f"tokenizer {type(tokenizer).__name__} ({getattr(tokenizer, 'name_or_path', '?')}) has no chat "
            "template; set data.apply_chat_template=False to join the message contents as plain text, or "
            "use a tokenizer with a chat template"
        )
    kwargs = {"add_generation_prompt": True, "tokenize": False, **opts.apply_chat_template_kwargs}
    return list(tokenizer.apply_chat_template(messages, **kwargs))


def truncate_ids(ids: list[int], max_length: int, mode: str) -> list[int]:
    """Cut ``ids`` to ``max_length``: left keeps the end, right the start, middle both ends."""
    if len(ids) <= max_length:
        return ids
    if mode == "left":
        return ids[-max_length:]
    if mode == "right":
        return ids[:max_length]
    if mode == "middle":
        head = max_length // 2
        return ids[:head] + ids[len(ids) - (max_length - head) :]
    raise DataError(f"prompt has {len(ids)} tokens > max_prompt_length={max_length} with truncation={mode!r}")


def left_pad(ids: list[int], max_length: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of length ``max_length``, padding on the left (decoder-only generation)."""
    n_pad = max_length - len(ids)
    input_ids = torch.tensor([pad_id] * n_pad + list(ids), dtype=torch.long)
    mask = torch.cat([torch.zeros(n_pad, dtype=torch.long), torch.ones(len(ids), dtype=torch.long)])
    return input_ids, mask


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... over the real tokens; pads before them get 0 (they are masked anyway)."""
    return torch.clamp(attention_mask.long().cumsum(-1) - 1, min=0)


# ---- the data set ----------------------------------------------------------------------------


class RLHFDataset(Dataset):
    """verl-format parquet prompts, tokenised once, left-padded to ``data.max_prompt_length``.

    ``dataset[i]`` is a dict: ``input_ids``, ``attention_mask``, ``position_ids`` (1-D tensors of
    length max_prompt_length), ``raw_prompt_ids`` (list, unpadded, for rollout engines that take
    token lists), ``index`` (``extra_info["index"]`` or 0), every other parquet column except the
    prompt, ``raw_prompt`` (the messages) when ``data.return_raw_chat`` and ``full_prompts`` (the
    rendered text) when ``data.return_full_prompt``.
    """

    def __init__(self, data_files: Any, tokenizer: Any, config: Any = None, processor: Any = None,
                 max_samples: int = -1) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self.config = typed_data_config(config)
        # Rows stay in Arrow (compact, converted per item); only the token ids are materialised.
        self.tables = load_tables(data_files, self.config)
        self._check_media_columns()
        self._check_patch_size()
        where, messages = sample_rows(*self._all_prompts(), max_samples, self.config)
        image_tokens = None
        if processor is not None and not self.config.apply_chat_template:
            raise DataError("data.apply_chat_template=false with a vision-language model: its processor's chat template "
                            "places the image tokens; set data.apply_chat_template=true")
        if processor is not None:
            where, messages, image_tokens = self._vision_prompts(where, messages)
        if not messages:  # else the chat template fails on "an empty conversation", naming no file
            files = [str(path) for path, _ in self.tables]
            raise DataError(f"{files} hold no rows: the data set is empty. Point data.train_files / "
                            "data.val_files at parquet files with at least data.train_batch_size prompts.")
        texts = render_prompts(messages, processor or tokenizer, self.config)
        token_ids = tokenizer(texts, add_special_tokens=False, return_attention_mask=False)["input_ids"]
        self._keep(where, texts, token_ids, image_tokens)
        logger.info("RLHFDataset: %d prompts from %s", len(self), data_files)

    def _all_prompts(self) -> tuple[list[tuple[int, int]], list[list[dict]]]:
        """(table index, row index) and the checked chat messages of every row of every file."""
        where, messages, key = [], [], self.config.prompt_key
        for t, (path, table) in enumerate(self.tables):
            for i, prompt in enumerate(table.column(key).to_pylist()):
                messages.append(_check_messages(prompt, path, i, key))
                where.append((t, i))
        return where, messages

    def _check_patch_size(self) -> None:
        """verl resizes images to a grid of ``data.image_patch_size`` before its processor does; the images
        here reach the processor as they are, which resizes them to its own patch grid: the same only when
        the two sizes agree."""
        wanted = self.config.image_patch_size
        own = getattr(getattr(self.processor, "image_processor", None), "patch_size", None)
        if wanted is not None and own is not None and int(wanted) != int(own):
            raise DataError(f"data.image_patch_size={wanted}: the model's processor works on patches of {own}; "
                            f"resizing images to another patch grid is not built here. Set data.image_patch_size={own} "
                            "or leave it unset.")

    def _check_media_columns(self) -> None:
        """Images need the model's processor; video prompts are not built (a start-up error, not a silent skip)."""
        opts = self.config
        for path, table in self.tables:
            if opts.video_key in table.column_names and any(v for v in table.column(opts.video_key).to_pylist()):
                raise DataError(f"{path} has videos in column {opts.video_key!r} (data.video_key): video prompts are "
                                "not built in rlfoundry yet (docs/vision.md); drop the column or its rows")
            if self.processor is None and opts.image_key in table.column_names and \
                    any(v for v in table.column(opts.image_key).to_pylist()):
                raise DataError(f"{path} has images in column {opts.image_key!r} (data.image_key) but the model has no "
                                "processor (a text-only model): use a vision-language model such as Qwen2-VL, or drop "
                                "the column")

    def _row_images(self, table: int, row: int) -> list:
        path, arrow = self.tables[table]
        if self.config.image_key not in arrow.column_names:
            return []
        return mm.row_images(arrow.column(self.config.image_key)[row].as_py(), path.parent)

    def _vision_prompts(self, where: list[tuple[int, int]], messages: list[list[dict]]):
        """Decode every image once at start-up: a row whose image does not decode is reported (file,
        row) and skipped. Returns the rows kept, their messages with image parts, and the image tokens
        each adds beyond the one placeholder token per image its rendered text holds."""
        kept, parts, extra = [], [], []
        for (t, i), chat in zip(where, messages):
            try:
                images = self._row_images(t, i)
                chat = mm.vision_messages(chat, len(images))
            except (mm.ImageDecodeError, ValueError) as err:
                logger.warning("%s, row %d: skipped, its image does not load (%s)", self.tables[t][0], i, err)
                continue
            kept.append((t, i))
            parts.append(chat)
            extra.append(sum(n - 1 for n in mm.image_token_counts(self.processor, images)))
        self.rope_index = mm_rope_index(self.processor)
        return kept, parts, np.asarray(extra, dtype=np.int64)

    def _keep(self, where: list[tuple[int, int]], texts: list[str], token_ids: list[list[int]],
              image_tokens: np.ndarray | None = None) -> None:
        """Drop over-long prompts when asked, enforce truncation=error, refuse an empty result.

        ``image_tokens``: per row, the tokens its images add beyond their placeholders (counted in
        ``data.max_prompt_length``); an over-long image prompt is never truncated (the cut would
        part image tokens from their pixels)."""
        limit = self.config.max_prompt_length
        text_lengths = lengths = np.array([len(ids) for ids in token_ids], dtype=np.int64)
        if image_tokens is not None:
            lengths = lengths + image_tokens
        if self.config.filter_overlong_prompts:
            keep = np.flatnonzero(lengths <= limit)
            logger.info("filter_overlong_prompts dropped %d of %d prompts", len(where) - len(keep), len(where))
        else:
            keep = np.arange(len(where))
            if self.config.truncation == "error" or self.processor is not None:
                self._raise_if_overlong(where, lengths)
        if len(keep) == 0:
            files = [str(path) for path, _ in self.tables]
            raise DataError(
                f"no prompts left in {files} ({len(where)} rows before filtering): every prompt is longer than "
                f"data.max_prompt_length={limit}. Raise data.max_prompt_length or set "
                "data.filter_overlong_prompts=False with data.truncation=left|right|middle"
            )
        self.where = np.asarray(where, dtype=np.int64).reshape(-1, 2)[keep]
        self.texts = [texts[i] for i in keep] if self.config.return_full_prompt or self.processor else None
        # One flat int array + offsets instead of a Python list per prompt: ~4 bytes per token.
        self.offsets = np.concatenate([[0], np.cumsum(text_lengths[keep])])
        flat = (t for i in keep for t in token_ids[i])
        self.flat_ids = np.fromiter(flat, dtype=np.int64, count=int(self.offsets[-1]))

    def _raise_if_overlong(self, where: list[tuple[int, int]], lengths: np.ndarray) -> None:
        limit = self.config.max_prompt_length
        over = np.flatnonzero(lengths > limit)
        if len(over) == 0:
            return
        table, row = where[over[0]]
        raise DataError(
            f"{self.tables[table][0]}, row {row}: prompt is {lengths[over[0]]} tokens, longer than "
            f"data.max_prompt_length={limit} ({len(over)} of {len(lengths)} prompts are). With data.truncation=error "
            "this is refused; raise data.max_prompt_length, set data.filter_overlong_prompts=True to drop them, "
            "or set data.truncation=left|right|middle"
        )

    def __len__(self) -> int:
        return len(self.where)

    def __getitem__(self, item: int) -> dict:
        opts = self.config
        table, row_index = self.where[item]
        path, arrow = self.tables[table]
        row = arrow.slice(int(row_index), 1).to_pylist()[0]
        messages = _check_messages(row.pop(opts.prompt_key), path, int(row_index), opts.prompt_key)
        if self.processor is not None:
            row.update(self._vision_item(row, int(table), int(row_index), item))
        else:
            ids = self.flat_ids[self.offsets[item] : self.offsets[item + 1]].tolist()
            ids = truncate_ids(ids, opts.max_prompt_length, opts.truncation)
            input_ids, attention_mask = left_pad(ids, opts.max_prompt_length, pad_id(self.tokenizer))
            row.update(input_ids=input_ids, attention_mask=attention_mask, raw_prompt_ids=ids)
            row["position_ids"] = position_ids_from_mask(attention_mask)
        if opts.return_raw_chat:
            row["raw_prompt"] = messages
        if opts.return_full_prompt:
            row["full_prompts"] = self.texts[item]
        extra = row.get("extra_info")
        row["index"] = extra.get("index", 0) if isinstance(extra, Mapping) else 0
        return row


    def _vision_item(self, row: dict, table: int, row_index: int, item: int) -> dict:
        """The processor's own ids and pixel inputs for one row, left-padded, with its 3-D positions."""
        row.pop(self.config.image_key, None)
        row.pop(self.config.video_key, None)
        images = self._row_images(table, row_index)
        out = mm.process_prompt(self.processor, self.texts[item], images)
        ids = out["input_ids"].tolist()
        input_ids, attention_mask = left_pad(ids, self.config.max_prompt_length, pad_id(self.tokenizer))
        types = torch.cat([out["mm_token_type_ids"].new_zeros(len(input_ids) - len(ids)), out["mm_token_type_ids"]])
        grid = out.get("image_grid_thw")
        positions = self.rope_index(input_ids[None], attention_mask[None], types[None], grid)[:, 0]
        inputs = {k: out[k] for k in ("pixel_values", "image_grid_thw") if k in out}
        return {"input_ids": input_ids, "attention_mask": attention_mask, "raw_prompt_ids": ids,
                "position_ids": positions, "multi_modal_data": {"image": images} if images else {},
                "multi_modal_inputs": inputs}


def mm_rope_index(processor: Any) -> Any:
    """The model's own 3-D rotary positions for the processor's model (its directory holds config.json)."""
    from transformers import AutoConfig

    from rlfoundry.models.vision import RopeIndex

    path = getattr(processor, "name_or_path", None) or getattr(processor.tokenizer, "name_or_path", None)
    try:
        return RopeIndex(AutoConfig.from_pretrained(path))
    except (OSError, ValueError) as err:
        raise DataError(f"the processor's directory {path!r} holds no model config.json, which the 3-D rotary "
                        f"positions of image prompts need ({err}); load the processor from the model directory") from err


def collate_fn(data_list: list[dict]) -> dict:
    """Batch dict: tensors stacked along a new first dim, everything else an object array of B entries."""
    if not data_list:
        raise ValueError("collate_fn got an empty batch")
    batch: dict[str, Any] = {}
    for key in data_list[0]:
        values = [item[key] for item in data_list]
        if isinstance(values[0], torch.Tensor):
            batch[key] = torch.stack(values)
        else:
            column = np.empty(len(values), dtype=object)
            column[:] = values  # slice assignment keeps lists/dicts as single objects, not ragged arrays
            batch[key] = column
    return batch


# ---- sampling and loading ---------------------------------------------------------------------


def _extern_class(path: str, name: str | None, key: str, name_key: str, base: type) -> type:
    try:
        cls = load_extern_object(path, name, key, name_key)
    except ExternObjectError as e:
        raise DataError(str(e)) from e
    if not (isinstance(cls, type) and issubclass(cls, base)):
        raise DataError(f"{name_key}={name} in {path} must be a class deriving from {base.__module__}.{base.__qualname__}, "
                        f"got {cls!r}.")
    return cls


def get_dataset_class(data_config: Any) -> type:
    """``data.custom_cls.{path,name}`` (a ``torch.utils.data.Dataset`` subclass, verl's rule), else RLHFDataset."""
    custom = typed_data_config(data_config).custom_cls
    if custom.path is None:
        return RLHFDataset
    return _extern_class(custom.path, custom.name, "data.custom_cls.path", "data.custom_cls.name", Dataset)


def sample_rows(where: list, messages: list, max_samples: int, config: Any) -> tuple[list, list]:
    """verl's ``data.train_max_samples`` / ``val_max_samples``: at most ``max_samples`` rows, drawn before
    the length filter — without replacement by ``numpy.random.default_rng(data.seed)`` when
    ``data.shuffle``, else the first ones (verl's RLHFDataset draws the same way; -1 or more than
    the file holds: every row)."""
    picked = max_samples_drawn(len(where), max_samples, config.shuffle, config.seed)
    if picked is None:
        return where, messages
    return [where[i] for i in picked], [messages[i] for i in picked]


def max_samples_drawn(total: int, max_samples: int | None, shuffle: bool, seed: int | None) -> np.ndarray | None:
    """The rows verl's ``*_max_samples`` keeps of ``total`` (RL and SFT datasets draw alike): ``max_samples``
    without replacement by ``numpy.random.default_rng(seed)`` when ``shuffle``, else the first ones; None
    (every row) for -1 or at least ``total``."""
    if max_samples is None or max_samples <= 0 or max_samples >= total:
        return None
    logger.info("data: %d of %d rows drawn (max_samples)", max_samples, total)
    if shuffle:
        return np.random.default_rng(seed).choice(total, size=max_samples, replace=False)
    return np.arange(max_samples)


def create_rl_dataset(data_files: Any, data_config: Any, tokenizer: Any, processor: Any = None,
                      max_samples: int = -1) -> Dataset:
    """The prompt data set, built as verl builds it: ``cls(data_files=, tokenizer=, config=, processor=)``,
    with ``max_samples=`` when a ``*_max_samples`` key asks for a subset (a user's class written for
    older verl, without the argument, still loads when the key is unset)."""
    cls = get_dataset_class(data_config)
    extra = {"max_samples": int(max_samples)} if max_samples is not None and int(max_samples) > 0 else {}
    return cls(data_files=data_files, tokenizer=tokenizer, config=data_config, processor=processor, **extra)


def create_rl_sampler(data_config: Any, dataset: Dataset) -> Sampler:
    """``data.sampler.class_path`` → the user's sampler; else seeded random order when
    ``data.shuffle`` (default True), else file order.

    torchdata's RandomSampler is a drop-in for torch's that also checkpoints its generator state,
    so a loader restored from ``state_dict()`` replays the same order, across epochs too. A user's
    sampler is built as verl builds it, ``cls(data_source=dataset, data_config=data)``; it needs
    ``data.dataloader_num_workers=0`` (verl's rule: worker processes would fetch ahead of a sampler
    that reorders as it learns).
    """
    cfg = typed_data_config(data_config)
    if cfg.sampler.class_path is not None:
        if cfg.dataloader_num_workers != 0:
            raise DataError(f"data.sampler.class_path is set with data.dataloader_num_workers={cfg.dataloader_num_workers}; "
                            "a custom sampler needs data.dataloader_num_workers=0 (workers would prefetch batches "
                            "before the sampler can reorder them).")
        cls = _extern_class(cfg.sampler.class_path, cfg.sampler.class_name, "data.sampler.class_path",
                            "data.sampler.class_name", Sampler)
        return cls(data_source=dataset, data_config=data_config)
    if not cfg.shuffle:
        return SequentialSampler(dataset)
    generator = torch.Generator()
    generator.manual_seed(cfg.seed)
    return RandomSampler(dataset, generator=generator)


def build_dataloader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    seed: int = 1,
    num_workers: int = 0,
    drop_last: bool = True,
    sampler: Sampler | None = None,
) -> StatefulDataLoader:
    """A resumable loader: save ``loader.state_dict()`` in the checkpoint, ``load_state_dict`` it back.

    ``sampler`` (e.g. from ``create_rl_sampler``) replaces the one ``shuffle`` and ``seed`` choose; its
    ``state_dict``, if it has one, is part of the loader's."""
    sampler = sampler if sampler is not None else create_rl_sampler({"shuffle": shuffle, "seed": seed}, dataset)
    return StatefulDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        num_workers=num_workers,
        drop_last=drop_last,
        collate_fn=collate_fn,
    )
