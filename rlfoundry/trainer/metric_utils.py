"""Per-step metrics with verl's names, computed by pure functions the training loop only merges.

- ``compute_data_metrics``        scores, rewards, advantages, returns, values, lengths
- ``compute_timing_metrics``      ``timing_s/<phase>`` and ``timing_per_token_ms/<phase>``
- ``compute_throughout_metrics``  ``perf/total_num_tokens``, ``perf/time_per_step``, ``perf/throughput``
  (verl's spelling of "throughput" in the function name is kept so user code ports over)
- ``process_validation_metrics``  ``val-core/<data_source>/<var>/mean@N`` and friends
- ``reduce_metrics``              ``{name: [values from ranks/micro-batches]}`` -> ``{name: mean}``
- ``marked_timer``                context manager adding a phase's wall time to ``timing_raw``

Every function takes tensors/lists and returns ``dict[str, float]``; none reads config or globals.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch

from rlfoundry.protocol import DataProto

__all__ = [
    "compute_data_metrics",
    "compute_timing_metrics",
    "compute_throughout_metrics",
    "process_validation_metrics",
    "reduce_metrics",
    "marked_timer",
    "multi_turn_metrics",
]

# Phases whose cost scales with every token of the sequence (prompt + response); generation is
# charged per response token only, because prompt prefill is cheap next to decoding.
_FULL_SEQUENCE_PHASES = ("ref", "old_log_prob", "values", "adv", "update_critic", "update_actor", "reward")


# --------------------------------------------------------------------------- helpers

def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    """``{prefix}/mean``, ``/max``, ``/min`` of a 1-D tensor; an empty tensor gives NaN (not an error)."""
    if values.numel() == 0:
        nan = float("nan")
        return {f"{prefix}/mean": nan, f"{prefix}/max": nan, f"{prefix}/min": nan}
    values = values.detach().float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _masks(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt_mask (B, Tp), response_mask (B, Tr)) as bool, split from ``attention_mask`` at Tr.

    ``response_mask`` (1 up to and including EOS) is preferred when the rollout wrote it; older
    batches only have ``attention_mask``, whose last Tr columns mark the response.
    """
    t_resp = batch.batch["responses"].shape[-1]
    attention = batch.batch["attention_mask"].bool()
    prompt_mask = attention[:, : attention.shape[-1] - t_resp]
    if "response_mask" in batch.batch.keys():
        return prompt_mask, batch.batch["response_mask"].bool()
    return prompt_mask, attention[:, -t_resp:]


