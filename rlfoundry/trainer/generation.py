"""Offline generation shared by verl's two generation entry points (``trainer/main_generation.py``, January's
keys; ``trainer/main_generation_server.py``, August's): read a parquet of chat prompts, sample n responses
per prompt on a rollout-role worker group, and write the parquet back with a ``responses`` column (one list
of n strings per row), the input columns kept.

Each prompt is rendered with the tokenizer's chat template (generation prompt added) and sent as token
ids; each response is decoded without special tokens, up to and including its end-of-sequence token, as
verl decodes them. A prompt longer than ``rollout.prompt_length`` is an error naming its row (verl cuts it
silently, which drops the generation prompt at its end).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlfoundry.trainer.config import ConfigError

if TYPE_CHECKING:
    import pyarrow as pa

    from rlfoundry.single_controller.base import WorkerGroup

__all__ = ["Prompts", "encode_chats", "generate_responses", "read_prompts", "resolve_device", "start_rollout",
           "write_responses"]


@dataclass
class Prompts:
    """The input rows (all their columns) and each row's chat messages."""

    table: pa.Table
    chats: list[list[dict]]


def read_prompts(files: str | Sequence[str], prompt_key: str, files_key: str, prompt_key_name: str) -> Prompts:
    """Every file's rows, concatenated (verl's ``pd.concat``); ``files_key`` / ``prompt_key_name`` are the
    config keys the messages name (``data.path`` / ``data.prompt_key``)."""
    import pyarrow as pa

    from rlfoundry.data.rl_dataset import DataError, _check_messages, _read_parquet

    paths = [files] if isinstance(files, (str, os.PathLike)) else list(files)
    if not paths:
        raise ConfigError(f"{files_key} is not set: give the parquet of chat prompts to generate for.")
    tables, chats = [], []
    for item in paths:
        path = Path(str(item)).expanduser()
        if not path.is_file():
            raise ConfigError(f"{files_key}={item}: no such file; give an existing parquet of chat prompts.")
        table = _read_parquet(path)
        if prompt_key not in table.column_names:
            raise DataError(f"{path} has no column {prompt_key!r} ({prompt_key_name}); its columns are "
                            f"{table.column_names}. Set {prompt_key_name} to the column holding the chat messages.")
        chats += [_check_messages(p, path, i, prompt_key) for i, p in enumerate(table.column(prompt_key).to_pylist())]
        tables.append(table)
    try:
        table = pa.concat_tables(tables, promote_options="default") if len(tables) > 1 else tables[0]
    except pa.ArrowInvalid as e:
        raise DataError(f"{files_key}: the files' columns do not agree ({e}); give files of one layout.") from e
    return Prompts(table, chats)


def encode_chats(tokenizer: Any, chats: list[list[dict]], prompt_length: int, chat_kwargs: dict,
                 length_key: str) -> list[list[int]]:
    """Each chat as the model's prompt token ids (chat template, generation prompt added)."""
    from rlfoundry.data.rl_dataset import DataError

    if not getattr(tokenizer, "chat_template", None):
        raise DataError(f"the tokenizer of {tokenizer.name_or_path} has no chat template; the prompts are chat "
                        "messages, so give a model whose tokenizer_config.json has one.")
    rows = []
    for i, chat in enumerate(chats):
        text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False, **chat_kwargs)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > prompt_length:
            raise DataError(f"row {i}: the prompt has {len(ids)} tokens, more than {length_key}={prompt_length}; "
                            f"raise {length_key} (or shorten the prompt).")
        rows.append(ids)
    return rows


def resolve_device(device: str, key: str) -> str:
    """``auto``: cuda when there is one; an explicit ``cuda`` without one is an error naming ``key``."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{key}=cuda but this machine has no CUDA device; set {key}=cpu (or auto).")
    return device


def start_rollout(worker_config: dict[str, Any], device: str, ranks: int, name_key: str) -> WorkerGroup:
    """A rollout-role worker group: one rank in this process, or ``ranks`` processes on this machine;
    an engine that is not installed fails first, naming ``name_key``."""
    from rlfoundry.config.rollout_engines import engine_problem

    problem = engine_problem(str(worker_config["rollout"]["name"]))
    if problem:
        raise ConfigError(problem.replace("actor_rollout_ref.rollout.name", name_key))  # the key as this module spells it
    from rlfoundry.single_controller import ClassWithInitArgs, LocalWorkerGroup, create_colocated_worker_cls
    from rlfoundry.single_controller.base.worker import WorkerRuntime
    from rlfoundry.single_controller.process import ProcessWorkerGroup, threads_per_rank
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker

    roles = {"rollout": ClassWithInitArgs(ActorRolloutRefWorker, config=worker_config, role="rollout")}
    cls = create_colocated_worker_cls(roles, WorkerRuntime(device=device))
    if ranks == 1:
        group = LocalWorkerGroup(cls, name_prefix="generation").spawn(roles.keys())["rollout"]
    else:
        import torch.distributed as dist

        # rank 0 in this process unless it already belongs to a group (a caller's in-process run)
        group = ProcessWorkerGroup(cls, ranks, name_prefix="generation", host_rank_zero=not dist.is_initialized(),
                                   threads=threads_per_rank(ranks)).spawn(roles.keys())["rollout"]
    group.init_model()
    return group


def generate_responses(group: WorkerGroup, tokenizer: Any, prompt_ids: list[list[int]], n: int, batch_size: int,
                       do_sample: bool) -> list[list[str]]:
    """``n`` decoded responses per prompt, ``batch_size`` prompts per call (padded to the group's ranks)."""
    from rlfoundry.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto
    from rlfoundry.rewards.rule import response_lengths
    from rlfoundry.utils.tokenizer import pad_id
    from rlfoundry.utils.torch_functional import left_padded

    out_texts: list[list[str]] = []
    for start in range(0, len(prompt_ids), batch_size):
        rows = prompt_ids[start:start + batch_size]
        data = DataProto.from_dict(tensors=left_padded(rows, pad_id(tokenizer)),
                                   meta_info={"n": n, "do_sample": do_sample})
        padded, pad = pad_dataproto_to_divisor(data, group.world_size)
        print(f"rlfoundry: generating for prompts {start + 1}-{start + len(rows)} of {len(prompt_ids)}", flush=True)
        out = unpad_dataproto(group.generate_sequences(padded), pad * n)
        responses, lengths = out.batch["responses"].cpu(), response_lengths(out).tolist()
        texts = [tokenizer.decode(responses[j, :lengths[j]].tolist(), skip_special_tokens=True)
                 for j in range(len(out))]
        out_texts += [texts[i * n:(i + 1) * n] for i in range(len(rows))]  # the engine interleaves a prompt's n
    return out_texts


def write_responses(table: pa.Table, responses: list[list[str]], output_path: str, key: str) -> Path:
    """``table`` with a ``responses`` column (replacing one it had), written to ``output_path``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out = Path(os.path.expanduser(output_path))
    column = pa.array(responses, type=pa.list_(pa.string()))
    if "responses" in table.column_names:
        table = table.drop_columns(["responses"])
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table.append_column("responses", column), out)
    except OSError as e:
        raise ConfigError(f"{key}={output_path}: cannot write it ({e.strerror or e}); give a writable path.") from e
    print(f"rlfoundry: wrote {len(responses)} rows with {len(responses[0]) if responses else 0} responses each "
          f"to {out}", flush=True)
    return out
