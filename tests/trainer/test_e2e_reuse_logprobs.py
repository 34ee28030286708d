"""``actor.use_rollout_log_probs``: the HF engine's sampling log-probs stand in for the old-log-prob pass.

On-policy, one epoch, one mini-batch, the rollout's log-probs are the actor's recomputed ones to
float rounding, so a run with the pass skipped must train exactly like one without the skip: same
metrics (``actor/entropy`` included, now reported by the update), same final weights. And the
config must refuse the switch wherever that equality does not hold.
"""

from __future__ import annotations

import pytest
import torch

from rlfoundry.trainer.config import ConfigError, load_config
from tests.trainer import _e2e as E
from tests.workers import reassociation_bound, vocab_rows

pytestmark = pytest.mark.slow

REUSE = "actor_rollout_ref.actor.use_rollout_log_probs=true"
METRICS = ("actor/pg_loss", "actor/entropy", "critic/score/mean", "actor/grad_norm", "response_length/mean")


def _weights(trainer) -> dict[str, torch.Tensor]:
    # the in-process back end keeps the worker object: colocated roles -> the actor's (FSDP2) module
    module = trainer.actor_rollout_wg.worker.workers["actor_rollout"].actor.module
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731 - DTensor under FSDP2
    return {k: full(v).detach().clone() for k, v in module.state_dict().items()}


LR, EPS = 1e-4, 1e-3


def _run(model, run_dir, reward, *extra):
    # The dense scorer gives non-zero advantages, so the weights move. Adam's eps is 1e-3, not 1e-8:
    # its steps lr·g/(|g| + eps) then change by at most lr/eps = 0.1x a change in the gradient, where
    # with eps=1e-8 float rounding in a near-zero gradient component moves that weight anywhere in
    # [-lr, lr] whichever log-probs were used (#51); elements with |g| >> eps still step by ~lr.
    return E.train(E.tiny_overrides(model, run_dir, f"custom_reward_function.path={reward}",
                                    f"actor_rollout_ref.actor.optim.lr={LR}", f"actor_rollout_ref.actor.optim.eps={EPS}",
                                    *extra), keep_trainer=True)


@pytest.mark.parametrize("variant", [
    pytest.param((), id="grpo"),
    # entropy in the loss (the update computes it with a graph) and a KL loss against the reference
    pytest.param(("actor_rollout_ref.actor.entropy_coeff=0.01", "actor_rollout_ref.actor.use_kl_loss=true"),
                 id="grpo-entropy-kl_loss"),
])
@pytest.mark.numerics
def test_skipping_the_old_log_prob_pass_trains_identically(tiny_model_dir, tmp_path, variant):
    reward = E.write_reward_file(tmp_path)
    off = _run(tiny_model_dir, tmp_path / "off", reward, *variant, "actor_rollout_ref.actor.use_rollout_log_probs=false",
               "actor_rollout_ref.rollout.calculate_log_probs=true")  # for training/rollout_probs_diff_*
    on = _run(tiny_model_dir, tmp_path / "on", reward, *variant, REUSE)

    # recomputed, the HF rollout and the actor score the sampled tokens alike (same weights, T, no top-k/p)
    assert off.step(1)["training/rollout_probs_diff_max"] < 1e-4
    # the mismatch audit (on by default) of the recomputing run: one data source, so its mean is the step's
    # mean |Δ log p|; every position quarter's mean is bounded by the step's max
    first = off.step(1)
    (source,) = [k for k in first if k.startswith("mismatch/data_source/")]
    assert first[source] == pytest.approx(first["training/rollout_log_probs_diff_mean"], rel=1e-5, abs=1e-9)
    for q in ("q1", "q2", "q3", "q4"):
        assert 0.0 <= first[f"mismatch/position/{q}/mean"] <= first["training/rollout_log_probs_diff_max"]
    assert "timing_s/mismatch_audit" in first and not any(k.startswith("mismatch/") for k in on.step(1))
    for step in (1, 2):
        a, b = off.step(step), on.step(step)
        for key in METRICS:
            # steps 1-2 at weights lr/eps-close (EPS): fp32 rounding plus the old log-probs' 1e-5
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-5), (step, key)
        assert "timing_s/old_log_prob" in a and "timing_s/old_log_prob" not in b
    for a, b in zip(off.batches, on.batches):
        # what the update trained on: the rollout's numbers, equal to the recomputed ones
        torch.testing.assert_close(b["old_log_probs"], b["rollout_log_probs"], rtol=0, atol=0)
        mask = a["response_mask"].bool()
        # the HF rollout's incremental decode vs the actor's full forward: fp32 rounding only: the same forward in
        # another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(b["old_log_probs"][mask], a["old_log_probs"][mask], rtol=1e-5, atol=1e-5)

    # The gradients differ through the old log-probs, which agree within 1e-5 + 1e-5|lp| (above; |lp| < 10,
    # so the ratios within ~1.1e-4 relative) plus fp32 summation order (reassociation_bound), times their
    # norm (<= grad_clip, 1.0); each Adam step passes that on times lr/eps, doubled for the second
    # gradient being taken at weights the first moved apart: 2 steps x 2 x lr/eps x (1.1e-4 + bound) per
    # tensor's 2-norm (~6e-5). Old log-probs from the wrong pass or token (a ratio 10% off) move a
    # 4096-element matrix's weights ~0.1 x lr x |g|/eps ~ 5e-6 each, ~3e-4 in its 2-norm.
    w_off, w_on = _weights(off.trainer), _weights(on.trainer)
    tokens = int(off.batches[0]["attention_mask"].numel())
    bound = 2 * 2 * LR / EPS * (1.1e-4 + reassociation_bound(vocab_rows(w_off), tokens)) * 1.0
    for name, w in w_off.items():
        err = float((w_on[name] - w).norm())
        assert err <= bound, f"{name}: weights {err:.2e} apart in the 2-norm (bound {bound:.1e})"
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert max((w_off[k] - base[k]).abs().max().item() for k in base if k in w_off) > 5e-5


