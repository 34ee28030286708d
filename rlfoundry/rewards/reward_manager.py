"""Reward managers: a batch of rollouts (DataProto) -> ``token_level_scores`` (B, Tr).

Same interface as verl's (``manager(data, return_dict=False)``), so recipes port over:

- ``naive``: one ``compute_score(data_source=, solution_str=, ground_truth=, extra_info=)`` call per
  sample (``default_compute_score`` unless ``custom_reward_function.path`` is set).
- ``batch``: one call ``compute_score(data_sources=, solution_strs=, ground_truths=, extra_infos=)``
  for the whole batch, returning one score (or dict) per sample.
- ``dapo``: ``naive`` plus DAPO's soft overlong penalty (Yu et al. 2025, "DAPO", sec. 3.4): a
  response longer than ``max_resp_len - overlong_buffer.len`` loses ``penalty_factor`` x the fraction
  of the buffer it used.

The score goes on the last valid response token (``response_mask``, else the response part of
``attention_mask``); every other position is 0. With ``return_dict=True`` the result is
``{"reward_tensor", "reward_extra_info": {name: list of B}, "reward_metrics": {...}}``; extra info
holds every key of dict-valued scores (a failed sample gets NaN for numeric keys, None otherwise).

Robustness: samples are scored in a ``ScoringPool`` of worker processes with a per-sample timeout,
except, by default, batches that only hold data sources whose built-in scorer finishes in bounded
time (``IN_DRIVER_SOURCES``: arithmetic, gsm8k), which the driver scores itself. A sample whose
scorer raises, times out, kills its process, or returns no finite number gets ``failure_score``
and is counted in ``reward_metrics["reward/errors"]`` (and per kind in ``reward/errors/<kind>``);
the first failure's traceback is logged once per manager. An unknown ``data_source`` with the
default scorer is a configuration error and raises before scoring.

Model rewards: when the batch already holds ``rm_scores`` (written by ``RewardModelWorker``),
``rm_combine="replace"`` (verl's behaviour, the default) returns them as the scores without calling
the rule scorer; ``rm_combine="add"`` returns rule score + model score (both sit on the last
response token, so the sum is per sequence).

Generative reward model (``rewards/judge.py``): when the batch holds ``judge_scores`` (the judge's
score on the last response token) the result is ``weights.rule`` × rule score + ``weights.judge`` ×
judge score; with the rule weight 0 (the default with a judge) the rule scorer is not called. Each
sample's ``judge_score`` (NaN where the judgement did not parse) and ``judge_error`` reach
``reward_extra_info``; a failed judgement counts in ``reward/errors`` and ``reward/errors/judge``.

Config (``load_reward_manager``):

| key | default | meaning |
|---|---|---|
| ``reward_model.reward_manager`` | naive | naive, batch or dapo |
| ``reward_model.reward_kwargs.timeout_s`` | 30 | per-sample timeout (the batch manager's one call gets timeout_s x B) |
| ``reward_model.reward_kwargs.failure_score`` | 0.0 | score of a sample whose scorer failed |
| ``reward_model.reward_kwargs.num_workers`` | null | scorer processes; 0 scores in the driver (no timeout or crash isolation; breakpoints work); null: the driver scores a batch whose every data_source is in ``IN_DRIVER_SOURCES`` when the scorer is the built-in one, else min(4, CPUs) processes |
| ``reward_model.reward_kwargs.pool_min_batch`` | 1 | batches smaller than this are scored in the driver |
| ``reward_model.reward_kwargs.mp_start_method`` | forkserver | or spawn |
| ``reward_model.reward_kwargs.rm_combine`` | replace | replace or add (see above) |
| ``reward_model.reward_kwargs.compute_score_kwargs`` | {} | keyword arguments of the built-in scorer (e.g. ``{method: flexible}`` for GSM8K) |
| ``reward_model.sandbox_fusion.url`` | null | code rewards run their programs on this SandboxFusion server (``memory_limit_mb``, ``max_concurrent`` too) instead of this machine's sandbox |
| ``reward.weights.{rule,judge}`` | null, 1 | rule × rule score + judge × judge score (below); rule null: 0 with a judge, else 1 |
| ``reward_model.overlong_buffer.{enable,len,penalty_factor,log}`` | off | dapo only; uses ``data.max_response_length`` |
| ``custom_reward_function.{path,name,reward_kwargs}`` | null | see ``rlfoundry.rewards.custom`` |

verl >= 0.7 spells these under ``reward``: ``reward.reward_manager.name``, ``reward.reward_kwargs``,
``reward.num_workers``, ``reward.compute_score_kwargs``, ``reward.custom_reward_function.*``;
``load_config`` copies them to the places above. ``reward.reward_manager.source=importlib`` takes the
class ``reward.reward_manager.module.name`` from ``module.path`` (a RuleRewardManager subclass).
"""

