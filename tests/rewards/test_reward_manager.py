"""Reward managers: score placement, custom reward files that fail in every way, dapo, rm_scores."""

from __future__ import annotations

import logging
import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.protocol import DataProto
from rlfoundry.rewards import (
    BatchRewardManager,
    DAPORewardManager,
    NaiveRewardManager,
    RewardFunctionError,
    UnknownDataSourceError,
    get_reward_manager_cls,
    load_reward_manager,
)
from rlfoundry.rewards.combine import Weights

TP, TR = 6, 12  # prompt and response widths of the hand-made batches

FLAKY_REWARD = '''
import os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "raise":
        raise ValueError("scorer bug on purpose")
    if solution_str == "sleep":
        time.sleep(60)
    if solution_str == "exit":
        os._exit(7)
    if solution_str == "text":
        return "not a number"
    if solution_str == "dict":
        return {"score": 0.25, "acc": 1.0, "pred": "dict"}
    return float(solution_str == ground_truth)
'''


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


def make_batch(tok, responses: list[str], truths: list[str], sources: list[str] | None = None) -> DataProto:
    """Rollout-shaped batch: left-padded prompts "q", right-padded responses + EOS, response_mask."""
    n = len(responses)
    prompts = torch.full((n, TP), tok.pad_token_id)
    prompts[:, -1] = tok.encode("q")[0]
    resp = torch.full((n, TR), tok.pad_token_id)
    mask = torch.zeros(n, TR, dtype=torch.long)
    for i, text in enumerate(responses):
        ids = tok.encode(text) + [tok.eos_token_id]
        resp[i, : len(ids)], mask[i, : len(ids)] = torch.tensor(ids), 1
    attention = torch.cat([(prompts != tok.pad_token_id).long(), mask], dim=1)
    sources = sources or ["rlfoundry/arithmetic"] * n
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": resp, "response_mask": mask, "attention_mask": attention,
                 "input_ids": torch.cat([prompts, resp], 1)},
        non_tensors={"data_source": np.array(sources, dtype=object),
                     "reward_model": np.array([{"ground_truth": t, "style": "rule"} for t in truths], dtype=object),
                     "extra_info": np.array([{"index": i} for i in range(n)], dtype=object)},
    )


def last_token_scores(tensor: torch.Tensor, batch: DataProto) -> list[float]:
    """The score at each row's last valid response token; asserts every other position is 0."""
    last = batch.batch["response_mask"].sum(-1) - 1
    values = tensor[torch.arange(len(last)), last]
    rest = tensor.clone()
    rest[torch.arange(len(last)), last] = 0
    assert rest.abs().sum() == 0
    return values.tolist()


def test_naive_places_score_on_last_valid_token(tok) -> None:
    batch = make_batch(tok, ["85", "-11", "12"], ["85", "-11", "13"])
    manager = NaiveRewardManager(tok, num_examine=0, num_workers=0)
    scores = manager(batch)
    assert scores.shape == (3, TR) and scores.dtype == torch.float32
    # "85"+EOS -> 3 valid tokens -> index 2; "-11"+EOS -> index 3; "12"+EOS -> index 2
    assert scores[0, 2] == 1.0 and scores[1, 3] == 1.0 and scores[2].abs().sum() == 0
    assert last_token_scores(scores, batch) == [1.0, 1.0, 0.0]


def test_custom_file_failures_get_failure_score_and_are_counted(tok, tmp_path: Path, caplog) -> None:
    path = tmp_path / "flaky_reward.py"
    path.write_text(FLAKY_REWARD)
    config = OmegaConf.create({
        "data": {"reward_fn_key": "data_source"},
        "reward_model": {"reward_manager": "naive",
                         "reward_kwargs": {"timeout_s": 1.0, "failure_score": -1.0, "num_workers": 2}},
        "custom_reward_function": {"path": str(path), "name": "compute_score"},
    })
    manager = load_reward_manager(config, tok, num_examine=0)
    responses = ["85", "raise", "sleep", "exit", "dict", "text", "7", "85"]
    batch = make_batch(tok, responses, ["85"] * 7 + ["85"])
    with caplog.at_level(logging.WARNING, logger="rlfoundry.rewards.reward_manager"):
        out = manager(batch, return_dict=True)
        again = manager(batch, return_dict=True)  # pool restarted its killed workers; same answers
    expected = [1.0, -1.0, -1.0, -1.0, 0.25, -1.0, 0.0, 1.0]
    assert last_token_scores(out["reward_tensor"], batch) == expected
    assert last_token_scores(again["reward_tensor"], batch) == expected
    assert out["reward_metrics"] == {"reward/errors": 4, "reward/errors/exception": 1, "reward/errors/timeout": 1,
                                     "reward/errors/crash": 1, "reward/errors/bad_return": 1, "reward/errors/judge": 0}
    extra = out["reward_extra_info"]
    assert extra["score"][4] == 0.25 and extra["pred"][4] == "dict" and extra["pred"][0] is None
    assert extra["acc"][4] == 1.0 and all(math.isnan(v) for i, v in enumerate(extra["acc"]) if i != 4)
    # the first failure's traceback is logged once, not per batch
    assert caplog.text.count("ValueError: scorer bug on purpose") == 1
    manager.close()