def _lengths(batch: DataProto) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (prompt_length, response_length) as float tensors of shape (B,)."""
    prompt_mask, response_mask = _masks(batch)
    return prompt_mask.sum(-1).float(), response_mask.sum(-1).float()


def _length_metrics(prefix: str, lengths: torch.Tensor, max_length: int) -> dict[str, float]:
    """Mean/max/min plus ``clip_ratio``: the share of sequences that hit the length budget."""
    out = _stats(prefix, lengths)
    hit = (lengths == max_length).float()
    out[f"{prefix}/clip_ratio"] = hit.mean().item() if hit.numel() else float("nan")
    return out


def _explained_variance(returns: torch.Tensor, values: torch.Tensor) -> float:
    """1 - Var[returns - values] / Var[returns] over valid tokens: 1 is a perfect critic, 0 no better
    than a constant. The 1e-5 keeps a constant-return batch (Var = 0) finite, as in verl."""
    if returns.numel() < 2:
        return float("nan")
    residual_var = torch.var(returns - values)
    return (1.0 - residual_var / (torch.var(returns) + 1e-5)).item()


# --------------------------------------------------------------------------- data metrics

def compute_data_metrics(batch: DataProto, use_critic: bool = True) -> dict[str, float]:
    """Statistics of one training batch after advantages are computed.

    Reads ``token_level_scores``, ``token_level_rewards``, ``advantages``, ``returns`` (B, Tr),
    ``values`` (B, Tr, only when ``use_critic``), ``responses`` (B, Tr), ``attention_mask``
    (B, Tp+Tr) and ``response_mask`` (B, Tr, optional). Scores/rewards are per sequence (sum over
    tokens); advantages/returns/values are per valid response token. With the rollout's MTP draft,
    ``mtp_draft_tokens`` / ``mtp_accepted_tokens`` (B,) give ``rollout/mtp_accept_rate`` (accepted / drafted).
    """
    tensors = batch.batch
    prompt_mask, response_mask = _masks(batch)
    prompt_len, response_len = prompt_mask.sum(-1).float(), response_mask.sum(-1).float()
    metrics: dict[str, float] = {}
    metrics |= _stats("critic/score", tensors["token_level_scores"].sum(-1))
    metrics |= _stats("critic/rewards", tensors["token_level_rewards"].sum(-1))
    metrics |= _stats("critic/advantages", tensors["advantages"][response_mask])
    metrics |= _stats("critic/returns", tensors["returns"][response_mask])
    if use_critic:
        values = tensors["values"][response_mask].float()
        metrics |= _stats("critic/values", values)
        metrics["critic/vf_explained_var"] = _explained_variance(tensors["returns"][response_mask].float(), values)
    metrics |= _length_metrics("response_length", response_len, response_mask.shape[-1])
    # the prompt budget, not the batch's width: the trainer trims prompt padding to the longest prompt
    max_prompt = int(batch.meta_info.get("max_prompt_length", prompt_mask.shape[-1]))
    metrics |= _length_metrics("prompt_length", prompt_len, max_prompt)
    if "mtp_draft_tokens" in tensors.keys():  # the HF rollout's MTP draft (workers/rollout/mtp_speculative.py)
        drafted = float(tensors["mtp_draft_tokens"].sum())
        metrics["rollout/mtp_accept_rate"] = float(tensors["mtp_accepted_tokens"].sum()) / max(drafted, 1.0)
    return metrics | multi_turn_metrics(batch.non_tensor_batch)


# --------------------------------------------------------------------------- timing and throughput

def _token_counts(batch: DataProto) -> dict[str, int]:
    """Tokens each phase processes: generation makes response tokens; the others read whole sequences."""
    prompt_len, response_len = _lengths(batch)
    n_response = int(response_len.sum().item())
    n_overall = int(prompt_len.sum().item()) + n_response
    return {"gen": n_response, **{phase: n_overall for phase in _FULL_SEQUENCE_PHASES}}


def compute_timing_metrics(batch: DataProto, timing_raw: Mapping[str, float]) -> dict[str, float]:
    """``timing_s/<phase>`` for every timed phase, and ``timing_per_token_ms/<phase>`` for the phases
    whose token count is known (see ``_token_counts``), so runs with different lengths compare."""
    counts = _token_counts(batch)
    metrics = {f"timing_s/{name}": float(seconds) for name, seconds in timing_raw.items()}
    for name, seconds in timing_raw.items():
        if name in counts and counts[name] > 0:
            metrics[f"timing_per_token_ms/{name}"] = 1000.0 * float(seconds) / counts[name]
    return metrics


def _total_tokens(batch: DataProto) -> int:
    """Valid tokens in the batch: the rollout's ``meta_info['global_token_num']`` (per-sequence
    counts) when present, else the ``attention_mask`` sum (the same number, computed here)."""
    per_sequence = batch.meta_info.get("global_token_num")
    if per_sequence is not None:
        return int(sum(per_sequence))
    return int(batch.batch["attention_mask"].sum().item())


def compute_throughout_metrics(batch: DataProto, timing_raw: Mapping[str, float], n_gpus: int) -> dict[str, float]:
    """Tokens per second per worker over the whole step (``timing_raw['step']``).

    ``n_gpus`` is the number of workers the step ran on (GPUs, or worker processes on CPU); dividing
    by it makes the number comparable between a 1-worker laptop run and an 8-GPU node.
    """
    total = _total_tokens(batch)
    step_time = float(timing_raw["step"])
    throughput = total / (step_time * max(1, n_gpus)) if step_time > 0 else float("nan")
    return {"perf/total_num_tokens": total, "perf/time_per_step": step_time, "perf/throughput": throughput}


# --------------------------------------------------------------------------- validation

def _bootstrap_best_worst(values: np.ndarray, k: int, n_boot: int, rng: np.random.Generator) -> tuple[float, float]:
    """Expected max and min of ``k`` draws (with replacement) from one prompt's ``values``.

    best@k estimates pass@k-style "one of k samples is right" without generating more samples.
    """
    draws = rng.choice(values, size=(n_boot, k), replace=True)
    return float(draws.max(axis=1).mean()), float(draws.min(axis=1).mean())


def _sample_sizes(n: int) -> list[int]:
    """Subsample sizes reported for a group of ``n``: 2, 4, 8, ... below ``n``, then ``n`` itself."""
    sizes, k = [], 2
    while k < n:
        sizes.append(k)
        k *= 2
    return sizes + [n]


def _group_metrics(values: np.ndarray, rng: np.random.Generator, n_boot: int) -> dict[str, float]:
    """Metrics of one prompt's ``n`` samples of one variable."""
    n = len(values)
    # NaN marks a sample whose scorer failed (reward managers fill numeric extra info so): it has no
    # value to average, and must not turn the prompt's (and the data source's) metric into NaN.
    values = values[~np.isnan(values)]
    if len(values) == 0:
        return {}
    out = {f"mean@{n}": float(values.mean())}
    if n > 1:
        out[f"std@{n}"] = float(values.std())
        for k in _sample_sizes(n):
            best, worst = _bootstrap_best_worst(values, k, n_boot, rng)
            out[f"best@{k}/mean"], out[f"worst@{k}/mean"] = best, worst
    return out


