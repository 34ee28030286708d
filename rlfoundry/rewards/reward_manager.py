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

Parts: ``rewards/rule.py`` decodes samples, picks the driver or the pool and validates what the
scorer returned (``RuleRewardManager.score_rule`` strings them together); ``rewards/combine.py``
weighs rule, reward-model and judge scores (pure functions); ``pool.LazyScoringPool`` owns the
scorer processes' life cycle. This module holds the managers, their registry and the builder.

Robustness: samples are scored in a ``ScoringPool`` of worker processes with a per-sample timeout,
except, by default, batches that only hold data sources whose built-in scorer finishes in bounded
time (``IN_DRIVER_SOURCES``: arithmetic, gsm8k), which the driver scores itself. A sample whose
scorer raises, times out, kills its process, or returns no finite number gets ``failure_score``
and is counted in ``reward_metrics["reward/errors"]`` (and per kind in ``reward/errors/<kind>``);
the first failure's traceback is logged once per manager. An unknown ``data_source`` with the
default scorer is a configuration error and raises before scoring.

Model rewards: when the batch already holds ``rm_scores`` (written by ``RewardModelWorker``),
``rm_combine="replace"`` (verl's behaviour, the default) returns them as the scores without calling
the rule scorer; ``rm_combine="add"`` returns ``weights.rule`` × rule score + model score (both sit on the last
response token, so the sum is per sequence).

Generative reward model (``rewards/judge.py``): when the batch holds ``judge_scores`` (the judge's
score on the last response token) the result is ``weights.rule`` × rule score + ``weights.judge`` ×
judge score; with the rule weight 0 (the default with a judge) the rule scorer is not called. Each
sample's ``judge_score`` (NaN where the judgement did not parse) and ``judge_error`` reach
``reward_extra_info``; a failed judgement counts in ``reward/errors`` and ``reward/errors/judge``.

Custom functions may be ``async def`` (awaited; in the driver a batch's calls run concurrently, each
within ``timeout_s``). verl's reward loop with a generative reward model (``rewards/reward_loop.py``):
``serve_reward_model`` gives the function the server's ``reward_router_address`` and the model's
``reward_model_tokenizer``; a timeout's warning says whether the server or the function hung.

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
import inspect
import logging
from collections import defaultdict
from typing import Any, Callable

import numpy as np
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.rewards.combine import (  # noqa: F401 - ERROR_KINDS, RM_COMBINE_MODES, place_scores: public names
    ERROR_KINDS,
    RM_COMBINE_MODES,
    JudgeScores,
    RuleScores,
    Weights,
    combine,
    error_metrics,
    place_scores,
    rule_needed,
)
from rlfoundry.rewards.custom import (
    RewardFunctionError,
    ServedRewardFunction,
    load_custom_reward_fn,
    load_reward_manager_class,
)
from rlfoundry.rewards.default import batch_default_compute_score, check_data_sources, default_compute_score
from rlfoundry.rewards.pool import LazyScoringPool, Outcome, ScoringPool, call_safely, gather_safely
from rlfoundry.rewards.rule import (  # noqa: F401 - decode_samples, response_lengths, extra_info_columns: public names
    RULE_OPTION_KEYS,
    RuleOptions,
    Sample,
    Scored,
    decode_samples,
    extra_info_columns,
    interpret,
    response_lengths,
    rule_scores,
    scores_in_driver,
)

logger = logging.getLogger(__name__)

# reward_kwargs that weigh the sources against each other -> Weights fields
WEIGHT_KEYS = {"rule_weight": "rule", "judge_weight": "judge", "rm_combine": "rm_combine"}


def split_reward_kwargs(kwargs: dict, owner: str = "RuleRewardManager") -> tuple[RuleOptions, Weights]:
    """The manager's keyword arguments (``reward_model.reward_kwargs``) as rule options and weights;
    an unknown one is a TypeError naming the nearest valid key."""
    valid = sorted((*RULE_OPTION_KEYS, *WEIGHT_KEYS))
    for key in kwargs:
        if key not in valid:
            near = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {near[0]!r}?" if near else ""
            raise TypeError(f"{owner} got an unexpected keyword argument {key!r}{hint} (valid: {valid})")
    weights = Weights(**{WEIGHT_KEYS[k]: v for k, v in kwargs.items() if k in WEIGHT_KEYS and v is not None})
    return RuleOptions(**{k: v for k, v in kwargs.items() if k not in WEIGHT_KEYS}), weights


def model_scores(data: DataProto) -> tuple[torch.Tensor | None, JudgeScores | None]:
    """The classifier reward model's ``rm_scores`` and the judge's ``judge_scores`` / ``judge_error``
    when the batch has them."""
    keys = data.batch.keys()
    rm_scores = data.batch["rm_scores"] if "rm_scores" in keys else None
    judge = None
    if "judge_scores" in keys:
        judge = JudgeScores(data.batch["judge_scores"], list(data.non_tensor_batch["judge_error"]))
    return rm_scores, judge


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
    """Rule scoring of a batch, combined with the model scores it carries; subclasses change how
    samples are scored (``score_samples``) or shaped afterwards (``postprocess``).

    Keyword arguments are ``reward_model.reward_kwargs`` (the table above): ``timeout_s``,
    ``failure_score``, ``num_workers``, ``pool_min_batch``, ``mp_start_method``,
    ``compute_score_kwargs`` (``self.options``) and ``rm_combine``, ``rule_weight``, ``judge_weight``
    (``self.weights``; ``load_reward_manager`` fills the last two from ``reward.weights``).
    """

    default_compute_score: Callable = staticmethod(default_compute_score)

    def __init__(self, tokenizer: Any, num_examine: int = 0, compute_score: Callable | None = None,
                 reward_fn_key: str = "data_source", **reward_kwargs: Any) -> None:
        self.options, self.weights = split_reward_kwargs(reward_kwargs, type(self).__name__)
        if compute_score is not None and self.options.compute_score_kwargs:
            raise ValueError("compute_score_kwargs are for the built-in scorer; a custom reward function takes "
                             "custom_reward_function.reward_kwargs")
        self.tokenizer, self.num_examine, self.reward_fn_key = tokenizer, num_examine, reward_fn_key
        self.compute_score = compute_score or self.options.bind(self.default_compute_score)
        self.uses_default_scorer = compute_score is None
        self.pool = self._make_pool()  # scorer processes, when options allow them
        self.reward_server = None  # verl's reward loop: the reward-model server the function calls
        self._logged_first_error = False
        self.last_metrics: dict[str, int] = error_metrics()

    def _make_pool(self) -> LazyScoringPool | None:
        if self.options.workers <= 0:
            return None
        return LazyScoringPool(self.compute_score, self.options.workers, self.options.timeout_s,
                               self.options.mp_start_method)

    def serve_reward_model(self, server: Any) -> None:
        """verl's reward loop: the custom function gets ``server``'s address and its model's tokenizer
        (``rewards/reward_loop.py``); scorer processes start anew with the function so bound."""
        self.compute_score = ServedRewardFunction(self.compute_score, server.address, server.model_path,
                                                  server.tokenizer, getattr(server, "trust_remote_code", False))
        self.reward_server = server
        self.close()
        self.pool = self._make_pool()

    def __call__(self, data: DataProto, return_dict: bool = False) -> torch.Tensor | dict:
        rm_scores, judge = model_scores(data)
        rule = self.score_rule(data) if rule_needed(self.weights, rm_scores is not None, judge is not None) else None
        combined = combine(self.weights, data.batch["responses"].shape[-1], rule, rm_scores, judge)
        if combined.metrics["reward/errors/judge"]:
            self._report_judge_errors(judge)
        self.last_metrics = combined.metrics
        if not return_dict:
            return combined.scores
        return {"reward_tensor": combined.scores, "reward_extra_info": combined.extra_info,
                "reward_metrics": dict(combined.metrics)}

    def score_rule(self, data: DataProto) -> RuleScores:
        """Decode, score (``score_samples``), validate, shape (``postprocess``), report."""
        samples = decode_samples(data, self.tokenizer, self.reward_fn_key)
        if self.uses_default_scorer:
            check_data_sources(s.data_source for s in samples)
        scored = [interpret(o, self.options.failure_score) for o in self.score_samples(samples)]
        self.postprocess(samples, scored)
        self._report_errors(samples, scored)
        self._examine(data, samples, scored)
        return rule_scores(samples, scored)

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
        if self.pool is None or scores_in_driver(calls, self.options, self.uses_default_scorer):
            if getattr(self.compute_score, "is_async", False):  # concurrently, as verl's reward loop awaits them
                return gather_safely(self.compute_score, calls, timeout_s or self.options.timeout_s)
            return [call_safely(self.compute_score, call) for call in calls]
        return self.pool.map(calls, timeout_s)

    @property
    def _pool(self) -> ScoringPool | None:
        """The running scorer processes, if any (None until a batch needed them)."""
        return self.pool.running if self.pool is not None else None

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
                scored[first].error, first, samples[first].data_source, self.options.failure_score,
                scored[first].detail,
            )
        kinds = {k: v for k, v in error_metrics([s.error for s in scored]).items() if v and k != "reward/errors"}
        logger.warning("reward: %d of %d samples failed %s", len(failed), len(scored), kinds)
        if self.reward_server is not None and kinds.get("reward/errors/timeout"):
            logger.warning("reward: timeout_s=%g passed; %s", self.options.timeout_s, self.reward_server.busy())

    def _report_judge_errors(self, judge: JudgeScores) -> None:
        failed = [err for err in judge.errors if err]
        kinds = {kind: failed.count(kind) for kind in dict.fromkeys(failed)}
        logger.warning("reward: the judge's verdict on %d of %d samples did not parse %s; they get its "
                       "failure_score", len(failed), len(judge.errors), kinds)

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

    def close(self) -> None:
        """Stop the scorer processes (also happens at interpreter exit: they are daemons)."""
        if self.pool is not None:
            self.pool.close()

    def __enter__(self) -> RuleRewardManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


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
        (outcome,) = self.run_calls([call], timeout_s=self.options.timeout_s * max(1, len(samples)))
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
    named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    valid = set(RULE_OPTION_KEYS) | set(WEIGHT_KEYS)
    for klass in cls.__mro__:
        if "__init__" in vars(klass):
            valid |= {p.name for p in inspect.signature(klass.__init__).parameters.values() if p.kind in named}
    valid -= {"self", "tokenizer", "num_examine", "compute_score", "reward_fn_key"}
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
