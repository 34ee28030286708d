"""RewardModelWorker: a tiny HF sequence classifier scores rollouts, with and without re-tokenising."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rlfoundry.models.tiny import build_tokenizer, save_tiny_model
from rlfoundry.protocol import DataProto
from rlfoundry.single_controller.base import Dispatch
from rlfoundry.single_controller.base.decorator import REGISTER_ATTR
from rlfoundry.workers.reward_model import RewardModelWorker

CHATS = [
    [{"role": "user", "content": "37+48="}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2*3="}],
    [{"role": "user", "content": "1-9="}],
]
RESPONSES = ["85", "6", "-8 is it"]
TP, TR = 64, 12


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-rm"), head="sequence_classification", seed=3)


@pytest.fixture(scope="module")
def policy_tokenizer_dir(tmp_path_factory) -> Path:
    """The same bytes-level vocabulary but another chat template: the RM must re-render."""
    tok = build_tokenizer()
    tok.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    out = tmp_path_factory.mktemp("policy-tok")
    tok.save_pretrained(out)
    return out


def rollout_batch(tok) -> DataProto:
    """Left-padded rendered prompts + right-padded responses ending in EOS, as the rollout writes them."""
    n = len(CHATS)
    prompts = torch.full((n, TP), tok.pad_token_id)
    responses = torch.full((n, TR), tok.pad_token_id)
    response_mask = torch.zeros(n, TR, dtype=torch.long)
    for i, (chat, text) in enumerate(zip(CHATS, RESPONSES)):
        p = tok.encode(tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
        prompts[i, TP - len(p):] = torch.tensor(p)
        r = tok.encode(text) + [tok.eos_token_id]
        responses[i, : len(r)], response_mask[i, : len(r)] = torch.tensor(r), 1
    attention = torch.cat([(prompts != tok.pad_token_id).long(), response_mask], 1)
    raw = np.empty(n, dtype=object)
    raw[:] = CHATS
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "response_mask": response_mask,
                 "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention},
        non_tensors={"raw_prompt": raw},
    )


def reference_score(model, ids: list[int]) -> float:
    """HF's own pooled score of one unpadded sequence."""
    with torch.no_grad():
        return float(model(input_ids=torch.tensor([ids])).logits[0, 0])


def make_worker(rm_dir: Path, **cfg) -> RewardModelWorker:
    worker = RewardModelWorker({"model": {"path": str(rm_dir), **cfg.pop("model", {})}, **cfg})
    worker.init_model()
    return worker


def test_through_a_worker_group_into_the_reward_manager(rm_dir: Path) -> None:
    """Driver view: group.init_model(); batch.union(group.compute_rm_score(batch)); reward manager."""
    from rlfoundry.rewards import NaiveRewardManager
    from rlfoundry.single_controller import ClassWithInitArgs, LocalWorkerGroup

    assert getattr(RewardModelWorker.init_model, REGISTER_ATTR).dispatch_mode is Dispatch.ONE_TO_ALL
    assert getattr(RewardModelWorker.compute_rm_score, REGISTER_ATTR).dispatch_mode is Dispatch.DP_COMPUTE_PROTO
    group = LocalWorkerGroup(ClassWithInitArgs(RewardModelWorker, {"model": {"path": str(rm_dir)}}), name_prefix="rm")
    group.init_model()
    tok = AutoTokenizer.from_pretrained(rm_dir)
    batch = rollout_batch(tok)
    batch = batch.union(group.compute_rm_score(batch))
    # rule columns present too: with rm_combine=add the manager sums rule and model scores
    batch.non_tensor_batch["data_source"] = np.array(["rlfoundry/arithmetic"] * 3, dtype=object)
    batch.non_tensor_batch["reward_model"] = np.array([{"ground_truth": g} for g in ("85", "6", "-8")], dtype=object)
    replaced = NaiveRewardManager(tok, num_workers=0)(batch)
    added = NaiveRewardManager(tok, num_workers=0, rm_combine="add")(batch)
    assert torch.equal(replaced, batch.batch["rm_scores"])
    rule = torch.zeros_like(replaced)
    rule[0, 2] = rule[1, 1] = 1.0  # "85" and "6" are right; "-8 is it" is not just a number
    torch.testing.assert_close(added, batch.batch["rm_scores"] + rule)


@pytest.mark.numerics
def test_scores_last_response_token_and_matches_unpadded_forward(rm_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(rm_dir)
    batch = rollout_batch(tok)
    out = make_worker(rm_dir, micro_batch_size_per_gpu=2).compute_rm_score(batch)
    rm_scores = out.batch["rm_scores"]
    assert rm_scores.shape == (3, TR)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    for i in range(3):
        last = int(batch.batch["response_mask"][i].sum()) - 1  # "85"+EOS -> 2, "6"+EOS -> 1, ...
        ids = batch.batch["input_ids"][i][batch.batch["attention_mask"][i].bool()].tolist()
        # batched scoring vs one plain forward: fp32 rounding of O(1) scores
        assert rm_scores[i, last].item() == pytest.approx(reference_score(model, ids), abs=1e-5)
        assert rm_scores[i].count_nonzero() == 1
    # micro-batching does not change the scores
    one_by_one = make_worker(rm_dir, micro_batch_size_per_gpu=1).compute_rm_score(batch).batch["rm_scores"]
    # one row at a time vs batched: fp32 rounding of O(1) scores
    torch.testing.assert_close(one_by_one, rm_scores, atol=1e-5, rtol=0)


@pytest.mark.numerics
def test_retokenises_with_the_rm_chat_template(rm_dir: Path, policy_tokenizer_dir: Path) -> None:
    policy_tok = AutoTokenizer.from_pretrained(policy_tokenizer_dir)
    batch = rollout_batch(policy_tok)
    worker = make_worker(rm_dir, model={"input_tokenizer": str(policy_tokenizer_dir)})
    assert worker.retokenize
    rm_scores = worker.compute_rm_score(batch).batch["rm_scores"]
    rm_tok = AutoTokenizer.from_pretrained(rm_dir)
    model = AutoModelForSequenceClassification.from_pretrained(rm_dir).eval()
    for i, (chat, response) in enumerate(zip(CHATS, RESPONSES)):
        text = rm_tok.apply_chat_template(chat + [{"role": "assistant", "content": response}], tokenize=False)
        assert text.startswith("<|im_start|>") and text.endswith(f"{response}<|im_end|>\n")
        last = int(batch.batch["response_mask"][i].sum()) - 1
        expected = reference_score(model, rm_tok.encode(text))
        # batched scoring vs one plain forward: fp32 rounding of O(1) scores
        assert rm_scores[i, last].item() == pytest.approx(expected, abs=1e-5)
    # the same tokenizer as input_tokenizer means no re-tokenising
    assert not make_worker(rm_dir, model={"input_tokenizer": str(rm_dir)}).retokenize
    without_chat = DataProto.from_dict(tensors=dict(batch.batch.items()))
    with pytest.raises(KeyError, match="data.return_raw_chat=True"):
        worker.compute_rm_score(without_chat)
