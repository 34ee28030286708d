"""Rule scoring's parts: decode a batch into samples, decide where ``compute_score`` runs, validate
what it returned, and gather ``reward_extra_info``. ``RuleRewardManager.score_rule`` puts them
together (its ``score_samples`` and ``postprocess`` are the hooks subclasses override); the pool's
life cycle is ``pool.LazyScoringPool``'s and combining with model scores is ``combine``'s.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any, Callable

import numpy as np
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.rewards.combine import RuleScores
from rlfoundry.rewards.default import IN_DRIVER_SOURCES
from rlfoundry.rewards.pool import Outcome


@dataclass(frozen=True)
class RuleOptions:
    """How rule scores are computed: the ``reward_model.reward_kwargs`` of the table in
    ``reward_manager``'s docstring, other than the weights."""

    timeout_s: float = 30.0
    failure_score: float = 0.0
    num_workers: int | None = None  # None: see scores_in_driver
    pool_min_batch: int = 1
    mp_start_method: str | None = None
    compute_score_kwargs: Mapping | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", float(self.timeout_s))
        object.__setattr__(self, "failure_score", float(self.failure_score))

    @property
    def workers(self) -> int:
        """Scorer processes: ``num_workers``, or min(4, CPUs) when unset."""
        return min(4, os.cpu_count() or 1) if self.num_workers is None else int(self.num_workers)

    def bind(self, compute_score: Callable) -> Callable:
        """The built-in scorer with ``compute_score_kwargs`` bound; a partial of a module-level
        function still pickles into the scoring pool's processes."""
        kwargs = dict(self.compute_score_kwargs or {})
        return functools.partial(compute_score, **kwargs) if kwargs else compute_score


RULE_OPTION_KEYS = tuple(f.name for f in fields(RuleOptions))


@dataclass
class Sample:
    """One row as the scorer sees it."""

    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Any
    response_length: int


@dataclass
class Scored:
    """A sample's final score, its extra metrics and, if it failed, why."""

    score: float
    extras: dict
    error: str | None = None
    detail: str = ""


def response_lengths(data: DataProto) -> torch.Tensor:
    """(B,) extent of each response: one past its last valid token (``response_mask`` if present,
    else the mask's tail). A single-turn mask is a prefix, so this is its sum; a multi-turn mask has
    holes where tool messages sit, and its extent ends at the policy's last sampled token, where
    the outcome reward belongs."""
    batch = data.batch
    width = batch["responses"].shape[-1]
    mask = batch["response_mask"] if "response_mask" in batch.keys() else batch["attention_mask"][:, -width:]
    positions = torch.arange(1, width + 1, device=mask.device)
    return (mask.bool() * positions).max(dim=-1).values.long()


def decode_samples(data: DataProto, tokenizer: Any, reward_fn_key: str) -> list[Sample]:
    """Decode each valid response (special tokens dropped) and pair it with its ground truth.

    A multi-turn row (``last_turn_start``, from the agent loop) is scored on its final assistant
    turn, and its ``extra_info`` gains ``num_turns``, ``tool_reward`` and ``turn_scores`` (those its
    agent loop gave), as verl's managers do."""
    lengths = response_lengths(data).tolist()
    responses, nt = data.batch["responses"], data.non_tensor_batch
    starts = nt.get("last_turn_start", np.zeros(len(lengths), dtype=object))
    texts = tokenizer.batch_decode([responses[i, int(starts[i] or 0):n].tolist() for i, n in enumerate(lengths)],
                                   skip_special_tokens=True)
    if reward_fn_key not in nt or "reward_model" not in nt:
        raise KeyError(
            f"batch lacks non-tensor column {reward_fn_key!r} (data.reward_fn_key) or 'reward_model'; "
            f"it has {sorted(nt)}. Rows must come from a verl-format RLHFDataset"
        )
    extra = nt.get("extra_info", np.full(len(texts), None, dtype=object))
    return [
        Sample(str(nt[reward_fn_key][i]), texts[i], _ground_truth(nt["reward_model"][i]), _with_turns(extra[i], nt, i),
               lengths[i])
        for i in range(len(texts))
    ]


def _with_turns(extra: Any, nt: dict, i: int) -> Any:
    """A multi-turn row's ``extra_info`` with its turn count, tool reward and interaction scores, where
    its loop gave them (a copy; the batch keeps its own)."""
    if "num_turns" not in nt:
        return extra
    added = {"num_turns": int(nt["num_turns"][i])}
    if nt.get("tool_reward") is not None and nt["tool_reward"][i] is not None:
        added["tool_reward"] = float(nt["tool_reward"][i])
    if nt.get("turn_scores") is not None and nt["turn_scores"][i]:
        added["turn_scores"] = list(nt["turn_scores"][i])
    return {**(extra if isinstance(extra, dict) else {}), **added}


def _ground_truth(reward_model: Any) -> Any:
    return reward_model.get("ground_truth") if isinstance(reward_model, dict) else None


def scores_in_driver(calls: list[dict], options: RuleOptions, default_scorer: bool) -> bool:
    """Whether ``calls`` run in the driver rather than the pool: no pool (``num_workers`` 0), a batch
    under ``pool_min_batch``, or, with ``num_workers`` unset, the built-in scorer on sources that
    all finish in bounded time (``IN_DRIVER_SOURCES``).

    The built-in scorers take ``data_source`` (naive, dapo) or ``data_sources`` (batch), so the
    calls themselves say which scorer code will run.
    """
    if options.workers <= 0 or len(calls) < options.pool_min_batch:
        return True
    if options.num_workers is not None or not default_scorer:
        return False
    sources = [src for call in calls for src in call.get("data_sources", [call.get("data_source")])]
    return all(src in IN_DRIVER_SOURCES for src in sources)


def interpret(outcome: Outcome, failure_score: float) -> Scored:
    """Turn what the scorer returned into a Scored; anything but a finite number is a failure."""
    if outcome.error is not None:
        return Scored(failure_score, {}, outcome.error, outcome.detail)
    value = outcome.value
    extras = dict(value) if isinstance(value, dict) else {}
    raw = extras.get("score") if isinstance(value, dict) else value
    if isinstance(raw, (Real, np.number, np.bool_)) and math.isfinite(float(raw)):
        return Scored(float(raw), extras)
    detail = f"scorer returned {value!r:.200}; expected a finite number or a dict with a numeric 'score'"
    return Scored(failure_score, {}, "bad_return", detail)


def extra_info_columns(scored: list[Scored]) -> dict[str, list]:
    """``{key: list of B}`` over every key any sample reported; missing -> NaN (numeric) or None."""
    keys = list(dict.fromkeys(k for s in scored for k in s.extras))
    columns = {}
    for key in keys:
        present = [s.extras[key] for s in scored if key in s.extras]
        numeric = all(isinstance(v, (Real, np.number)) for v in present)
        fill = float("nan") if numeric else None
        columns[key] = [s.extras.get(key, fill) for s in scored]
    return columns


def rule_scores(samples: list[Sample], scored: list[Scored]) -> RuleScores:
    """What the combiner needs from rule scoring."""
    return RuleScores(values=[s.score for s in scored], lengths=torch.tensor([s.response_length for s in samples]),
                      errors=[s.error for s in scored], extra_info=extra_info_columns(scored))
