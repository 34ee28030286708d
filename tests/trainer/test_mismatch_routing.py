"""The mismatch audit's MoE-routing evidence (trainer/ppo/mismatch.py; docs/moe.md#routing-replay), and the routing's
alignment through the trainer's batch assembly."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.protocol import DataProto
from rlfoundry.trainer.ppo import mismatch
from rlfoundry.trainer.ppo.mismatch import StepFacts


def _audit(facts: StepFacts):
    old = torch.full((1, 2), -1.0)
    batch = DataProto.from_dict(tensors={"rollout_log_probs": old + 0.05, "response_mask": torch.ones(1, 2)})
    return mismatch.audit(batch, old, facts, threshold=0.02)[2]


def test_an_moe_policy_without_replay_names_routing_before_precision_and_a_dense_one_does_not():
    fp32 = {"actor": "float32", "rollout": "float32"}
    assert _audit(StepFacts(dtypes=fp32)) == []
    findings = _audit(StepFacts(dtypes={"actor": "bfloat16"}, moe_layers=2))
    assert [f.cause for f in findings] == ["moe_routing", "precision"]
    assert "router_replay.mode=R3" in findings[0].evidence and "2 routed layers" in findings[0].evidence
    # replayed: the share the trainer would have changed is the evidence; none changed, nothing named
    replayed = _audit(StepFacts(dtypes=fp32, moe_layers=2, router_replay="R3", routing_changed_frac=0.0536))
    assert [f.cause for f in replayed] == ["moe_routing"] and "5.36% of response tokens" in replayed[0].evidence
    assert _audit(StepFacts(dtypes=fp32, moe_layers=2, router_replay="R3", routing_changed_frac=0.0)) == []


def test_the_replay_gap_metrics_and_the_changed_share_are_over_valid_tokens_only():
    rollout = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -1.0, -9.0]])
    replayed = torch.tensor([[-1.1, -2.0, -3.0], [-1.0, -1.2, 0.0]])
    own = torch.tensor([[-1.5, -2.0, -3.0], [-1.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])  # the last token of row 1 is padding (its gap 9 is not counted)
    m = mismatch.replay_gap_metrics(rollout, replayed, own, mask)
    # on: |Δ| = 0.1, 0, 0, 0, 0.2 over 5 tokens; off: 0.5, 0, 0, 0, 0
    assert m["mismatch/router_replay/on/mean"] == pytest.approx(0.3 / 5)
    assert m["mismatch/router_replay/on/max"] == pytest.approx(0.2)
    assert m["mismatch/router_replay/off/mean"] == pytest.approx(0.5 / 5)
    assert m["mismatch/router_replay/off/max"] == pytest.approx(0.5)
    assert mismatch.replay_gap_metrics(rollout, replayed, own, torch.zeros_like(mask)) == {}
    # per-row counts (B,): 1 + 2 changed of 4 + 6 counted
    assert mismatch.routing_changed_frac(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 6.0])) == pytest.approx(0.3)
    assert mismatch.routing_changed_frac(torch.zeros(2), torch.zeros(2)) == 0.0


def test_generations_of_different_prompt_widths_keep_their_routing_aligned():
    """``_concat_generations`` left-pads narrower parts' token columns: ``routed_experts`` too, with -1 (no record)."""
    from rlfoundry.trainer.ppo.ray_trainer import _concat_generations

    def part(tp: int, tr: int = 2) -> DataProto:
        ids = torch.arange(1, tp + tr + 1).view(1, -1)
        routed = ids.view(1, -1, 1, 1).expand(1, tp + tr, 2, 2).to(torch.int16)  # each token's experts = its id
        return DataProto.from_dict(tensors={"prompts": ids[:, :tp], "input_ids": ids, "attention_mask": torch.ones_like(ids),
                                            "position_ids": ids - 1, "routed_experts": routed})

    out = _concat_generations([part(2), part(3)], pad_id=0).batch
    assert out["routed_experts"].shape == (2, 5, 2, 2)
    # where a token is, its routing is; where padding was added, -1
    expected = torch.where(out["attention_mask"].bool(), out["input_ids"], -1)
    assert torch.equal(out["routed_experts"][..., 0, 0].long(), expected)