def test_default_scorer_in_pool_on_mixed_sources(tok) -> None:
    sources = ["openai/gsm8k", "HuggingFaceH4/MATH-500", "rlfoundry/arithmetic", "openai/gsm8k"]
    batch = make_batch(tok, ["#### 1,2", "\\boxed{.5}", "85", "#### 3"], ["12", "\\frac12", "85", "4"], sources)
    manager = NaiveRewardManager(tok, num_workers=2)
    assert last_token_scores(manager(batch), batch) == [1.0, 1.0, 1.0, 0.0]
    manager.close()


@pytest.mark.parametrize("manager_name", ["naive", "batch", "dapo"])
def test_bounded_time_sources_are_scored_in_the_driver_by_default(tok, manager_name) -> None:
    sources = ["rlfoundry/arithmetic", "openai/gsm8k", "rlfoundry/arithmetic", "openai/gsm8k"]
    batch = make_batch(tok, ["85", "#### 1,2", "7", "#### 3"], ["85", "12", "8", "4"], sources)
    config = OmegaConf.create({"data": {"max_response_length": TR},
                               "reward_model": {"reward_manager": manager_name, "reward_kwargs": {}}})
    manager = load_reward_manager(config, tok)
    assert last_token_scores(manager(batch), batch) == [1.0, 1.0, 0.0, 0.0]
    assert manager._pool is None  # no scorer processes were started


