"""On-policy distillation's teachers, on the driver's side (docs/distillation.md).

Each teacher of ``distillation.teacher_models`` is a worker group of the reference role
(``ActorRolloutRefWorker``, role ``ref``) loaded from the teacher's checkpoint, colocated with the
trainer: its ``compute_ref_log_prob`` is a forward pass of the teacher over the student's sequences,
giving the teacher's log-prob of every sampled response token. A row goes to the teacher whose ``key``
equals the row's ``distillation.teacher_key`` column (``data_source`` by default); with one teacher,
every row goes to it (as in verl). The result is the batch key ``teacher_logprobs`` (B, Tr), verl's name;
for a top-k loss (``distillation_loss.topk`` = k) ``teacher_logprobs`` and ``teacher_ids`` (B, Tr, k)
instead: the teacher's k likeliest tokens at each response position and their log-probs (verl's names
and layout, its ``prompt_logprobs=k`` request cut to the response positions).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
import torch

from rlfoundry.config.distillation import resolve_teachers
from rlfoundry.config.schema import DISTILLATION_TOPK_MODES
from rlfoundry.protocol import DataProto, pad_dataproto_to_divisor, unpad_dataproto

__all__ = ["teacher_roles", "teacher_worker_config", "teacher_topk", "route_rows", "teacher_log_probs",
           "TEACHER_TEMPERATURE"]

# verl scores with temperature 1 whatever the teacher's inference.temperature says: a forward pass over
# given tokens samples nothing, and the distillation target is the teacher's own distribution
TEACHER_TEMPERATURE = 1.0


def teacher_roles(distillation: Any) -> dict[str, str]:
    """Routing key -> the worker role name of its teacher (``teacher0``, ``teacher1`` ... in config order)."""
    if not distillation.enabled:
        return {}
    return {key: f"teacher{i}" for i, key in enumerate(resolve_teachers(distillation))}


def teacher_worker_config(actor_rollout_ref: Any, teacher: Any) -> dict[str, Any]:
    """``actor_rollout_ref`` for a teacher's worker: the reference role's engine settings (strategy, FSDP,
    log-prob micro-batching) on ``teacher.model_path``, computing in ``teacher.inference.dtype``."""
    from rlfoundry.config.typed import plain

    arr = plain(actor_rollout_ref)
    ref = arr["ref"]
    ref["fsdp_config"]["mixed_precision"] = {**ref["fsdp_config"].get("mixed_precision", {}),
                                             "param_dtype": teacher.inference.dtype}
    model = {"path": teacher.model_path, "trust_remote_code": arr["model"].get("trust_remote_code", False),
             "cpu_kernels": arr["model"]["cpu_kernels"]}
    return {"model": model, "ref": ref, "rollout": {"temperature": TEACHER_TEMPERATURE}}


def teacher_topk(distillation: Any) -> int:
    """k of the teacher's top-k distribution a top-k loss reads; 0 (the sampled token's log-prob) otherwise."""
    loss = distillation.distillation_loss
    return loss.topk if loss.loss_mode in DISTILLATION_TOPK_MODES else 0


def route_rows(column: np.ndarray | None, rows: int, keys: list[str], teacher_key: str) -> dict[str, np.ndarray]:
    """Row indices per teacher for a batch of ``rows`` rows. One teacher takes every row; several need
    ``column`` (the batch's ``teacher_key`` values, (B,)) to hold only configured keys."""
    if len(keys) == 1:
        return {keys[0]: np.arange(rows)}
    if column is None:
        raise KeyError(f"distillation.teacher_key={teacher_key}: the batch has no such non-tensor column; "
                       "route by a column the dataset writes (data_source, or one in extra fields).")
    values = np.asarray([str(v) for v in column])
    unknown = sorted(set(values) - set(keys))
    if unknown:
        raise ValueError(f"distillation: rows with {teacher_key}={unknown} have no teacher (configured keys: {keys}); "
                         f"add +distillation.teacher_models.<name>.key=<value> for each.")
    return {key: np.nonzero(values == key)[0] for key in keys}


def teacher_log_probs(batch: DataProto, groups: Mapping[str, Any], teacher_key: str,
                      topk: int = 0) -> dict[str, torch.Tensor]:
    """``teacher_logprobs`` (B, Tr), or with ``topk`` k > 0 ``teacher_logprobs`` and ``teacher_ids`` (B, Tr, k):
    each row scored by its own teacher's worker group (``groups``: routing key -> group). Rows are padded
    to a multiple of each group's rank count and unpadded after."""
    column = batch.non_tensor_batch.get(teacher_key)
    routes = route_rows(column, len(batch), list(groups), teacher_key)
    # the worker's output -> the batch key, verl's names
    names = {"ref_topk_log_probs": "teacher_logprobs", "ref_topk_ids": "teacher_ids"} if topk else \
        {"ref_log_prob": "teacher_logprobs"}
    out: dict[str, torch.Tensor] = {}
    for key, rows in routes.items():
        if len(rows) == 0:
            continue
        # the whole rows: a vision-language teacher's forward reads the rows' image inputs too
        part = batch.select_idxs(rows)
        part.meta_info = {**batch.meta_info, "temperature": TEACHER_TEMPERATURE, "topk": topk}
        padded, pad = pad_dataproto_to_divisor(part, groups[key].world_size)
        scored = unpad_dataproto(groups[key].compute_ref_log_prob(padded), pad)
        for source, name in names.items():
            values = scored.batch[source]
            values = values if values.dtype == torch.long else values.float()
            out.setdefault(name, values.new_zeros((len(batch), *values.shape[1:])))[torch.as_tensor(rows)] = values
    return out
