"""A GRPO step on the tiny Qwen3-MoE with routing replay R3 (docs/moe.md#routing-replay), through the real trainer.

What makes the rollout's routing differ from the trainer's here: one CPU rank with
``fsdp_config.mixed_precision.param_dtype=bf16``. The actor then runs under bf16 autocast over fp32 weights
(norms, residual stream and softmax in fp32), while the HF rollout decodes from a bf16 copy of the weights
with a KV cache (everything in bf16): the router logits of the two differ by bf16 rounding, which flips the
top-2 of the tokens whose 2nd and 3rd experts are close. That is the GPU situation in miniature (a bf16
engine against the trainer's mixed precision); in fp32 both pick the same experts
(tests/workers/test_rollout_routing.py) and replay would change nothing.
"""

from __future__ import annotations

import pytest

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow

BF16 = ("actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16",
        "actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype=bf16")


def _run(model, run_dir, *extra):
    return E.train(E.tiny_overrides(model, run_dir, "trainer.total_training_steps=1", "data.max_response_length=8",
                                    "actor_rollout_ref.actor.use_rollout_log_probs=false", *BF16, *extra))


def test_replaying_the_rollout_routing_shrinks_the_rollout_trainer_mismatch(tiny_moe_dir, tmp_path):
    r3 = _run(tiny_moe_dir, tmp_path / "r3", "actor_rollout_ref.actor.router_replay.mode=R3",
              "actor_rollout_ref.rollout.enable_rollout_routing_replay=true").step(1)
    plain = _run(tiny_moe_dir, tmp_path / "plain").step(1)
    changed = r3["actor/router_replay/changed_token_frac"]
    assert 0.0 < changed < 0.5  # bf16 rounding flips some tokens' experts, not most
    # the same first step (same seed, same weights): the audit's unreplayed pass is the plain run's old-log-prob pass
    assert r3["mismatch/router_replay/off/mean"] == pytest.approx(plain["training/rollout_log_probs_diff_mean"],
                                                                   rel=1e-4)
    assert r3["mismatch/router_replay/on/mean"] == pytest.approx(r3["training/rollout_log_probs_diff_mean"], rel=1e-6)
    # replaying the rollout's experts removes the routing part of the gap; the bf16 rounding of the rest remains
    assert r3["mismatch/router_replay/on/mean"] < r3["mismatch/router_replay/off/mean"]
    assert r3["mismatch/router_replay/on/max"] <= r3["mismatch/router_replay/off/max"]
    assert "actor/router_replay/changed_token_frac" not in plain


def test_r2_trains_on_the_trainers_own_recorded_routing(tiny_moe_dir, tmp_path):
    """R2 with the rollout recording too: the old-log-prob pass's record replaces the rollout's in the batch the
    update replays (verl's choice). Told apart by the response's last token, which the rollout never fed
    (-1) and the trainer's forward routes."""
    run = _run(tiny_moe_dir, tmp_path / "r2", "actor_rollout_ref.actor.router_replay.mode=R2",
               "actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    batch = run.batches[0]
    routed, mask = batch["routed_experts"], batch["attention_mask"].bool()
    assert routed.shape[:2] == mask.shape and bool((routed[mask] >= 0).all()) and bool((routed[~mask] == -1).all())
    assert "actor/router_replay/changed_token_frac" not in run.step(1)  # R2 replays the trainer's own choice