from __future__ import annotations

import difflib
import functools
import inspect
import logging
import math
import os
import pickle
from collections import defaultdict
from dataclasses import dataclass
from numbers import Real
from typing import Any, Callable

import numpy as np
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.rewards.custom import RewardFunctionError, load_custom_reward_fn, load_reward_manager_class
from rlfoundry.rewards.default import (
    IN_DRIVER_SOURCES,
    batch_default_compute_score,
    check_data_sources,
    default_compute_score,
)
from rlfoundry.rewards.pool import Outcome, ScoringPool, call_safely

logger = logging.getLogger(__name__)

ERROR_KINDS = ("exception", "timeout", "crash", "bad_return", "judge")  # judge: its judgement did not parse
RM_COMBINE_MODES = ("replace", "add")


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
    judge_error: str | None = None  # why the generative reward model's judgement scored failure_score


# ---- batch plumbing (pure functions) ---------------------------------------------------------


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


def place_scores(scores: list[float], lengths: torch.Tensor, width: int) -> torch.Tensor:
    """(B, width) zeros with each score on its sequence's last valid response token."""
    tensor = torch.zeros(len(scores), width, dtype=torch.float32)
    last = torch.clamp(lengths - 1, min=0)  # an empty response still gets its score somewhere (masked out later)
    tensor[torch.arange(len(scores)), last] = torch.tensor(scores, dtype=torch.float32)
    return tensor


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


def error_metrics(scored: list[Scored]) -> dict[str, int]:
    """``reward/errors``: samples with any failed source; ``reward/errors/<kind>``: failures per kind."""
    kinds = [s.error for s in scored if s.error is not None] + ["judge" for s in scored if s.judge_error]
    metrics = {"reward/errors": sum(1 for s in scored if s.error is not None or s.judge_error)}
    metrics.update({f"reward/errors/{kind}": kinds.count(kind) for kind in ERROR_KINDS})
    return metrics


def judge_results(data: DataProto) -> tuple[torch.Tensor, list] | None:
    """The generative reward model's ``judge_scores`` and ``judge_error`` when the batch has them."""
    if "judge_scores" not in data.batch.keys():
        return None
    return data.batch["judge_scores"], list(data.non_tensor_batch["judge_error"])


def judge_only(judge: tuple[torch.Tensor, list]) -> list[Scored]:
    """Per-sample results when the judge alone scores (rule weight 0)."""
    return [Scored(float(row.sum()), {}) for row in judge[0]]


def add_judge_extras(scored: list[Scored], judge: tuple[torch.Tensor, list]) -> None:
    """``judge_score`` (NaN where the judgement failed) and ``judge_error`` into each sample's extras."""
    scores, errors = judge
    for result, row, err in zip(scored, scores, errors):
        result.judge_error = err
        result.extras.update(judge_score=float("nan") if err else float(row.sum()), judge_error=err)


# ---- managers --------------------------------------------------------------------------------

REWARD_MANAGERS: dict[str, type] = {}


def register_reward_manager(name: str) -> Callable[[type], type]:
    """Class decorator: make a manager available as ``reward_model.reward_manager=<name>``."""

    def add(cls: type) -> type:
        if name in REWARD_MANAGERS and REWARD_MANAGERS[name] is not cls:
            raise ValueError(f"reward manager {name!r} is already registered as {REWARD_MANAGERS[name]!r}")
        REWARD_MANAGERS[name] = cls
        return cls

    return add


