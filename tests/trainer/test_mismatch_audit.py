"""The mismatch audit (rlfoundry/trainer/ppo/mismatch.py): metrics by position, turn and data source, and a
diagnosis that names each cause injected into a hand-built batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.trainer.ppo import mismatch
from rlfoundry.trainer.ppo.mismatch import StepFacts
from rlfoundry.workers.rollout.agent_loop.base import AgentLoopBase, AgentLoopOutput


def _batch(rollout: torch.Tensor, mask: torch.Tensor, **columns) -> DataProto:
    return DataProto.from_dict(tensors={"rollout_log_probs": rollout, "response_mask": mask},
                               non_tensors={k: np.array(v, dtype=object) for k, v in columns.items()})


def test_position_buckets_are_quarters_of_each_rows_valid_tokens():
    mask = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 0, 0, 0]])
    # 8 tokens: rank*4//8 = 0 0 1 1 2 2 3 3; 3 tokens: rank*4//3 = 0 1 2 (no fourth quarter); padding -1
    assert mismatch.position_buckets(mask).tolist() == [[0, 0, 1, 1, 2, 2, 3, 3], [0, 1, 2, -1, -1, -1, -1, -1]]


def test_turns_are_runs_of_the_policys_tokens():
    # the policy's turn, a tool reply (0s), a one-token turn, a tool reply, a last turn, padding
    mask = torch.tensor([[1, 1, 0, 0, 1, 0, 1, 1, 0]])
    assert mismatch.turn_index(mask).tolist() == [[0, 0, -1, -1, 1, -1, 2, 2, -1]]


def test_metrics_by_position_turn_and_source_count_only_valid_tokens():
    # row a (source "x"): turns [0.1, 0.3], tool reply (gap 9, masked), [0.5, 0.7];
    # row b (source "y"): four tokens 0.2 each, then padding (gap 5, masked)
    gap = torch.tensor([[0.1, 0.3, 9.0, 0.5, 0.7], [0.2, 0.2, 0.2, 0.2, 5.0]])
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 1, 1, 0]])
    m = mismatch.mismatch_metrics(gap, mask, np.array(["x", "y"], dtype=object), multi_turn=True)
    # quarters: row a's valid tokens 0.1 | 0.3 | 0.5 | 0.7, row b's 0.2 each: q1 = (0.1+0.2)/2 ...
    for q, value in zip(mismatch.POSITION_BUCKETS, (0.15, 0.25, 0.35, 0.45)):
        assert m[f"mismatch/position/{q}/mean"] == pytest.approx(value)
    # turn 0: 0.1, 0.3 and row b's single run of four 0.2s -> 1.2/6; turn 1: row a's 0.5, 0.7 -> 0.6
    assert m["mismatch/turn/0/mean"] == pytest.approx(1.2 / 6)
    assert m["mismatch/turn/1/mean"] == pytest.approx(0.6)
    assert "mismatch/turn/2/mean" not in m
    assert m["mismatch/data_source/x/mean"] == pytest.approx(0.4)
    assert m["mismatch/data_source/y/mean"] == pytest.approx(0.2)
    # tokens above 0.1: 0.3, 0.5, 0.7 and the four 0.2s (0.1 itself is not above) = 7 of 8
    assert m["mismatch/frac_tokens_above_0.1"] == pytest.approx(7 / 8)
    assert not any(k.startswith("mismatch/turn/") for k in mismatch.mismatch_metrics(gap, mask))


def test_turns_past_the_last_named_share_one_bucket():
    n = mismatch.MAX_TURN_METRICS
    mask = torch.tensor([[1, 0] * (n + 2)])  # n + 2 one-token turns
    gap = torch.arange(2 * (n + 2), dtype=torch.float32).view(1, -1) / 100
    m = mismatch.mismatch_metrics(gap, mask, multi_turn=True)
    # turns n and n+1 sit at columns 2n and 2n+2: their mean is (2n+1)/100
    assert m[f"mismatch/turn/{n}+/mean"] == pytest.approx((2 * n + 1) / 100)
    assert m[f"mismatch/turn/{n - 1}/mean"] == pytest.approx(2 * (n - 1) / 100)


def test_a_gap_below_the_threshold_diagnoses_nothing():
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    batch = _batch(old + 0.01, torch.ones(1, 2), param_version=[3])
    metrics, mean_gap, findings = mismatch.audit(batch, old, StepFacts(trainer_version=4), threshold=0.02)
    assert mean_gap == pytest.approx(0.01) and findings is None
    assert metrics["mismatch/position/q1/mean"] == pytest.approx(0.01)


def _versions_case(asynchronous: bool):
    old = torch.zeros(2, 3) - 1.0
    rollout = old.clone()
    rollout[1] += 0.3  # the row sampled one update behind is the one that disagrees
    batch = _batch(rollout, torch.ones(2, 3), param_version=[5, 4])
    return mismatch.audit(batch, old, StepFacts(trainer_version=5, asynchronous=asynchronous), threshold=0.02)


def test_stale_weights_are_named_when_a_synchronous_run_samples_at_an_old_version():
    _, mean_gap, findings = _versions_case(asynchronous=False)
    assert mean_gap == pytest.approx(0.15)
    assert findings[0].cause == "stale_weights"
    assert "1/2 rows" in findings[0].evidence and "0.3 vs 0 " in findings[0].evidence
    message = mismatch.diagnosis_message(7, mean_gap, 0.02, findings)
    assert "likely cause: stale_weights" in message and "step 7" in message


def test_staleness_is_named_when_an_asynchronous_run_lags():
    _, _, findings = _versions_case(asynchronous=True)
    assert [f.cause for f in findings] == ["staleness"]
    assert "lag up to 1" in findings[0].evidence


def test_a_temperature_mismatch_is_named_as_the_sampling_settings():
    # log-probs of 2 tokens over logits [2, 0]: sampled at T=2 (rollout) but scored at T=1 (trainer)
    logits = torch.tensor([2.0, 0.0])
    rollout = torch.log_softmax(logits / 2, -1).view(1, 2)
    old = torch.log_softmax(logits, -1).view(1, 2)
    batch = _batch(rollout, torch.ones(1, 2), param_version=[0])
    facts = StepFacts(trainer_version=0, rollout_temperature=2.0, trainer_temperature=1.0)
    _, _, findings = mismatch.audit(batch, old, facts, threshold=0.02)
    assert [f.cause for f in findings] == ["sampling"]
    assert "temperature 2.0" in findings[0].evidence and "at 1.0" in findings[0].evidence


def test_top_p_is_a_cause_only_on_an_engine_that_renormalises():
    # vLLM reports log p renormalised over a kept set of mass 0.8: log p_rollout = log p - log 0.8
    old = torch.log(torch.tensor([[0.5, 0.3]]))
    batch = _batch(old - math.log(0.8), torch.ones(1, 2))
    vllm = StepFacts(top_p=0.8, engine="vllm")
    _, _, findings = mismatch.audit(batch, old, vllm, threshold=0.02)
    assert findings[0].cause == "sampling" and f"{-math.log(0.8):+.4g}" in findings[0].evidence
    # the HF engine reports the unfiltered value: top_p explains nothing there
    _, _, findings = mismatch.audit(batch, old, StepFacts(top_p=0.8, engine="hf"), threshold=0.02)
    assert findings == []


def test_fire_sampling_is_named_with_the_first_tokens_gap():
    old = torch.full((2, 3), -1.0)
    rollout = old.clone()
    rollout[:, 0] -= 0.9  # the first token, scored by the rollout at temperature 30
    facts = StepFacts(fire=True)
    _, _, findings = mismatch.audit(_batch(rollout, torch.ones(2, 3)), old, facts, threshold=0.02)
    assert findings[0].cause == "sampling" and "first tokens 0.9" in findings[0].evidence


def test_precision_and_unverified_syncs_are_named_only_as_candidates_after_direct_evidence():
    old = torch.full((1, 2), -1.0)
    batch = _batch(old + 0.05, torch.ones(1, 2), param_version=[2])
    facts = StepFacts(trainer_version=2, dtypes={"actor": "bfloat16", "rollout": "bfloat16"}, digests_verified=False)
    _, _, findings = mismatch.audit(batch, old, facts, threshold=0.02)
    assert [f.cause for f in findings] == ["unverified_sync", "precision"]
    assert "actor=bfloat16" in findings[1].evidence and "not a proof" in findings[1].evidence
    # in fp32 with verified syncs and matching versions nothing is named: the message says so
    clean = StepFacts(trainer_version=2, dtypes={"actor": "float32", "rollout": "float32"})
    _, mean_gap, findings = mismatch.audit(batch, old, clean, threshold=0.02)
    assert findings == []
    assert "no cause found" in mismatch.diagnosis_message(1, mean_gap, 0.02, findings)
    # a version mismatch comes before precision
    stale = StepFacts(trainer_version=3, dtypes={"actor": "bfloat16"})
    assert [f.cause for f in mismatch.audit(batch, old, stale, threshold=0.02)[2]] == ["stale_weights", "precision"]


def test_the_log_is_rate_limited_per_cause():
    every = 10
    assert mismatch.should_log(1, "precision", (-every, ""), every)
    assert not mismatch.should_log(5, "precision", (1, "precision"), every)  # same cause, 4 steps later
    assert mismatch.should_log(5, "stale_weights", (1, "precision"), every)  # a new cause: at once
    assert mismatch.should_log(11, "precision", (1, "precision"), every)


def test_a_threshold_that_is_not_positive_names_the_key():
    from rlfoundry.config.schema import TrainerConfig

    errors = TrainerConfig(mismatch_audit_threshold=0.0).check()
    assert any("trainer.mismatch_audit_threshold=0.0" in e and "trainer.mismatch_audit=false" in e for e in errors)
    assert not any("mismatch_audit" in e for e in TrainerConfig().check())


def test_retokenisation_is_named_for_the_turns_an_agent_loop_sampled_after_a_rerendered_chat():
    """The tool agent loop with ``use_inference_chat_template`` and a template that drops earlier turns'
    reasoning (tests/workers/test_inference_chat_template.py): turn 2 is sampled after a context the row does
    not hold, and the loop's ``retokenised_from`` says from where. The trainer's log-probs here are the
    rollout's with turn 2 shifted by 0.3 (what scoring it after another context does); with the key off the
    same numbers name nothing, as no row was sampled after another context."""
    from rlfoundry.models.tiny import build_tokenizer
    from tests.workers.test_inference_chat_template import DROP_THINK, _run

    tok = build_tokenizer()
    tok.chat_template = DROP_THINK
    for on in (True, False):
        out = _run(tok, on)[0]
        rollout, mask = out.batch["rollout_log_probs"], out.batch["response_mask"]
        turns = out.non_tensor_batch["turns"][0]  # [role, start, end] of each appended turn
        second = [t for t in turns if t[0] == "assistant"][1]
        old = rollout.clone()
        old[0, second[1]:second[2]] += 0.3
        _, mean_gap, findings = mismatch.audit(out, old, StepFacts(), threshold=0.02)
        share = (second[2] - second[1]) / int(mask.sum())  # turn 2's share of the policy's tokens
        assert mean_gap == pytest.approx(0.3 * share)
        if not on:
            assert findings == []
            continue
        assert [f.cause for f in findings] == ["retokenisation"]
        assert out.non_tensor_batch["retokenised_from"][0] == second[1]
        assert (f"1/1 rows train on {second[2] - second[1]} policy tokens (from response positions "
                f"{second[1]}..{second[1]})") in findings[0].evidence
        assert "mean |Δ log p| 0.3 vs 0 " in findings[0].evidence


BF16_ACTOR = ["actor.fsdp_config.mixed_precision.param_dtype=bf16", "ref.fsdp_config.mixed_precision.param_dtype=bf16"]


@pytest.fixture(scope="module")
def rollout_and_actor(tiny_model_dir):
    """Two workers on the same weights: an fp32 one whose rollout samples (fp32 weights and math) and one whose
    actor computes under bf16 autocast (one CPU rank, ``mixed_precision.param_dtype=bf16``)."""
    from tests.workers import local_worker, worker_config

    return local_worker(worker_config(tiny_model_dir)), local_worker(worker_config(tiny_model_dir, BF16_ACTOR))


def _precision_case(rollout_and_actor, tokenizer, trainer_temperature: float):
    from tests.workers import make_prompts

    sampler, actor = rollout_and_actor
    data = sampler.generate_sequences(make_prompts(tokenizer, ["hello world", "a", "the quick brown fox", "12+7="]))
    data.meta_info = {"temperature": trainer_temperature}  # what the trainer scores at (the rollout sampled at 1)
    scored = actor.compute_log_prob(data)
    assert scored.meta_info["compute_dtype"] == "bfloat16" and scored.meta_info["fp32_recompute"]
    old = scored.batch["old_log_probs"]
    facts = StepFacts(dtypes={"actor": "bfloat16", "rollout": "float32"}, fp32_recompute=True,
                      trainer_temperature=trainer_temperature)
    # bf16 rounding on the tiny model is ~5e-4 per token: a threshold below it diagnoses
    _, _, findings = mismatch.audit(data, old, facts, threshold=1e-4)
    assert findings[-1].cause == "precision" and not findings[-1].proven and mismatch.wants_fp32_recompute(findings, facts)
    rows = mismatch.worst_rows(data.batch["rollout_log_probs"], old, data.batch["response_mask"])
    fp32 = actor.compute_log_prob_fp32(data.select_idxs(rows)).batch["fp32_log_probs"]
    finding = mismatch.precision_finding(data.batch["rollout_log_probs"][rows], old[rows], fp32,
                                         data.batch["response_mask"][rows], facts.dtypes)
    return mismatch.settle_precision(findings, finding), old, fp32, rows


def test_an_fp32_recompute_of_the_worst_rows_proves_precision(rollout_and_actor, tokenizer):
    findings, old, fp32, rows = _precision_case(rollout_and_actor, tokenizer, 1.0)
    assert len(rows) == mismatch.PRECISION_ROWS
    assert [(f.cause, f.proven) for f in findings] == [("precision", True)]
    assert "closes the gap" in findings[0].evidence and "actor=bfloat16" in findings[0].evidence
    # the recompute is the actor's own forward in fp32: it moved the bf16 log-probs, by rounding only
    assert 0 < float((fp32 - old[rows]).abs().max()) < 0.05


def test_an_fp32_recompute_does_not_prove_precision_for_a_temperature_gap(rollout_and_actor, tokenizer):
    findings, *_ = _precision_case(rollout_and_actor, tokenizer, 0.7)
    assert [(f.cause, f.proven) for f in findings] == [("sampling", True), ("precision", False)]
    assert "leaves" in findings[1].evidence and "not a proof" in findings[1].evidence


def test_the_driver_runs_the_fp32_recompute_on_a_diagnosed_step_and_logs_its_verdict(tiny_model_dir, tmp_path, caplog):
    """One GRPO step through the real trainer on one CPU rank in bf16 (routing_replay_e2e's setting): the
    actor under bf16 autocast, the HF rollout decoding from a bf16 copy. A threshold below their rounding
    gap diagnoses the step; the driver recomputes the worst rows in fp32 and the log carries the verdict:
    the rollout's own bf16 rounding leaves the gap open, so precision stays a candidate, with the numbers."""
    from tests.trainer import _e2e as E

    bf16 = [f"actor_rollout_ref.{k}" for k in BF16_ACTOR]
    with caplog.at_level("WARNING", logger="rlfoundry.trainer.ppo.ray_trainer"):
        E.train(E.tiny_overrides(tiny_model_dir, tmp_path, "trainer.total_training_steps=1",
                                 "actor_rollout_ref.actor.use_rollout_log_probs=false",
                                 "trainer.mismatch_audit_threshold=1e-6", *bf16))
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("mismatch audit:")]
    assert len(logged) == 1
    assert f"an fp32 recompute of the {mismatch.PRECISION_ROWS} worst rows leaves" in logged[0]


