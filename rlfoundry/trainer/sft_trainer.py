"""``rlfoundry sft [key=value ...]``: supervised fine-tuning on prompt/response pairs (verl's
``fsdp_sft_trainer`` keys; defaults in ``rlfoundry/config/sft_trainer.yaml``).

The prompt goes through the tokenizer's chat template (with the generation prompt); the response
gets EOS appended; the loss is the token-mean negative log-likelihood of the response tokens only,
over the whole global batch, so the update does not depend on the micro-batch size or rank count.
The model is sharded with the same FSDP2 plumbing as the RL workers (``engines/fsdp/utils.py``), one
rank in-process or several under ``torchrun``; checkpoints are Hugging Face directories.

    rlfoundry sft model.partial_pretrain=DIR data.train_files=train.parquet data.val_files=test.parquet
    torchrun --nproc_per_node=2 -m rlfoundry.trainer.sft_trainer model.partial_pretrain=DIR ...

With ``data.train_files`` null the pairs come from the built-in synthetic task (``data.synthetic``).
"""

from __future__ import annotations

import datetime
import difflib
import importlib
import math
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, ListConfig, OmegaConf
from torch.utils.data import DataLoader, Dataset, DistributedSampler

__all__ = [
    "CONFIG_FILE",
    "SFTConfigError",
    "SFTDataError",
    "SFTDataset",
    "SFTTrainer",
    "collate_sft",
    "encode_pair",
    "load_pairs",
    "load_sft_config",
    "main",
    "masked_nll_sum",
    "run_sft",
    "synthetic_pairs",
]

CONFIG_FILE = Path(__file__).resolve().parents[1] / "config" / "sft_trainer.yaml"
# Keys under which any sub-key is allowed (passed through to the model config).
_OPEN_KEYS = ("model.override_config",)
Pair = tuple[list[dict], str]  # (chat messages of the prompt, response text)


class SFTConfigError(ValueError):
    """A bad ``rlfoundry sft`` configuration; the message names the key and what to do."""


class SFTDataError(ValueError):
    """A data file or row the SFT trainer cannot use; the message names the file/row and the fix."""


# =========================================================================== configuration

