"""``actor_rollout_ref.model.use_fused_kernels`` through the worker: the typed config reaches the actor's
and the reference's engines, and a generate → log-prob → update round gives what it gives without."""

from __future__ import annotations

import pytest
import torch

from tests.workers import first_step_gradients, local_worker, make_prompts, one_thread, worker_config  # noqa: F401

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]
FUSED = ["model.use_fused_kernels=true", "model.fused_kernel_options.impl_backend=torch",
         "rollout.temperature=0.8", "actor.entropy_coeff=0.01"]
UNIT_ROUNDOFF = 2.0 ** -24  # float32


@pytest.mark.numerics
def test_actor_and_reference_take_the_fused_head_and_give_the_same_round(tiny_model_dir, tokenizer):
    prompts = make_prompts(tokenizer, TEXTS)
    plain = local_worker(worker_config(tiny_model_dir, FUSED[2:]), role="actor_rollout_ref")
    fused = local_worker(worker_config(tiny_model_dir, FUSED), role="actor_rollout_ref")
    assert plain.worker.engine.lm.fused is None and plain.worker.ref_policy.engine.lm.fused is None
    assert fused.worker.engine.lm.fused is not None and fused.worker.ref_policy.engine.lm.fused is not None
    data = plain.generate_sequences(prompts)  # the same sampled rows for both
    outs = {}
    for name, group in (("plain", plain), ("fused", fused)):
        # a copy per head: union writes in place, and each head's entropies may differ in the last bit
        scored = data.select(deepcopy=True).union(group.compute_log_prob(data)).union(group.compute_ref_log_prob(data))
        mask = scored.batch["response_mask"]
        scored.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(1)) * mask
        metrics = group.update_actor(scored).meta_info["metrics"]
        outs[name] = scored, metrics, first_step_gradients(group.worker.optimizer, group.worker.actor.module)
    (p_data, p_metrics, p_grads), (f_data, f_metrics, f_grads) = outs["plain"], outs["fused"]
    for key in ("old_log_probs", "ref_log_prob"):
        # the fused head sums the vocabulary in chunks: fp32 rounding only: the same forward in another order
        # (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(f_data.batch[key], p_data.batch[key], atol=1e-5, rtol=1e-5, msg=key)
    for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
        # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
        assert f_metrics[key] == pytest.approx(p_metrics[key], rel=1e-4)
    # What the head is responsible for is the gradient it sends back, not Adam's step: the first step
    # moves each weight by lr * g / (|g| + eps), about lr * sign(g), so a gradient near zero whose last
    # bits differ (the fused head sums the vocabulary in chunks, in another order, and the CPU's vector
    # width changes the order again) can move its weight anywhere in [-lr, lr] (#51: 4.3e-6 on an Intel
    # Xeon, 2.7e-6 here with ATEN_CPU_CAPABILITY=default). The gradients agree normwise within float32
    # re-association over the longest reduction: the vocabulary plus the batch's tokens (measured 5e-7,
    # the bound 3e-5; a head that drops the temperature or the entropy term is off by 1e-2 or more).
    tokens = int(data.batch["input_ids"].numel())
    bound = UNIT_ROUNDOFF * (tokenizer_vocab(plain) + tokens)
    for name, grad in p_grads.items():
        err = (f_grads[name] - grad).norm() / grad.norm().clamp_min(1e-30)
        assert err <= bound, f"{name}: the fused head's gradient is {err:.2e} from the plain head's (bound {bound:.1e})"


def tokenizer_vocab(group) -> int:
    return int(group.worker.actor.module.config.vocab_size)