def get_reward_manager_cls(name: str) -> type:
    if name not in REWARD_MANAGERS:
        raise ValueError(f"unknown reward_model.reward_manager={name!r}; choose one of {sorted(REWARD_MANAGERS)}")
    return REWARD_MANAGERS[name]


class RuleRewardManager:
    """Shared plumbing of the rule-based managers; subclasses change how samples are scored."""

    default_compute_score: Callable = staticmethod(default_compute_score)

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        *,
        timeout_s: float = 30.0,
        failure_score: float = 0.0,
        num_workers: int | None = None,
        pool_min_batch: int = 1,
        mp_start_method: str | None = None,
        rm_combine: str = "replace",
        rule_weight: float | None = None,
        judge_weight: float = 1.0,
        compute_score_kwargs: dict | None = None,
    ) -> None:
        if rm_combine not in RM_COMBINE_MODES:
            raise ValueError(f"rm_combine={rm_combine!r} must be one of {RM_COMBINE_MODES}")
        if compute_score is not None and compute_score_kwargs:
            raise ValueError("compute_score_kwargs are for the built-in scorer; a custom reward function takes "
                             "custom_reward_function.reward_kwargs")
        self.tokenizer, self.num_examine, self.reward_fn_key = tokenizer, num_examine, reward_fn_key
        default = self.default_compute_score
        # a partial of a module-level function still pickles into the scoring pool's processes
        default = functools.partial(default, **compute_score_kwargs) if compute_score_kwargs else default
        self.compute_score = compute_score or default
        self.uses_default_scorer = compute_score is None
        self.timeout_s, self.failure_score = float(timeout_s), float(failure_score)
        self.num_workers = min(4, os.cpu_count() or 1) if num_workers is None else int(num_workers)
        self.pool_min_batch, self.mp_start_method, self.rm_combine = pool_min_batch, mp_start_method, rm_combine
        # reward.weights: None = 0 when a judge scored the batch (it replaces the rule score), else 1
        self.rule_weight, self.judge_weight = rule_weight, float(judge_weight)
        self._pool: ScoringPool | None = None
        self._in_process_only = self.num_workers <= 0
        # with num_workers unset, bounded-time built-in scorers skip the pool (see _bounded_time)
        self._driver_when_bounded = num_workers is None and self.uses_default_scorer
        self._logged_first_error = False
        self.last_metrics: dict[str, int] = error_metrics([])

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict:
        width = data.batch["responses"].shape[-1]
        rm_scores = data.batch["rm_scores"] if "rm_scores" in data.batch.keys() else None
        if rm_scores is not None and self.rm_combine == "replace":
            return self._result(rm_scores, [], return_dict)
        judge = judge_results(data)
        rule_weight = (0.0 if judge else 1.0) if self.rule_weight is None else float(self.rule_weight)
        if judge and rule_weight == 0:  # the judge alone: the rule scorer is not called
            scored = judge_only(judge)
            add_judge_extras(scored, judge)
            self._report_judge_errors(scored)
            return self._result(self.judge_weight * judge[0].float(), scored, return_dict)
        samples = decode_samples(data, self.tokenizer, self.reward_fn_key)
        if self.uses_default_scorer:
            check_data_sources(s.data_source for s in samples)
        scored = [interpret(o, self.failure_score) for o in self.score_samples(samples)]
        self.postprocess(samples, scored)
        lengths = torch.tensor([s.response_length for s in samples])
        tensor = rule_weight * place_scores([s.score for s in scored], lengths, width)
        if rm_scores is not None:
            tensor = tensor + rm_scores.to(tensor.dtype)
        if judge:
            tensor = tensor + self.judge_weight * judge[0].to(tensor.dtype)
            add_judge_extras(scored, judge)
            self._report_judge_errors(scored)
        self._report_errors(samples, scored)
        self._examine(data, samples, scored)
        return self._result(tensor, scored, return_dict)

    def score_samples(self, samples: list[Sample]) -> list[Outcome]:
        """One Outcome per sample (naive: one scorer call each)."""
        calls = [
            {"data_source": s.data_source, "solution_str": s.solution_str,
             "ground_truth": s.ground_truth, "extra_info": s.extra_info}
            for s in samples
        ]
        return self.run_calls(calls)

    def postprocess(self, samples: list[Sample], scored: list[Scored]) -> None:
        """Hook for score shaping after scoring (dapo's overlong penalty)."""

    def run_calls(self, calls: list[dict], timeout_s: float | None = None) -> list[Outcome]:
        """Run compute_score(**call) for each call, in the pool when worthwhile, else in the driver."""
        in_driver = self._in_process_only or len(calls) < self.pool_min_batch or self._bounded_time(calls)
        if in_driver or not self._ensure_pool():
            return [call_safely(self.compute_score, call) for call in calls]
        return self._pool.map(calls, timeout_s)

    def _bounded_time(self, calls: list[dict]) -> bool:
        """Whether the default scorer, unasked for a pool, only meets sources in IN_DRIVER_SOURCES.

        The default scorers take ``data_source`` (naive, dapo) or ``data_sources`` (batch), so the
        calls themselves say which scorer code will run.
        """
        if not self._driver_when_bounded:
            return False
        sources = [src for call in calls for src in call.get("data_sources", [call.get("data_source")])]
        return all(src in IN_DRIVER_SOURCES for src in sources)

    def _ensure_pool(self) -> bool:
        if self._pool is None and not self._in_process_only:
            try:
                pickle.dumps(self.compute_score)
            except Exception as err:  # noqa: BLE001 - any pickling failure means "cannot ship it"
                logger.warning(
                    "reward function %r cannot be pickled (%s); scoring in the driver process without "
                    "timeouts. Use a module-level function or custom_reward_function.path", self.compute_score, err,
                )
                self._in_process_only = True
                return False
            self._pool = ScoringPool(self.compute_score, self.num_workers, self.timeout_s, self.mp_start_method)
        return self._pool is not None

    def _result(self, tensor: torch.Tensor, scored: list[Scored], return_dict: bool) -> torch.Tensor | dict:
        self.last_metrics = error_metrics(scored)
        if not return_dict:
            return tensor
        return {"reward_tensor": tensor, "reward_extra_info": extra_info_columns(scored),
                "reward_metrics": dict(self.last_metrics)}

    def _report_errors(self, samples: list[Sample], scored: list[Scored]) -> None:
        failed = [i for i, s in enumerate(scored) if s.error is not None]
        if not failed:
            return
        first = failed[0]
        if not self._logged_first_error:
            self._logged_first_error = True
            logger.warning(
                "reward function failed (%s) on sample %d (data_source=%s); it gets failure_score=%g. "
                "Later failures are only counted in reward/errors.\n%s",
                scored[first].error, first, samples[first].data_source, self.failure_score, scored[first].detail,
            )
        kinds = {k: v for k, v in error_metrics(scored).items() if v and k != "reward/errors"}
        logger.warning("reward: %d of %d samples failed %s", len(failed), len(scored), kinds)

    def _report_judge_errors(self, scored: list[Scored]) -> None:
        failed = [s.judge_error for s in scored if s.judge_error]
        if failed:
            kinds = {kind: failed.count(kind) for kind in dict.fromkeys(failed)}
            logger.warning("reward: the judge's verdict on %d of %d samples did not parse %s; they get its "
                           "failure_score", len(failed), len(scored), kinds)

    def _examine(self, data: DataProto, samples: list[Sample], scored: list[Scored]) -> None:
        """Print up to ``num_examine`` samples per data source, verl style, for eyeballing."""
        if self.num_examine <= 0:
            return
        shown: dict[str, int] = defaultdict(int)
        for i, (sample, result) in enumerate(zip(samples, scored)):
            if shown[sample.data_source] >= self.num_examine:
                continue
            shown[sample.data_source] += 1
            print("[prompt]", self._prompt_text(data, i))
            print("[response]", sample.solution_str)
            print("[ground_truth]", sample.ground_truth)
            print("[score]", result.score, *(f"[{k}] {v}" for k, v in result.extras.items() if k != "score"))

    def _prompt_text(self, data: DataProto, i: int) -> str:
        if "prompts" not in data.batch.keys():
            return "<no prompts in batch>"
        prompt = data.batch["prompts"][i]
        n_valid = int(data.batch["attention_mask"][i, : prompt.shape[-1]].sum())
        return self.tokenizer.decode(prompt[prompt.shape[-1] - n_valid :].tolist(), skip_special_tokens=True)

    def __getstate__(self) -> dict:
        # A copy shipped to another process (e.g. a Ray task) starts its own pool on first use.
        return {**self.__dict__, "_pool": None}

    def close(self) -> None:
        """Stop the worker processes (also happens at interpreter exit: they are daemons)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown may have torn down modules
            pass


@register_reward_manager("naive")
class NaiveRewardManager(RuleRewardManager):
    """One scorer call per sample (verl's default)."""


@register_reward_manager("batch")
class BatchRewardManager(RuleRewardManager):
    """One scorer call for the whole batch.

    The scorer is called as ``compute_score(data_sources=, solution_strs=, ground_truths=,
    extra_infos=)`` and returns one float or dict per sample.

    For scorers that are faster vectorised (a remote judge, a batched model). The call gets
    ``timeout_s`` x B; if it fails, every sample in the batch gets ``failure_score``.
    """

    default_compute_score = staticmethod(batch_default_compute_score)

    def score_samples(self, samples: list[Sample]) -> list[Outcome]:
        call = {
            "data_sources": [s.data_source for s in samples],
            "solution_strs": [s.solution_str for s in samples],
            "ground_truths": [s.ground_truth for s in samples],
            "extra_infos": [s.extra_info for s in samples],
        }
        (outcome,) = self.run_calls([call], timeout_s=self.timeout_s * max(1, len(samples)))
        if outcome.error is not None:
            return [outcome] * len(samples)
        values = outcome.value
        if not isinstance(values, (list, tuple, np.ndarray)) or len(values) != len(samples):
            size = len(values) if hasattr(values, "__len__") else "?"
            detail = (
                f"batch scorer returned a {type(values).__name__} of length {size}; "
                f"expected a list of {len(samples)}"
            )
            return [Outcome(error="bad_return", detail=detail)] * len(samples)
        return [Outcome(value=v) for v in values]


@register_reward_manager("dapo")
class DAPORewardManager(RuleRewardManager):
    """Naive scoring plus DAPO's soft overlong punishment; float scores are also logged as ``acc``."""

    def __init__(
        self,
        tokenizer: Any,
        num_examine: int = 0,
        compute_score: Callable | None = None,
        reward_fn_key: str = "data_source",
        max_resp_len: int | None = None,
        overlong_buffer_cfg: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(tokenizer, num_examine, compute_score, reward_fn_key, **kwargs)
        cfg = overlong_buffer_cfg
        self.overlong_enable = bool(_get(cfg, "enable", False))
        self.overlong_len = int(_get(cfg, "len", 0) or 0)
        self.overlong_penalty = float(_get(cfg, "penalty_factor", 1.0))
        self.overlong_log = bool(_get(cfg, "log", False))
        self.max_resp_len = max_resp_len
        if self.overlong_enable and (max_resp_len is None or not 0 < self.overlong_len <= max_resp_len):
            raise ValueError(
                f"dapo overlong_buffer.len={self.overlong_len} must be in (0, max_resp_len={max_resp_len}] "
                "(max_resp_len comes from data.max_response_length)"
            )

    def overlong_reward(self, response_length: int) -> float:
        """0 up to max_resp_len - len, then falling linearly to -penalty_factor at max_resp_len."""
        expected = self.max_resp_len - self.overlong_len
        return min(-(response_length - expected) / self.overlong_len * self.overlong_penalty, 0.0)

    def postprocess(self, samples: list[Sample], scored: list[Scored]) -> None:
        for sample, result in zip(samples, scored):
            if result.error is not None:
                continue  # a failed sample keeps exactly failure_score
            if "score" not in result.extras:
                result.extras["acc"] = result.score
            if self.overlong_enable:
                penalty = self.overlong_reward(sample.response_length)
                result.score += penalty
                if self.overlong_log:
                    result.extras.update(overlong_reward=penalty, overlong=penalty < 0)


# ---- building from config --------------------------------------------------------------------


def _get(config: Any, key: str, default: Any = None) -> Any:
    if config is None:
        return default
    value = config.get(key, default) if hasattr(config, "get") else getattr(config, key, default)
    return default if value is None else value


def _check_kwargs(cls: type, kwargs: dict) -> None:
    """Unknown reward_kwargs -> an error naming the nearest valid key."""
    valid = set()
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            valid |= set(inspect.signature(klass.__init__).parameters)
    valid -= {"self", "args", "kwargs", "tokenizer", "num_examine", "compute_score", "reward_fn_key"}
    for key in kwargs:
        if key not in valid:
            near = difflib.get_close_matches(key, sorted(valid), n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise ValueError(
                f"unknown reward_model.reward_kwargs key {key!r} for {cls.__name__}{hint} (valid: {sorted(valid)})"
            )


def _manager_class(config: Any) -> type:
    """``reward.reward_manager.source=importlib``: the class in ``module.{path,name}``; otherwise the
    registered manager named ``reward_model.reward_manager`` (where ``reward.reward_manager.name`` lands)."""
    spec = _get(_get(config, "reward"), "reward_manager")
    if _get(spec, "source", "register") != "importlib":
        return get_reward_manager_cls(_get(_get(config, "reward_model"), "reward_manager", "naive"))
    module = _get(spec, "module")
    cls = load_reward_manager_class(str(_get(module, "path")), _get(module, "name"))
    if not issubclass(cls, RuleRewardManager):
        raise RewardFunctionError(
            f"{cls.__name__} in {_get(module, 'path')} must subclass rlfoundry.rewards.reward_manager.RuleRewardManager "
            "(override score_samples or postprocess); verl's reward-loop managers have another interface")
    return cls


def load_reward_manager(config: Any, tokenizer: Any, num_examine: int = 0, **kwargs: Any) -> RuleRewardManager:
    """Build the manager named by ``reward_model.reward_manager`` from the full config.

    ``kwargs`` override ``reward_model.reward_kwargs``; a custom reward file replaces the default
    scorer; dapo gets ``max_resp_len`` = ``data.max_response_length`` and ``reward_model.overlong_buffer``.
    """
    rm_config = _get(config, "reward_model")
    cls = _manager_class(config)
    options = {**dict(_get(rm_config, "reward_kwargs", {})), **kwargs}
    if issubclass(cls, DAPORewardManager):
        options.setdefault("max_resp_len", _get(_get(config, "data"), "max_response_length"))
        options.setdefault("overlong_buffer_cfg", _get(rm_config, "overlong_buffer"))
    _check_kwargs(cls, options)
    weights = _get(_get(config, "reward"), "weights")  # verl >= 0.7's top-level reward; ours: weights
    options.setdefault("rule_weight", _get(weights, "rule"))
    options.setdefault("judge_weight", _get(weights, "judge", 1.0))
    reward_fn_key = _get(_get(config, "data"), "reward_fn_key", "data_source")
    custom = load_custom_reward_fn(config)
    if custom is None and _sandbox_fusion_kwargs(rm_config):
        options["compute_score_kwargs"] = {**_sandbox_fusion_kwargs(rm_config),
                                           **dict(options.get("compute_score_kwargs") or {})}
    return cls(tokenizer, num_examine, custom, reward_fn_key, **options)


def _sandbox_fusion_kwargs(rm_config: Any) -> dict:
    """verl's ``reward_model.sandbox_fusion.{url, memory_limit_mb, max_concurrent}`` as the code
    scorer's keyword arguments; none without a URL (programs run in this machine's sandbox)."""
    fusion = _get(rm_config, "sandbox_fusion", None) or {}
    if not _get(fusion, "url", None):
        return {}
    return {"sandbox_fusion_url": str(_get(fusion, "url")), "memory_limit_mb": _get(fusion, "memory_limit_mb", None),
            "max_concurrent": int(_get(fusion, "max_concurrent", 64) or 64)}