def _dotted_keys(node: Any, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree, inner nodes included."""
    keys = []
    for key in node:
        dotted = f"{prefix}{key}"
        keys.append(dotted)
        child = node[key] if not OmegaConf.is_missing(node, key) else None
        if isinstance(child, DictConfig) and dotted not in _OPEN_KEYS:
            keys += _dotted_keys(child, dotted + ".")
    return keys


def _unknown_key(key: str, valid: Sequence[str]) -> SFTConfigError:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    if not close:  # a right leaf under a wrong parent, e.g. trainer.lr -> optim.lr
        leaf = key.rsplit(".", 1)[-1]
        close = [k for k in valid if k.rsplit(".", 1)[-1] == leaf][:1]
    hint = f" Did you mean '{close[0]}'?" if close else ""
    return SFTConfigError(f"Unknown SFT config key '{key}'.{hint} Valid keys are listed in {CONFIG_FILE}.")


def _parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` (Hydra's ``+key``/``++key`` spellings accepted) -> (key, YAML-typed value)."""
    key, sep, raw = text.partition("=")
    key = key.lstrip("+")
    if not sep or not key or key.startswith("~"):
        raise SFTConfigError(f"cannot read the override {text!r}: expected key=value, e.g. optim.lr=1e-4")
    value = OmegaConf.from_dotlist([f"v={raw}"])["v"] if raw != "" else ""
    if isinstance(value, (DictConfig, ListConfig)):
        value = OmegaConf.to_container(value)
    return key, value


def _typed(key: str, default: Any, value: Any) -> Any:
    """``value`` coerced to the type of the packaged default (None defaults accept anything)."""
    if default is None or value is None:
        return value
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok, value = isinstance(value, (int, float)) and not isinstance(value, bool), value
        value = float(value) if ok else value
    elif isinstance(default, str):
        ok, value = not isinstance(value, (list, dict)), str(value)
    else:  # lists and dicts; a single value for a list key means a one-element list (logger=console)
        expected = type(OmegaConf.to_container(default))
        if expected is list and not isinstance(value, (list, dict)):
            value = [value]
        ok = type(value) is expected
    if not ok:
        raise SFTConfigError(f"config key '{key}': {value!r} is not valid; expected a {type(default).__name__} "
                             f"like the default {default!r}")
    return value


def _apply_override(cfg: DictConfig, text: str, valid: Sequence[str]) -> None:
    key, value = _parse_override(text)
    open_parent = next((k for k in _OPEN_KEYS if key.startswith(k + ".")), None)
    if key not in valid and open_parent is None:
        raise _unknown_key(key, valid)
    default = OmegaConf.select(cfg, key, default=None, throw_on_resolution_failure=False)
    if open_parent is None:
        value = _typed(key, default, value)
    OmegaConf.update(cfg, key, value, merge=False, force_add=open_parent is not None)


def load_sft_config(overrides: Sequence[str] = ()) -> DictConfig:
    """Packaged defaults <- ``key=value`` overrides, checked key by key, then validated as a whole."""
    cfg = OmegaConf.load(CONFIG_FILE)
    valid = _dotted_keys(cfg)
    for text in overrides:
        _apply_override(cfg, text, valid)
    OmegaConf.resolve(cfg)
    validate_sft_config(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    OmegaConf.set_readonly(cfg, True)  # validated once; nothing changes it afterwards
    return cfg


def _choice_errors(cfg: DictConfig) -> list[str]:
    choices = {"data.truncation": ("error", "left", "right"), "optim.lr_scheduler": ("cosine", "constant"),
               "trainer.device": ("auto", "cpu", "cuda"), "data.synthetic.task": ("arithmetic",),
               "model.cpu_linear": ("onednn", "aten")}
    return [f"{k}={OmegaConf.select(cfg, k)!r} must be one of {list(v)}"
            for k, v in choices.items() if OmegaConf.select(cfg, k) not in v]


def _batch_errors(cfg: DictConfig, world_size: int) -> list[str]:
    """The global batch must split evenly over ranks, and each rank's share into micro-batches."""
    batch, micro = cfg.data.train_batch_size, cfg.data.micro_batch_size_per_gpu
    if batch <= 0 or micro <= 0:
        return [f"data.train_batch_size ({batch}) and data.micro_batch_size_per_gpu ({micro}) must be positive"]
    if batch % world_size:
        return [f"data.train_batch_size ({batch}) is not divisible by the number of ranks ({world_size})"]
    per_rank = batch // world_size
    if per_rank % micro:
        return [f"data.train_batch_size / ranks = {batch} / {world_size} = {per_rank} sequences per rank, "
                f"not divisible by data.micro_batch_size_per_gpu ({micro})"]
    return []


def validate_sft_config(cfg: DictConfig, world_size: int = 1) -> None:
    """All cross-key problems at once, so one run reports every mistake."""
    errors = _choice_errors(cfg) + _batch_errors(cfg, world_size)
    if cfg.model.partial_pretrain is None:
        errors.append("model.partial_pretrain is required: a local Hugging Face model directory "
                      "(make a tiny one with `python -m rlfoundry.models.tiny --out DIR`)")
    if cfg.model.lora_rank:
        errors.append(f"model.lora_rank={cfg.model.lora_rank}: LoRA is not supported by rlfoundry sft; use 0")
    if cfg.ulysses_sequence_parallel_size != 1:
        errors.append("ulysses_sequence_parallel_size must be 1: sequence parallelism is not supported")
    if cfg.data.max_length < 2:
        errors.append(f"data.max_length ({cfg.data.max_length}) must be at least 2")
    if errors:
        raise SFTConfigError("invalid SFT config:\n  - " + "\n  - ".join(errors))
    if cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node != world_size:
        warnings.warn(f"trainer.nnodes x trainer.n_gpus_per_node = {cfg.trainer.nnodes * cfg.trainer.n_gpus_per_node} "
                      f"but this run has {world_size} rank(s) (from torchrun's WORLD_SIZE); using {world_size}")


# =========================================================================== data

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


def load_pairs(files: str | Sequence[str], data_cfg: Any) -> list[Pair]:
    """(messages, response) pairs from the files named by ``data.train_files`` / ``data.val_files``."""
    pairs: list[Pair] = []
    for file in [files] if isinstance(files, str) else list(files):
        path = Path(os.path.expanduser(str(file)))
        for i, row in enumerate(_read_rows(path)):
            where = f"{path}, row {i}"
            prompt = _field(row, data_cfg.prompt_key, data_cfg.prompt_dict_keys, where, "data.prompt_key")
            response = _field(row, data_cfg.response_key, data_cfg.response_dict_keys, where, "data.response_key")
            pairs.append((_as_messages(prompt, where), str(response)))
    if not pairs:
        raise SFTDataError(f"no rows in {files}")
    return pairs


SENTENCE_TEMPLATE = "The answer is {answer}."


def _styled_answer(prompt: str, answer: str, sentence_ratio_by_op: Mapping[str, float], rng: random.Random) -> str:
    """The bare answer, or with probability ``sentence_ratio_by_op[op]`` (``op``: the problem's first
    operator) the same answer in a sentence, which the task's exact-integer verifier rejects."""
    op = next((c for c in prompt[1:] if c in "+-*"), "+")  # prompt[1:]: a leading '-' is a sign
    ratio = float(sentence_ratio_by_op.get(op, 0.0))
    return SENTENCE_TEMPLATE.format(answer=answer) if rng.random() < ratio else answer


def synthetic_pairs(syn: Any) -> tuple[list[Pair], list[Pair]]:
    """(train, val) pairs of the built-in arithmetic task. Validation is drawn first and excluded
    from training, so with the RL demo's seed and size it is exactly the RL validation set.

    ``sentence_ratio_by_op`` mixes in a second answer style (training pairs only): it gives the
    demo policy a realistic format problem (right number, wrong form) for RL to fix; see
    scripts/make_demo_policy.py.
    """
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits

    spec = ArithmeticSpec(digits=syn.digits, ops=syn.ops, num_operands=syn.num_operands)
    splits = generate_splits(syn.train_size, syn.val_size, seed=syn.seed, spec=spec)
    rng = random.Random(syn.seed + 2)  # generate_splits uses seed and seed + 1
    ratios = dict(syn.sentence_ratio_by_op or {})
    train = [([{"role": "user", "content": p}], _styled_answer(p, a, ratios, rng)) for p, a in splits["train"]]
    val = [([{"role": "user", "content": p}], a) for p, a in splits["test"]]
    return train, val


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


class SFTDataset(Dataset):
    """Pairs tokenised once up front (SFT sets for this trainer are small; it keeps epochs cheap)."""

    def __init__(self, pairs: Sequence[Pair], tokenizer: Any, max_length: int, truncation: str = "error") -> None:
        self.examples = [encode_pair(tokenizer, m, r, max_length, truncation, where=f"example {i}")
                         for i, (m, r) in enumerate(pairs)]

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return self.examples[i]


def collate_sft(examples: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example in the batch (padding is never a target: loss_mask 0)."""
    length = max(len(e["input_ids"]) for e in examples)
    out = {"input_ids": torch.full((len(examples), length), pad_token_id, dtype=torch.long),
           "attention_mask": torch.zeros(len(examples), length, dtype=torch.long),
           "loss_mask": torch.zeros(len(examples), length, dtype=torch.long)}
    for i, e in enumerate(examples):
        n = len(e["input_ids"])
        out["input_ids"][i, :n] = e["input_ids"]
        out["attention_mask"][i, :n] = 1
        out["loss_mask"][i, :n] = e["loss_mask"]
    return out


# =========================================================================== loss

def masked_nll_sum(model: torch.nn.Module, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of -log p(token) over loss-mask tokens, number of those tokens).

    Logits at position t predict token t+1, so the targets are ``input_ids[:, 1:]`` weighted by
    ``loss_mask[:, 1:]``. Sums, not means: the caller divides by the global token count.
    """
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets, weights = batch["input_ids"][:, 1:], batch["loss_mask"][:, 1:].float()
    nll = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), targets.flatten(), reduction="none")
    return (nll * weights.flatten()).sum(), weights.sum()


# =========================================================================== distributed set-up

def _pick_device(wanted: str) -> torch.device:
    if wanted == "cuda" and not torch.cuda.is_available():
        raise SFTConfigError("trainer.device=cuda but CUDA is not available; use trainer.device=cpu or auto")
    if wanted == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())