EXACT_MATCH_SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str == ground_truth)
'''


@pytest.mark.parametrize("case", ["math_in_batch", "explicit_num_workers", "custom_scorer"])
def test_pool_is_used_unless_every_sample_is_bounded_time(tok, tmp_path: Path, case) -> None:
    responses, truths = ["85", "\\boxed{.5}", "7"], ["85", "\\frac12", "8"]
    sources = ["rlfoundry/arithmetic", "HuggingFaceH4/MATH-500", "rlfoundry/arithmetic"]
    rm: dict = {"reward_manager": "naive", "reward_kwargs": {}}
    custom = {"path": None}
    if case != "math_in_batch":  # arithmetic only: the pool comes from the config, not the data
        responses, truths, sources = ["85", "7"], ["85", "8"], ["rlfoundry/arithmetic"] * 2
    if case == "explicit_num_workers":
        rm["reward_kwargs"] = {"num_workers": 2}
    if case == "custom_scorer":
        (tmp_path / "exact.py").write_text(EXACT_MATCH_SCORER)
        custom = {"path": str(tmp_path / "exact.py")}
    manager = load_reward_manager(OmegaConf.create({"reward_model": rm, "custom_reward_function": custom}), tok)
    batch = make_batch(tok, responses, truths, sources)
    expected = [1.0, 1.0, 0.0] if case == "math_in_batch" else [1.0, 0.0]
    assert last_token_scores(manager(batch), batch) == expected
    assert manager._pool is not None
    manager.close()


def test_unknown_data_source_is_a_config_error(tok) -> None:
    batch = make_batch(tok, ["1"], ["1"], ["nobody/knows"])
    with pytest.raises(UnknownDataSourceError, match="nobody/knows.*openai/gsm8k"):
        NaiveRewardManager(tok, num_workers=0)(batch)


def test_unpicklable_scorer_falls_back_to_driver(tok, caplog) -> None:
    batch = make_batch(tok, ["85", "1"], ["85", "85"])
    manager = NaiveRewardManager(tok, compute_score=lambda **kw: float(kw["solution_str"] == "85"), num_workers=2)
    with caplog.at_level(logging.WARNING):
        assert last_token_scores(manager(batch), batch) == [1.0, 0.0]
    assert "cannot be pickled" in caplog.text


def test_batch_manager_calls_once_and_fails_whole_batch(tok, tmp_path: Path) -> None:
    path = tmp_path / "batch_reward.py"
    path.write_text(textwrap.dedent('''
        CALLS = []
        def compute_score(data_sources, solution_strs, ground_truths, extra_infos):
            CALLS.append(len(solution_strs))
            if "boom" in solution_strs:
                raise RuntimeError("batch scorer bug")
            return [{"score": float(s == g), "len": len(s)} for s, g in zip(solution_strs, ground_truths)]
    '''))
    config = OmegaConf.create({"reward_model": {"reward_manager": "batch", "reward_kwargs": {"num_workers": 0}},
                               "custom_reward_function": {"path": str(path)}})
    manager = load_reward_manager(config, tok)
    assert isinstance(manager, BatchRewardManager)
    batch = make_batch(tok, ["85", "12"], ["85", "13"])
    out = manager(batch, return_dict=True)
    assert last_token_scores(out["reward_tensor"], batch) == [1.0, 0.0]
    assert out["reward_extra_info"]["len"] == [2, 2]
    assert manager.compute_score.load().__globals__["CALLS"] == [2]  # one call for the whole batch
    failed = manager(make_batch(tok, ["boom", "85"], ["85", "85"]), return_dict=True)
    assert failed["reward_metrics"]["reward/errors/exception"] == 2
    assert failed["reward_tensor"].abs().sum() == 0


def test_dapo_overlong_penalty_by_hand(tok) -> None:
    # max_resp_len 8, buffer 4: lengths up to 4 are free, then -1 per 4 extra tokens (factor 1).
    cfg = {"enable": True, "len": 4, "penalty_factor": 1.0, "log": True}
    manager = DAPORewardManager(tok, max_resp_len=8, overlong_buffer_cfg=cfg, num_workers=0)
    batch = make_batch(tok, ["85", "12345", "1234567"], ["85", "12345", "1234567"])  # lengths 3, 6, 8 with EOS
    out = manager(batch, return_dict=True)
    # penalties: 3 -> 0; 6 -> -(6-4)/4 = -0.5; 8 -> -(8-4)/4 = -1.0; all answers right (1.0)
    assert last_token_scores(out["reward_tensor"], batch) == [1.0, 0.5, 0.0]
    extra = out["reward_extra_info"]
    assert extra["acc"] == [1.0, 1.0, 1.0]
    assert extra["overlong_reward"] == [0.0, -0.5, -1.0] and extra["overlong"] == [False, True, True]
    with pytest.raises(ValueError, match="overlong_buffer.len"):
        DAPORewardManager(tok, max_resp_len=3, overlong_buffer_cfg=cfg, num_workers=0)


def test_rm_scores_replace_or_add(tok) -> None:
    batch = make_batch(tok, ["85", "1"], ["85", "85"])
    rm = torch.zeros(2, TR)
    rm[0, 2], rm[1, 1] = 0.5, -0.25
    batch.batch["rm_scores"] = rm
    assert torch.equal(NaiveRewardManager(tok, num_workers=0)(batch), rm)  # verl: model score wins
    added = NaiveRewardManager(tok, num_workers=0, rm_combine="add")(batch)
    assert last_token_scores(added, batch) == [1.5, -0.25]


def test_num_examine_prints_per_data_source(tok, capsys) -> None:
    batch = make_batch(tok, ["85", "86", "87"], ["85", "85", "85"])
    NaiveRewardManager(tok, num_examine=1, num_workers=0)(batch)
    printed = capsys.readouterr().out
    assert printed.count("[response]") == 1 and "[ground_truth] 85" in printed and "[score] 1.0" in printed
    assert "[prompt] q" in printed


def test_builder_errors_name_the_fix(tok, tmp_path: Path) -> None:
    def cfg(**rm):
        return OmegaConf.create({"reward_model": rm, "custom_reward_function": {"path": None}})

    with pytest.raises(ValueError, match="did you mean 'timeout_s'"):
        load_reward_manager(cfg(reward_kwargs={"timeout": 3}), tok)
    with pytest.raises(ValueError, match="unknown reward_model.reward_manager='prime'.*batch.*dapo.*naive"):
        get_reward_manager_cls("prime")
    missing = OmegaConf.create({"custom_reward_function": {"path": str(tmp_path / "nope.py")}})
    with pytest.raises(RewardFunctionError, match="nope.py does not exist"):
        load_reward_manager(missing, tok)
    (tmp_path / "r.py").write_text("def other(**kw):\n    return 1.0\n")
    wrong = OmegaConf.create({"custom_reward_function": {"path": str(tmp_path / "r.py"), "name": "score_it"}})
    with pytest.raises(RewardFunctionError, match="has no function 'score_it'"):
        load_reward_manager(wrong, tok)
    dapo = load_reward_manager(OmegaConf.create({
        "data": {"max_response_length": 16},
        "reward_model": {"reward_manager": "dapo", "overlong_buffer": {"enable": True, "len": 4, "penalty_factor": 0.5}},
    }), tok)
    assert (dapo.max_resp_len, dapo.overlong_len, dapo.overlong_penalty) == (16, 4, 0.5)


def test_compute_score_kwargs_reach_the_built_in_scorer_in_the_pool(tok) -> None:
    """verl's reward.compute_score_kwargs (here reward_model.reward_kwargs.compute_score_kwargs): GSM8K's
    flexible method takes the last number; strict needs '#### n'. One pool process scores, so the
    bound arguments travel with the pickled scorer."""
    batch = make_batch(tok, ["so 72", "#### 72", "so 71"], ["72", "72", "72"], ["openai/gsm8k"] * 3)

    def manager(**kwargs):
        rm = {"reward_kwargs": {"num_workers": 1, **kwargs}}
        return load_reward_manager(OmegaConf.create({"reward_model": rm, "custom_reward_function": {"path": None}}), tok)

    strict, flexible = manager(), manager(compute_score_kwargs={"method": "flexible"})
    assert last_token_scores(strict(batch), batch) == [0.0, 1.0, 0.0]
    assert last_token_scores(flexible(batch), batch) == [1.0, 1.0, 0.0]
    assert flexible._pool is not None and flexible.last_metrics["reward/errors"] == 0
    flexible.close(), strict.close()
    with pytest.raises(ValueError, match="custom_reward_function.reward_kwargs"):
        NaiveRewardManager(tok, compute_score=len, compute_score_kwargs={"method": "flexible"})


BONUS_MANAGER = '''
from rlfoundry.rewards.reward_manager import NaiveRewardManager