def _numeric_vars(infos_dict: Mapping[str, Sequence[Any]], n_rows: int) -> dict[str, np.ndarray]:
    """The per-sample variables that are numbers (a scorer may also return strings such as 'pred')."""
    out = {}
    for name, column in infos_dict.items():
        if len(column) != n_rows:
            raise ValueError(f"infos_dict[{name!r}] has {len(column)} entries but there are {n_rows} samples")
        try:
            out[name] = np.asarray(column, dtype=np.float64)
        except (TypeError, ValueError):
            continue
    return out


def process_validation_metrics(
    data_sources: Sequence[str],
    sample_inputs: Sequence[str],
    infos_dict: Mapping[str, Sequence[Any]],
    seed: int = 42,
    n_boot: int = 1000,
) -> dict[str, float]:
    """Validation metrics per data source, averaged over prompts.

    Samples are grouped by ``(data_source, prompt)``: the ``N`` samples of one prompt form a group.
    For each numeric variable in ``infos_dict`` (``reward`` always; ``acc`` and others when the scorer
    returns them) this gives ``mean@N``, ``std@N`` and bootstrapped ``best@k/mean`` / ``worst@k/mean``.
    The headline numbers, ``mean@N`` of ``reward`` and ``acc`` at the largest ``N``, are named
    ``val-core/<data_source>/<var>/mean@N``; the rest ``val-aux/...``. ``seed`` fixes the bootstrap.
    """
    variables = _numeric_vars(infos_dict, len(data_sources))
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, (source, prompt) in enumerate(zip(data_sources, sample_inputs, strict=True)):
        groups[(str(source), str(prompt))].append(i)
    rng = np.random.default_rng(seed)
    per_source: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for (source, _), rows in groups.items():
        for var, column in variables.items():
            for metric, value in _group_metrics(column[rows], rng, n_boot).items():
                per_source[source][f"{var}/{metric}"].append(value)
    return _name_validation_metrics(per_source, max(map(len, groups.values()), default=1))


def _name_validation_metrics(per_source: Mapping[str, Mapping[str, list[float]]], n_max: int) -> dict[str, float]:
    out = {}
    for source, metrics in per_source.items():
        for name, values in metrics.items():
            var, metric = name.split("/", 1)
            core = var in ("reward", "acc") and metric == f"mean@{n_max}"
            out[f"{'val-core' if core else 'val-aux'}/{source}/{name}"] = float(np.mean(values))
    return out


# --------------------------------------------------------------------------- reduction and timing

def reduce_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Mean of each metric's list (workers and micro-batches each report one value per entry)."""
    out = {}
    for name, values in metrics.items():
        if isinstance(values, (list, tuple, np.ndarray)):
            out[name] = float(np.mean([float(v) for v in values])) if len(values) else float("nan")
        else:
            out[name] = float(values)
    return out