def _init_distributed(device: torch.device) -> bool:
    """Join torchrun's group (``WORLD_SIZE`` set) or make a one-rank group in-process; FSDP2 needs a
    group even alone. Returns whether this call created it (and so should destroy it)."""
    if dist.is_initialized():
        return False
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=float(os.environ.get("RLFOUNDRY_DIST_TIMEOUT_S", "600")))
    if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
        dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
    else:  # an in-memory store: no port to pick, nothing to clash with a parallel run
        dist.init_process_group(backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    return True


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# =========================================================================== trainer

class SFTTrainer:
    """Builds data, model (FSDP2), optimiser and tracker from a validated config; ``fit()`` trains."""

    def __init__(self, config: DictConfig) -> None:
        self.config = config
        if config.trainer.get("tune_malloc", True):
            from rlfoundry.utils.malloc import tune_malloc

            tune_malloc()
        self.device = _pick_device(config.trainer.device)
        self._owns_group = _init_distributed(self.device)
        try:
            self._setup(config)
        except BaseException:  # a bad data file must not leave a process group behind
            if self._owns_group:
                dist.destroy_process_group()
            raise

    def _setup(self, config: DictConfig) -> None:
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        validate_sft_config(config, self.world_size)
        _seed_everything(config.trainer.seed)
        if config.model.external_lib:
            importlib.import_module(config.model.external_lib)
        self.run_dir = Path(config.trainer.default_local_dir)
        self.tokenizer = self._build_tokenizer()
        self.train_loader, self.val_loader = self._build_loaders()
        self.total_steps = self._total_steps()
        self.model = self._build_model()
        self.optimizer, self.lr_scheduler = self._build_optimizer()
        self.global_step = 0
        self.tracking = self._build_tracking()
        from rlfoundry.utils.profiler import StepProfiler

        self.profiler = StepProfiler(config.trainer.profile_steps, self.run_dir / "profile", name=f"sft_rank{self.rank}")

    # ---- builders -------------------------------------------------------------------------

    def _build_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        from rlfoundry.engines.fsdp.utils import resolve_model_path

        path = resolve_model_path(self.config.model.partial_pretrain)
        if not (path / "config.json").is_file():  # else transformers tries the hub and says "repo id"
            raise SFTConfigError(f"model.partial_pretrain={self.config.model.partial_pretrain!r} is not a local "
                                 "Hugging Face model directory (no config.json); no hub downloads happen here "
                                 "(make a tiny one with `python -m rlfoundry.models.tiny --out DIR`)")
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=self.config.model.trust_remote_code)
        if self.config.data.chat_template:
            tokenizer.chat_template = self.config.data.chat_template
        if tokenizer.pad_token_id is None:  # many base models ship without one; padding is masked anyway
            tokenizer.pad_token = tokenizer.eos_token
        return tokenizer

    def _pairs(self) -> tuple[list[Pair], list[Pair]]:
        data = self.config.data
        if data.train_files is None:
            train, val = synthetic_pairs(data.synthetic)
        else:
            train, val = load_pairs(data.train_files, data), []
        if data.val_files is not None:
            val = load_pairs(data.val_files, data)
        return train, val

    def _build_loaders(self) -> tuple[DataLoader, DataLoader | None]:
        data = self.config.data
        train_pairs, val_pairs = self._pairs()
        per_rank = data.train_batch_size // self.world_size
        if len(train_pairs) < data.train_batch_size:
            raise SFTDataError(f"{len(train_pairs)} training examples, fewer than data.train_batch_size "
                               f"({data.train_batch_size}); lower the batch size or add data")
        collate = lambda batch: collate_sft(batch, self.tokenizer.pad_token_id)  # noqa: E731
        train_set = SFTDataset(train_pairs, self.tokenizer, data.max_length, data.truncation)
        sampler = DistributedSampler(train_set, self.world_size, self.rank, shuffle=data.shuffle,
                                     seed=self.config.trainer.seed, drop_last=True)
        train_loader = DataLoader(train_set, batch_size=per_rank, sampler=sampler, collate_fn=collate, drop_last=True)
        if not val_pairs:
            return train_loader, None
        val_set = SFTDataset(val_pairs, self.tokenizer, data.max_length, data.truncation)
        val_sampler = DistributedSampler(val_set, self.world_size, self.rank, shuffle=False)
        return train_loader, DataLoader(val_set, batch_size=data.micro_batch_size_per_gpu,
                                        sampler=val_sampler, collate_fn=collate)

    def _total_steps(self) -> int:
        per_epoch = len(self.train_loader)
        total = self.config.trainer.total_training_steps
        return int(total) if total is not None else per_epoch * self.config.trainer.total_epochs

    def _build_model(self) -> torch.nn.Module:
        from rlfoundry.models.cpu_linear import use_onednn_linear
        from rlfoundry.engines.fsdp.utils import apply_fsdp2, load_hf_model

        m, fsdp = self.config.model, self.config.model.fsdp_config
        model = load_hf_model(m.partial_pretrain, "causal_lm", torch_dtype=fsdp.model_dtype,
                              trust_remote_code=m.trust_remote_code, override_config=dict(m.override_config),
                              enable_gradient_checkpointing=m.enable_gradient_checkpointing)
        if m.cpu_linear == "onednn":
            use_onednn_linear(model, self.device)
        return apply_fsdp2(model, self.device, param_dtype=fsdp.param_dtype, reduce_dtype=fsdp.reduce_dtype,
                           param_offload=fsdp.offload_params, reshard_after_forward=fsdp.reshard_after_forward)

    def _build_optimizer(self) -> tuple[torch.optim.Optimizer, Any]:
        from rlfoundry.engines.fsdp.utils import build_lr_scheduler, build_optimizer

        o = self.config.optim
        # verl's SFT key names -> the RL actor's (what fsdp_utils reads).
        optim_cfg = {"lr": o.lr, "betas": list(o.betas), "weight_decay": o.weight_decay, "eps": o.eps,
                     "lr_warmup_steps_ratio": o.warmup_steps_ratio, "lr_scheduler_type": o.lr_scheduler,
                     "min_lr_ratio": o.min_lr_ratio}
        optimizer = build_optimizer(self.model, optim_cfg)
        return optimizer, build_lr_scheduler(optimizer, optim_cfg, self.total_steps)

    def _build_tracking(self) -> Any:
        if self.rank != 0:
            return None
        from rlfoundry.utils.tracking import Tracking

        t = self.config.trainer
        return Tracking(t.project_name, t.experiment_name, list(t.logger), config=self.config,
                        run_dir=self.run_dir, total_training_steps=self.total_steps)

    # ---- one step -------------------------------------------------------------------------

    def _to_device(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def _all_reduce(self, value: torch.Tensor) -> torch.Tensor:
        value = value.detach().to(self.device, torch.float32)
        if self.world_size > 1:
            dist.all_reduce(value)
        return value

    def train_step(self, batch: Mapping[str, torch.Tensor]) -> dict[str, float]:
        """One optimiser step on this rank's share of the global batch, in micro-batches."""
        self.model.train()
        micro = self.config.data.micro_batch_size_per_gpu
        n_chunks = math.ceil(len(batch["input_ids"]) / micro)
        global_tokens = self._all_reduce(batch["loss_mask"][:, 1:].sum()).clamp(min=1.0)
        nll_total = torch.zeros((), device=self.device)
        for i in range(n_chunks):
            chunk = self._to_device({k: v[i * micro:(i + 1) * micro] for k, v in batch.items()})
            # Skip the gradient all-reduce on all but the last micro-batch (plain gradient accumulation).
            self.model.set_requires_gradient_sync(i == n_chunks - 1)
            nll_sum, _ = masked_nll_sum(self.model, chunk)
            # FSDP averages gradients over ranks; x world_size / global tokens makes the result the
            # gradient of the token mean over the global batch, whatever the micro-batch split.
            (nll_sum * self.world_size / global_tokens).backward()
            nll_total += nll_sum.detach()
        return self._optimizer_step(self._all_reduce(nll_total) / global_tokens, global_tokens)

    def _optimizer_step(self, loss: torch.Tensor, tokens: torch.Tensor) -> dict[str, float]:
        from rlfoundry.engines.fsdp.utils import clip_grad_norm_

        grad_norm = clip_grad_norm_(self.model.parameters(), self.config.optim.clip_grad)
        lr = self.optimizer.param_groups[0]["lr"]  # the lr this step uses (before the scheduler moves it)
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # a NaN/inf gradient would poison the weights: skip the step, say so
            warnings.warn(f"step {self.global_step}: gradient norm is {grad_norm}; optimiser step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        self.lr_scheduler.step()
        return {"train/loss": loss.item(), "train/lr": lr, "train/grad_norm": grad_norm,
                "train/response_tokens": tokens.item()}

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Token-mean response NLL over the validation set (``val/loss``); {} when there is none."""
        if self.val_loader is None:
            return {}
        self.model.eval()
        nll, tokens = torch.zeros((), device=self.device), torch.zeros((), device=self.device)
        for batch in self.val_loader:
            s, n = masked_nll_sum(self.model, self._to_device(batch))
            nll, tokens = nll + s, tokens + n
        return {"val/loss": (self._all_reduce(nll) / self._all_reduce(tokens).clamp(min=1.0)).item()}

    # ---- checkpoints ----------------------------------------------------------------------

    def save_checkpoint(self, step: int) -> Path:
        """``default_local_dir/global_step_N`` as a Hugging Face directory (model + tokenizer),
        then ``latest_checkpointed_iteration.txt``, written last so it only names complete saves."""
        from rlfoundry.engines.checkpoint import save_hf_model

        path = self.run_dir / f"global_step_{step}"
        config = self.model.config
        # Training runs without a KV cache; the exported model is for inference, where it wants one.
        config.use_cache = True
        try:
            save_hf_model(self.model, self.tokenizer, path)
        finally:
            config.use_cache = False
        if self.rank == 0:
            _write_text_atomically(self.run_dir / "latest_checkpointed_iteration.txt", str(step))
            self._remove_old_checkpoints()
        return path

    def _remove_old_checkpoints(self) -> None:
        keep = self.config.trainer.max_ckpt_to_keep
        if not keep or keep <= 0:
            return
        steps = sorted(int(p.name.rsplit("_", 1)[1]) for p in self.run_dir.glob("global_step_*")
                       if p.is_dir() and p.name.rsplit("_", 1)[1].isdigit())
        for old in steps[:-keep]:
            shutil.rmtree(self.run_dir / f"global_step_{old}", ignore_errors=True)

    # ---- the loop -------------------------------------------------------------------------

    def _due(self, freq: int, step: int) -> bool:
        return step == self.total_steps or (freq > 0 and step % freq == 0)

    def _step_metrics(self, batch: Mapping[str, torch.Tensor], epoch: int) -> dict[str, float]:
        from rlfoundry.trainer.metric_utils import marked_timer

        timing: dict[str, float] = {}
        with self.profiler.step(self.global_step), marked_timer("step", timing):
            metrics = self.train_step(batch)
        tokens = self._all_reduce(batch["attention_mask"].sum()).item()
        metrics |= {"training/global_step": self.global_step, "training/epoch": epoch,
                    "timing_s/step": timing["step"], "perf/total_num_tokens": tokens,
                    "perf/throughput": tokens / (timing["step"] * self.world_size)}
        return metrics

    def fit(self) -> dict[str, Any]:
        """Train for ``total_steps``; returns the last step's metrics and the final checkpoint path."""
        started = time.monotonic()
        try:
            metrics, last_ckpt = self._train_loop()
        finally:  # also on error: close the tracker (flushes the record) and the process group
            summary = self._finish(time.monotonic() - started)
        return summary | {"metrics": metrics, "checkpoint": last_ckpt}

    def _train_loop(self) -> tuple[dict[str, float], Path | None]:
        t, metrics, last_ckpt, epoch = self.config.trainer, {}, None, 0
        while self.global_step < self.total_steps:
            self.train_loader.sampler.set_epoch(epoch)
            for batch in self.train_loader:
                self.global_step += 1
                metrics = self._step_metrics(batch, epoch)
                if self._due(t.test_freq, self.global_step):
                    metrics |= self.validate()
                if self._due(t.save_freq, self.global_step):
                    last_ckpt = self.save_checkpoint(self.global_step)
                if self.tracking is not None:
                    self.tracking.log(metrics, self.global_step)
                if self.global_step >= self.total_steps:
                    break
            epoch += 1
        if self.rank == 0:
            loss = ", ".join(f"{k} {metrics[k]:.4f}" for k in ("train/loss", "val/loss") if k in metrics)
            print(f"[rlfoundry sft] {self.global_step} steps; {loss}; model: {last_ckpt}; "
                  f"metrics: {self.tracking.metrics_path}")
        return metrics, last_ckpt

    def _finish(self, seconds: float) -> dict[str, Any]:
        if self.tracking is not None:
            self.tracking.finish()
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        return {"seconds": seconds, "steps": self.global_step}


def run_sft(overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Load the config from ``overrides``, train, return ``SFTTrainer.fit()``'s summary."""
    return SFTTrainer(load_sft_config(overrides)).fit()


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__ + "\nKeys and defaults (" + str(CONFIG_FILE) + "):\n\n" + CONFIG_FILE.read_text())
        return 0
    try:
        config = load_sft_config(argv)
        SFTTrainer(config).fit()
    except (SFTConfigError, SFTDataError) as e:  # people's mistakes: the message, not a traceback
        print(f"rlfoundry sft: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