class ExactBonus(NaiveRewardManager):
    """A right answer gets bonus on top."""

    def __init__(self, *args, bonus=0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.bonus = bonus

    def postprocess(self, samples, scored):
        for result in scored:
            result.score += self.bonus * result.score

class NotAManager:
    def __init__(self, *args, **kwargs):
        pass
'''


def test_importlib_reward_manager_is_a_class_from_a_file(tok, tmp_path: Path) -> None:
    """verl's reward.reward_manager.source=importlib with module.{path,name}; reward_kwargs reach it."""
    (tmp_path / "managers.py").write_text(BONUS_MANAGER)

    def cfg(name: str):
        spec = {"source": "importlib", "module": {"path": str(tmp_path / "managers.py"), "name": name}}
        return OmegaConf.create({"reward": {"reward_manager": spec}, "custom_reward_function": {"path": None},
                                 "reward_model": {"reward_kwargs": {"bonus": 0.5, "num_workers": 0}}})

    manager = load_reward_manager(cfg("ExactBonus"), tok)
    batch = make_batch(tok, ["85", "12"], ["85", "13"])
    assert type(manager).__name__ == "ExactBonus" and last_token_scores(manager(batch), batch) == [1.5, 0.0]
    with pytest.raises(RewardFunctionError, match="NotAManager .* must subclass .*RuleRewardManager"):
        load_reward_manager(cfg("NotAManager"), tok)
    with pytest.raises(RewardFunctionError, match="has no class 'Missing'"):
        load_reward_manager(cfg("Missing"), tok)


def test_reward_kwargs_are_grouped_into_rule_options_and_weights(tok) -> None:
    manager = NaiveRewardManager(tok, timeout_s=3, failure_score=-1, num_workers=0, rule_weight=0.5, rm_combine="add")
    assert (manager.options.timeout_s, manager.options.failure_score, manager.pool) == (3.0, -1.0, None)
    assert manager.weights == Weights(rule=0.5, judge=1.0, rm_combine="add")
    with pytest.raises(TypeError, match="did you mean 'failure_score'"):
        NaiveRewardManager(tok, failure_scor=1.0)
    with pytest.raises(ValueError, match="rm_combine='sum' must be one of"):
        NaiveRewardManager(tok, rm_combine="sum")


def test_manager_as_context_manager_stops_its_scorer_processes(tok) -> None:
    batch = make_batch(tok, ["85", "7"], ["85", "8"])
    with NaiveRewardManager(tok, num_workers=1) as manager:
        assert manager._pool is None  # started by the first batch that needs it
        assert last_token_scores(manager(batch), batch) == [1.0, 0.0]
        assert manager._pool is not None
    assert manager._pool is None
