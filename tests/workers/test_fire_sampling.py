"""FIRE sampling (``actor_rollout_ref.rollout.use_fire_sampling``, verl's fire_vllm_rollout): the first
response token drawn at temperature 30 among the top 16 (a positive user top_k kept), every later one
with the normal settings; greedy and validation calls untouched; the dynamic and static decode loops
give the same tokens and log-probs; the config refuses it with engines that do not build it."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.config.schema import RolloutConfig
from rlfoundry.config.typed import ConfigError
from rlfoundry.config.verl_compat import no_effect_keys_set
from rlfoundry.trainer.config import load_config, resolve_config, validate_config
from rlfoundry.workers.rollout.base import SamplingParams, resolve_sampling_params
from rlfoundry.workers.rollout.hf_rollout import HFRollout, _seed_for_call
from rlfoundry.workers.rollout.static_decode import StaticDecoder
from tests.workers import make_prompts, worker_config

TEXTS = ["hello world", "the quick brown fox", "12+7="]
FIRE = "rollout.use_fire_sampling=true"


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _engine(model, tiny_model_dir, tokenizer, overrides=(), static=False):
    cfg = worker_config(tiny_model_dir, ["rollout.response_length=6", *overrides])["rollout"]
    engine = HFRollout(model, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=static)
    if static:
        engine._static = StaticDecoder(model, sync_every=2)  # uncompiled: the CPU runs the static path as is
    return engine


def _generate(engine, prompts, **meta):
    data = prompts.select()
    data.meta_info.update(meta)
    return engine.generate_sequences(data).batch


def _teacher_forced_logits(model, out) -> torch.Tensor:
    """(N, Tr, V): the logits each response token was drawn from, by one full forward over the sequences."""
    prompt_width = out["prompts"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits.float()
    return logits[:, prompt_width - 1: -1]


def _draw(logits: torch.Tensor, temperature: float, top_k: int, u: torch.Tensor):
    """Inverse-CDF draw by hand: softmax(logits / T) kept to its top_k (0: all), one uniform per row.
    Returns tokens and their log-probs under the unfiltered softmax(logits / T)."""
    scaled = logits / temperature
    kept = scaled
    if top_k > 0:
        kth = scaled.sort(dim=-1, descending=True).values[:, top_k - 1: top_k]
        kept = scaled.where(scaled >= kth, torch.tensor(float("-inf")))
    cdf = kept.softmax(-1).cumsum(-1)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
    return tokens, scaled.log_softmax(-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("top_k, first_top_k", [(-1, 16), (5, 5)], ids=["top-k-off", "user-top-k-kept"])
@pytest.mark.numerics
def test_fire_replays_by_hand(model, tiny_model_dir, tokenizer, top_k, first_top_k):
    """Every token equals a hand draw with the engine's own uniforms (the t-th (N, 1) draw of the call's
    generator at step t): token 0 at temperature 30 within the top 16 (or the user's top-k), tokens 1..
    at the configured temperature 0.7; the log-probs are those temperatures' log-softmax."""
    engine = _engine(model, tiny_model_dir, tokenizer, [FIRE, "rollout.temperature=0.7", f"rollout.top_k={top_k}"])
    n, width = 4, 6
    out = _generate(engine, make_prompts(tokenizer, TEXTS), n=n, eos_token_id=[-1])  # never stops: every step drawn
    logits = _teacher_forced_logits(model, out)
    total = len(TEXTS) * n
    gen = torch.Generator().manual_seed(_seed_for_call(engine.config.seed, 0, 0))
    uniforms = [torch.rand((total, 1), generator=gen) for _ in range(width)]
    first, first_lp = _draw(logits[:, 0], 30.0, first_top_k, uniforms[0])
    assert torch.equal(out["responses"][:, 0], first)
    # the sampler's log-softmax at its own temperature vs a recomputation: fp32 rounding of log-probs ~O(10)
    torch.testing.assert_close(out["rollout_log_probs"][:, 0], first_lp, atol=1e-4, rtol=0)
    top = logits[:, 0].topk(first_top_k, dim=-1).indices
    assert (top == first.unsqueeze(1)).any(-1).all(), "a FIRE first token outside the top-k"
    for t in range(1, width):
        tokens, lp = _draw(logits[:, t], 0.7, max(top_k, 0), uniforms[t])
        assert torch.equal(out["responses"][:, t], tokens), f"step {t}"
        torch.testing.assert_close(out["rollout_log_probs"][:, t], lp, atol=1e-4, rtol=0)


@pytest.mark.numerics
def test_fire_changes_only_the_first_token_draw(model, tiny_model_dir, tokenizer):
    """Same seed with and without FIRE: the first tokens differ (at temperature 30 most rows pick another
    token), the reported first log-probs are far flatter; the draws after it use the same uniforms."""
    prompts = make_prompts(tokenizer, TEXTS)
    fire = _generate(_engine(model, tiny_model_dir, tokenizer, [FIRE]), prompts, n=8, eos_token_id=[-1])
    plain = _generate(_engine(model, tiny_model_dir, tokenizer), prompts, n=8, eos_token_id=[-1])
    assert not torch.equal(fire["responses"][:, 0], plain["responses"][:, 0])
    fire_logits = _teacher_forced_logits(model, fire)[:, 0]
    # the sampler's log-softmax at its own temperature vs a recomputation: fp32 rounding of log-probs ~O(10)
    torch.testing.assert_close(fire["rollout_log_probs"][:, 0],
                               (fire_logits / 30).log_softmax(-1).gather(-1, fire["responses"][:, :1]).squeeze(-1),
                               atol=1e-4, rtol=0)
    # rows whose first token agrees decode the same prefix with the same uniforms: identical from there on
    same = fire["responses"][:, 0] == plain["responses"][:, 0]
    assert torch.equal(fire["responses"][same], plain["responses"][same])


@pytest.mark.parametrize("meta", [{"do_sample": False}, {"validate": True}], ids=["greedy", "validation"])
def test_greedy_and_validation_are_untouched(model, tiny_model_dir, tokenizer, meta):
    """verl's greedy call sets temperature 0 for the FIRE token too; validation (val_kwargs, here sampled
    at temperature 1) never draws one."""
    overrides = ["rollout.val_kwargs.do_sample=true", "rollout.val_kwargs.temperature=1.0"]
    prompts = make_prompts(tokenizer, TEXTS)
    fire = _generate(_engine(model, tiny_model_dir, tokenizer, [FIRE, *overrides]), prompts, eos_token_id=[-1], **meta)
    plain = _generate(_engine(model, tiny_model_dir, tokenizer, overrides), prompts, eos_token_id=[-1], **meta)
    assert torch.equal(fire["responses"], plain["responses"])
    assert torch.equal(fire["rollout_log_probs"], plain["rollout_log_probs"])


@pytest.mark.parametrize("meta", [{}, {"top_k": 20, "top_p": 0.9, "temperature": 0.7}], ids=["plain", "top-k-top-p"])
@pytest.mark.numerics
def test_static_decode_equals_dynamic_with_fire(model, tiny_model_dir, tokenizer, meta):
    prompts = make_prompts(tokenizer, TEXTS)
    eos = list(range(0, 260, 3))  # rows end at assorted steps
    dynamic = _engine(model, tiny_model_dir, tokenizer, [FIRE])
    static = _engine(model, tiny_model_dir, tokenizer, [FIRE], static=True)
    for _ in range(2):
        a = _generate(dynamic, prompts, n=4, eos_token_id=eos, **meta)
        b = _generate(static, prompts, n=4, eos_token_id=eos, **meta)
        assert torch.equal(a["responses"], b["responses"]) and torch.equal(a["response_mask"], b["response_mask"])
        # the static (CUDA-graph-shaped) decode vs the dynamic loop: fp32 rounding only: the same forward in another
        # order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=2e-5, rtol=0)


def test_for_token_settings():
    base = SamplingParams(temperature=0.7, top_k=-1, top_p=0.9, fire=True)
    first = base.for_token(0)
    assert (first.temperature, first.top_k, first.top_p, first.logprob_temperature) == (30.0, 16, 0.9, 30.0)
    assert base.for_token(1) is base
    assert SamplingParams(top_k=5, fire=True).for_token(0).top_k == 5
    assert SamplingParams(do_sample=False, fire=True).for_token(0).greedy
    assert SamplingParams().for_token(0) == SamplingParams()  # off by default
    cfg = RolloutConfig(use_fire_sampling=True)
    assert resolve_sampling_params(cfg, {}).fire and not resolve_sampling_params(cfg, {"validate": True}).fire
    assert not resolve_sampling_params(RolloutConfig(), {}).fire


def test_config_takes_the_key_and_refuses_it_where_not_built():
    key = "actor_rollout_ref.rollout.use_fire_sampling"
    cfg = load_config([f"{key}=true"])
    assert no_effect_keys_set(cfg, [key]) == []
    assert RolloutConfig().use_fire_sampling is False
    for name in ("vllm", "sglang"):
        errors = RolloutConfig(name=name, use_fire_sampling=True).check()
        assert any(f"{key}=true" in e and "rollout.name=hf" in e for e in errors), errors
    # the first token's log-prob is at temperature 30: never reused as the old log-probs
    one_batch = ["actor_rollout_ref.actor.ppo_mini_batch_size=${data.train_batch_size}"]
    reuse = lambda *o: resolve_config(load_config([*one_batch, *o]), steps_per_epoch=1,  # noqa: E731
                                      cuda_available=False).actor_rollout_ref.actor.use_rollout_log_probs
    assert reuse() is True and reuse(f"{key}=true") is False
    with pytest.raises(ConfigError, match="use_fire_sampling"):
        validate_config(load_config([*one_batch, f"{key}=true", "actor_rollout_ref.actor.use_rollout_log_probs=true"]))