@contextmanager
def marked_timer(name: str, timing_raw: dict[str, float]) -> Iterator[None]:
    """Add the wall time of the block to ``timing_raw[name]`` (seconds).

    Times accumulate, so a phase entered twice in one step (e.g. generation then a ReMax greedy
    baseline under the same name) reports its total. The block is also labelled for
    ``torch.profiler`` so phases show up by name in a ``trainer.profile_steps`` trace.
    """
    start = time.perf_counter()
    try:
        with torch.profiler.record_function(name):
            yield
    finally:
        timing_raw[name] = timing_raw.get(name, 0.0) + time.perf_counter() - start


def multi_turn_metrics(non_tensor_batch: dict[str, np.ndarray]) -> dict[str, float]:
    """``num_turns/{mean,min,max}`` over the real rows (a lost sample's and padding rows, ``excluded``, have no
    turns to count), tool calls and errors (by tool and kind), tool reward, the share of trajectories each
    stop reason ended (a trajectory of several rows counted once, by ``trajectory_id``), lost samples,
    conversations dropped by ``openai.max_segments`` and tokenisation check failures; {} for single-turn
    batches. Rows of loops that lack a column (a custom loop, ``single_turn_agent``) hold None there: skipped."""
    if "num_turns" not in non_tensor_batch:
        return {}
    rows = len(non_tensor_batch["num_turns"])
    excluded = np.array([bool(v) for v in non_tensor_batch.get("excluded", [False] * rows)], dtype=bool)
    turns = np.asarray(non_tensor_batch["num_turns"], dtype=np.float64)[~excluded]
    metrics = {"num_turns/mean": float(turns.mean()), "num_turns/min": float(turns.min()),
               "num_turns/max": float(turns.max())} if len(turns) else {}

    def present(key: str) -> list:
        return [v for v in non_tensor_batch.get(key, ()) if v is not None]

    for key in ("tool_calls", "tool_reward"):
        if values := present(key):
            metrics[f"multi_turn/{key}/mean"] = float(np.mean(np.asarray(values, dtype=np.float64)))
    metrics["multi_turn/sanity_check_failures"] = float(sum(bool(v) for v in present("sanity_check_failed")))
    errors: Counter = Counter()
    for row in present("tool_errors"):
        errors.update(row)
    metrics["multi_turn/tool_errors"] = float(sum(errors.values()))
    metrics |= {f"multi_turn/tool_errors/{k}": float(v) for k, v in sorted(errors.items())}
    return metrics | _trajectory_metrics(non_tensor_batch, excluded)


def _trajectory_metrics(columns: dict[str, np.ndarray], excluded: np.ndarray) -> dict[str, float]:
    """Per trajectory (its rows share a ``trajectory_id``, in any order once the batch is balanced): the share
    each stop reason ended (``segment_padding`` rows carry none of their own), ``multi_turn/lost_samples``
    (trajectories without a real row) and ``multi_turn/segments_dropped`` (conversations beyond
    ``max_segments``, summed; every row of a trajectory holds its count)."""
    n = len(excluded)
    ids = columns.get("trajectory_id", np.arange(n))
    reasons = columns.get("stop_reason", np.full(n, None, dtype=object))
    dropped = columns.get("segments_dropped", np.full(n, None, dtype=object))
    stop: dict = {}
    real, counts = set(), {}
    for r in range(n):
        stop.setdefault(ids[r], None)
        if reasons[r] not in (None, "segment_padding"):
            stop[ids[r]] = reasons[r]
        counts[ids[r]] = dropped[r] or 0
        if not excluded[r]:
            real.add(ids[r])
    stops = Counter(v for v in stop.values() if v is not None)
    metrics = {f"multi_turn/stop/{k}": v / len(stop) for k, v in sorted(stops.items())}
    metrics["multi_turn/lost_samples"] = float(len(stop.keys() - real))
    if "segments_dropped" in columns:
        metrics["multi_turn/segments_dropped"] = float(sum(counts.values()))
    return metrics