class StrippingLoop(AgentLoopBase):
    """A custom loop with a common bug: it keeps its turn as text, stripped, and encodes it again for the
    training row (the sampled trailing space is gone, the end token moves up). Listed in a loop config file
    by the test below, not registered (the registry is the process's)."""

    async def run(self, sampling_params, **row):
        turn = await self.server.generate(self.key, row["prompt_ids"], self.response_length)
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True).strip()
        ids = self.tokenizer.encode(text, add_special_tokens=False) + turn.token_ids[-1:]
        return AgentLoopOutput(row["prompt_ids"], ids, [1] * len(ids), turn.log_probs[:len(ids)])


def test_retokenisation_is_named_for_a_custom_loop_that_encodes_its_turn_again(tmp_path):
    from types import SimpleNamespace

    from rlfoundry.config.schema import MultiTurnConfig
    from rlfoundry.models.tiny import build_tokenizer
    from rlfoundry.workers.rollout.agent_loop import AgentLoop
    from tests.workers.test_agent_loop import ScriptedPolicy, _prompts

    (tmp_path / "loops.yaml").write_text(f"- name: stripping\n  _target_: {__name__}.StrippingLoop\n")
    tok, question, answer = build_tokenizer(), "Say it.", "The answer is 7. "
    agent = SimpleNamespace(default_agent_loop="stripping", agent_loop_config_path=str(tmp_path / "loops.yaml"),
                            max_wait_s=1.0)
    out = AgentLoop(ScriptedPolicy(tok, {question: [answer]}), tok, MultiTurnConfig(enable=True), {}, 64,
                    agent=agent).generate_sequences(_prompts(tok, {}, [question]))
    kept = len(tok.encode(answer.strip(), add_special_tokens=False))  # the sampled ids the row still has as sampled
    assert out.non_tensor_batch["retokenised_from"][0] == kept  # the end token, after a context the engine never saw
    old = out.batch["rollout_log_probs"].clone()
    old[0, kept] += 0.5
    findings = mismatch.audit(out, old, StepFacts(), threshold=0.02)[2]
    assert [f.cause for f in findings] == ["retokenisation"]
    assert f"1/1 rows train on 1 policy tokens (from response positions {kept}..{kept})" in findings[0].evidence