# ───────────────────────────── config: only where the numbers are the same ─────────────────────────────


def _refused(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        load_config([REUSE, "actor_rollout_ref.actor.ppo_mini_batch_size=16", *overrides])
    return str(e.value)


def test_allowed_with_hf_one_epoch_one_mini_batch():
    cfg = load_config([REUSE, "actor_rollout_ref.actor.ppo_mini_batch_size=16"])
    assert cfg.actor_rollout_ref.actor.use_rollout_log_probs is True


def test_refused_with_vllm():
    msg = _refused("actor_rollout_ref.rollout.name=vllm")
    assert "needs actor_rollout_ref.rollout.name=hf (got vllm)" in msg


def test_refused_with_several_epochs():
    msg = _refused("actor_rollout_ref.actor.ppo_epochs=2")
    assert "needs actor_rollout_ref.actor.ppo_epochs=1 (got 2)" in msg


def test_refused_with_several_mini_batches():
    msg = _refused("actor_rollout_ref.actor.ppo_mini_batch_size=8")  # the demo's 16 prompts / 8
    assert "ppo_mini_batch_size=8 != data.train_batch_size=16" in msg and "set ppo_mini_batch_size=16" in msg


def test_auto_by_default_on_exactly_where_allowed():
    """null (auto) resolves to on only where an explicit true is accepted, and says so."""
    from rlfoundry.trainer.config import auto_choices, resolve_config

    def resolved(*overrides):
        cfg = load_config(list(overrides))
        out = resolve_config(cfg, steps_per_epoch=4, cuda_available=False)
        return out.actor_rollout_ref.actor.use_rollout_log_probs, auto_choices(cfg, out)

    assert load_config([]).actor_rollout_ref.actor.use_rollout_log_probs is None
    on, said = resolved("actor_rollout_ref.actor.ppo_mini_batch_size=16")
    assert on is True and "use_rollout_log_probs=true" in said[0] and "no separate old_log_prob pass" in said[0]
    for refused in (["actor_rollout_ref.actor.ppo_mini_batch_size=8"],  # the demo: two mini-batches per step
                    ["actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.ppo_epochs=2"]):
        on, said = resolved(*refused)
        assert on is False and "old log-probs are recomputed" in said[0]
    # set explicitly: no choice about it is said; the mismatch audit (on by default) still has the rollout
    # return its log-probs, and says so; with the audit off nothing is chosen
    explicit = ("actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.use_rollout_log_probs=false")
    assert resolved(*explicit) == (False, ["actor_rollout_ref.rollout.calculate_log_probs=true: trainer.mismatch_audit "
                                           "reads the rollout's log-probs"])
    assert resolved(*explicit, "trainer.mismatch_audit=false") == (False, [])
