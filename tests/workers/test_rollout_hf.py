"""The HF rollout engine: output contract, agreement with HF generate and with the actor, seeding."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.workers.rollout import get_rollout_class, resolve_sampling_params
from rlfoundry.workers.rollout.base import SamplingParams
from rlfoundry.workers.rollout.hf_rollout import filter_logits, sample_tokens
from tests.workers import local_worker, make_prompts, one_thread, worker_config  # noqa: F401 (fixture)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]


@pytest.fixture(scope="module")
def group(tiny_model_dir):
    return local_worker(worker_config(tiny_model_dir))


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer, TEXTS)


def _stop_ids(group, prompts, k: int = 40) -> list[int]:
    """EOS ids that make greedy rows stop at different steps: tokens greedy decoding emits midway."""
    out = group.generate_sequences(_with_meta(prompts, do_sample=False, n=1))
    return sorted({int(t) for t in out.batch["responses"][:, 3:8].flatten()})[:k]


def _with_meta(data, **meta):
    copy = data.select()
    copy.meta_info.update(meta)
    return copy


def test_greedy_equals_hf_generate_token_for_token(group, prompts, tiny_model_dir, tokenizer):
    eos = _stop_ids(group, prompts)[:3]  # some rows stop early, so finished rows leave the batch
    out = group.generate_sequences(_with_meta(prompts, do_sample=False, n=1, eos_token_id=eos))
    ref_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
    ref = ref_model.generate(
        input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=12,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id,
    )[:, ids.shape[1]:]
    ref = torch.nn.functional.pad(ref, (0, 12 - ref.shape[1]), value=tokenizer.pad_token_id)
    assert torch.equal(out.batch["responses"], ref)
    lengths = out.batch["response_mask"].sum(-1)
    assert lengths.min() < 12 and len(set(lengths.tolist())) > 1, "the test should exercise early stops"


def test_eos_stops_and_masks_through_eos(group, prompts, tokenizer):
    eos = list(range(0, 260, 3))  # a third of the vocabulary: samples end at assorted lengths
    out = group.generate_sequences(_with_meta(prompts, n=3, eos_token_id=eos))
    b = out.batch
    tp = prompts.batch["input_ids"].shape[1]
    assert b["responses"].shape == (12, 12) and b["input_ids"].shape == (12, tp + 12)
    for row in range(12):
        resp, mask = b["responses"][row], b["response_mask"][row]
        hits = [t for t in range(12) if int(resp[t]) in eos]
        length = hits[0] + 1 if hits else 12
        assert mask.tolist() == [1] * length + [0] * (12 - length)  # 1 up to and including EOS
        assert (resp[length:] == tokenizer.pad_token_id).all()
        assert (b["rollout_log_probs"][row, length:] == 0).all()
    assert torch.equal(b["attention_mask"][:, tp:], b["response_mask"])
    assert set(b["response_mask"].sum(-1).tolist()) != {12}
    # positions continue from the prompt's last position, also past EOS
    last = prompts.batch["position_ids"][:, -1].repeat_interleave(3)
    assert torch.equal(b["position_ids"][:, tp:], last[:, None] + torch.arange(1, 13))


def test_ignore_eos_always_samples_the_full_response_length(tiny_model_dir, prompts):
    """verl/vLLM's benchmarking knob: the EOS ids that stop the test above stop nothing here."""
    group = local_worker(worker_config(tiny_model_dir, ["rollout.ignore_eos=true"]))
    eos = list(range(0, 260, 3))
    out = group.generate_sequences(_with_meta(prompts, n=3, eos_token_id=eos))
    assert (out.batch["response_mask"] == 1).all()
    assert any(int(t) in eos for t in out.batch["responses"].flatten())  # EOS ids were sampled, and passed


def test_n_samples_are_interleaved_and_columns_repeated(group, prompts):
    out = group.generate_sequences(_with_meta(prompts, n=3))
    b = out.batch
    assert torch.equal(b["prompts"], prompts.batch["input_ids"].repeat_interleave(3, dim=0))
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(3)]
    assert list(out.non_tensor_batch["data_source"]) == ["test"] * 12
    # one prefill shared by the n samples, yet the samples differ (temperature 1, random model)
    assert not torch.equal(b["responses"][0], b["responses"][1])


def test_seeded_sampling_reproduces_and_resumes(tiny_model_dir, prompts):
    a = local_worker(worker_config(tiny_model_dir, ["rollout.seed=123"]), role="rollout")
    b = local_worker(worker_config(tiny_model_dir, ["rollout.seed=123"]), role="rollout")
    first_a, first_b = a.generate_sequences(prompts), b.generate_sequences(prompts)
    assert torch.equal(first_a.batch["responses"], first_b.batch["responses"])
    second_a = a.generate_sequences(prompts)
    assert not torch.equal(first_a.batch["responses"], second_a.batch["responses"])  # a new draw per call
    # a fresh engine given the first engine's state after one call continues exactly where it was
    c = local_worker(worker_config(tiny_model_dir, ["rollout.seed=999"]), role="rollout")
    c.worker.rollout.load_state_dict({"seed": 123, "calls": 1})
    assert torch.equal(c.generate_sequences(prompts).batch["responses"], second_a.batch["responses"])


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.numerics
def test_rollout_log_probs_match_compute_log_prob(group, prompts, temperature):
    out = group.generate_sequences(_with_meta(prompts, temperature=temperature, n=2))
    out.meta_info["temperature"] = temperature
    recomputed = group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    # the incremental (KV-cache) decode vs the actor's full forward: fp32 rounding only: the same forward in another
    # order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(recomputed[mask], out.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)


def test_sampling_params_merge_config_val_kwargs_and_meta(tiny_model_dir):
    cfg = worker_config(tiny_model_dir).rollout
    train = resolve_sampling_params(cfg, {})
    assert (train.n, train.temperature, train.do_sample, train.greedy) == (2, 1.0, True, False)
    val = resolve_sampling_params(cfg, {"validate": True})
    assert (val.n, val.greedy, val.logprob_temperature) == (1, True, 1.0)  # T=0: log-probs at T=1
    over = resolve_sampling_params(cfg, {"validate": True, "n": 4, "temperature": 0.5, "response_length": 3})
    assert (over.n, over.temperature, over.response_length, over.do_sample) == (4, 0.5, 3, False)


def test_filter_logits_top_k_and_top_p_by_hand():
    # probs 0.5, 0.25, 0.125, 0.125 (log-space logits)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]]))
    keep = lambda k, p: torch.isfinite(filter_logits(logits, k, p))[0].tolist()  # noqa: E731
    assert keep(2, 1.0) == [True, True, False, False]
    assert keep(-1, 0.5) == [True, False, False, False]  # 0.5 already reaches top_p
    assert keep(0, 0.6) == [True, True, False, False]  # mass before token 2 is 0.75 >= 0.6
    assert keep(0, 1.0) == [True] * 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sample_tokens_draws_from_softmax_and_reports_its_log_prob(temperature):
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05, 0.0])  # the last token can never be drawn
    draws = 40_000
    logits = torch.log(probs).expand(draws, -1) * temperature  # softmax(logits / T) = probs
    generator = torch.Generator().manual_seed(0)
    tokens, log_prob = sample_tokens(logits, SamplingParams(temperature=temperature), generator)
    freq = torch.bincount(tokens, minlength=6).double() / draws
    # 4 standard errors of a binomial frequency at p = 0.4 over 40k draws is 0.0098
    assert torch.allclose(freq, probs.double(), atol=0.01), freq
    assert freq[-1] == 0
    expected = torch.log_softmax(logits / temperature, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(log_prob, expected, atol=1e-6, rtol=0)


def test_sample_tokens_filtered_and_greedy_report_unfiltered_log_probs():
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.125, 0.125]])).expand(4000, -1)
    full = torch.log_softmax(logits, dim=-1)
    tokens, log_prob = sample_tokens(logits, SamplingParams(top_k=2), torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}  # only the top 2 are drawn, about 2:1
    assert 0.62 < (tokens == 0).double().mean() < 0.71
    torch.testing.assert_close(log_prob, full.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), atol=1e-6, rtol=0)
    tokens, log_prob = sample_tokens(logits[:1], SamplingParams(do_sample=False), None)
    assert tokens.tolist() == [0] and abs(float(log_prob) - float(full[0, 0])) < 1e-6


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_without_vllm_names_the_install_command():
    with pytest.raises(ImportError, match=r"pip install -e \.\[vllm\]"):
        get_rollout_class("vllm")
    with pytest.raises(ValueError, match="known engines"):
        get_rollout_class("hf-typo")


def test_validate_flag_uses_val_kwargs_greedy(group, prompts):
    a = group.generate_sequences(_with_meta(prompts, validate=True))
    b = group.generate_sequences(_with_meta(prompts, validate=True))
    assert len(a) == len(TEXTS)  # val_kwargs.n = 1
    assert torch.equal(a.batch["responses"], b.batch["responses"])  # greedy: no randomness
    assert np.array_equal(a.non_tensor_batch["uid"], prompts.non_tensor_batch["uid"])


def test_prefill_skips_the_padding_every_prompt_has(tiny_model_dir, tokenizer):
    """Prompts padded to 48 instead of 24 give the same samples and log-probs, and the outputs keep
    the 48 columns; the model's first call sees only the longest prompt's columns."""
    wide, narrow = make_prompts(tokenizer, TEXTS, 48), make_prompts(tokenizer, TEXTS, 24)
    longest = int(narrow.batch["attention_mask"].sum(-1).max())
    outs, prefill_widths = [], []
    for batch in (narrow, wide):
        group = local_worker(worker_config(tiny_model_dir, ["rollout.seed=7"]), role="rollout")
        widths = []
        hook = group.worker.rollout.module.register_forward_pre_hook(
            lambda m, a, kw: widths.append(kw["input_ids"].shape[1]), with_kwargs=True)
        outs.append(group.generate_sequences(_with_meta(batch, n=2)))
        hook.remove()
        prefill_widths.append(widths[0])
    assert prefill_widths == [longest, longest]
    assert outs[1].batch["prompts"].shape[1] == 48 and outs[1].batch["input_ids"].shape[1] == 48 + outs[1].batch["responses"].shape[1]
    assert torch.equal(outs[0].batch["responses"], outs[1].batch["responses"])
    # the same draws in another batch composition: fp32 rounding
    torch.testing.assert_close(outs[0].batch["rollout_log_probs"], outs[1].batch["rollout_log_probs"], atol=1e-6, rtol=0)
    torch.testing.assert_close(outs[0].batch["position_ids"][:, 24:], outs[1].batch["position_ids"][:, 48:], atol=0, rtol=0)


def test_the_kv_cache_goes_by_the_keyword_the_installed_transformers_takes(group, prompts, tiny_model_dir):
    """transformers 5.2x renamed forward's ``past_key_values`` to ``cache`` (the old name warns and goes
    in 5.40); older releases only know ``past_key_values``. Decoding and the shared-prompt log-prob pass
    use the model's own keyword, under peft too, so neither warns."""
    import inspect
    import warnings

    from rlfoundry.models.hf import kv_cache_kwargs

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    (keyword,) = kv_cache_kwargs(model, None)
    assert keyword in inspect.signature(type(model).forward).parameters
    peft = pytest.importorskip("peft")
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    assert kv_cache_kwargs(wrapped, None) == {keyword: None}
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = group.generate_sequences(_with_meta(prompts, n=2))
        out.meta_info["temperature"] = 1.0
        group.compute_log_prob(out)


def test_rollout_log_probs_are_returned_only_with_calculate_log_probs(tiny_model_dir, prompts):
    """verl's rollout.calculate_log_probs: off, the batch carries no rollout_log_probs (the trainer
    then logs no training/rollout_probs_diff_*); on, it does (worker_config turns it on)."""
    off = local_worker(worker_config(tiny_model_dir, ["rollout.calculate_log_probs=false"]))
    out = off.generate_sequences(prompts)
    assert "rollout_log_probs" not in out.batch.keys() and "responses" in out.batch.keys()
    with_them = local_worker(worker_config(tiny_model_dir)).generate_sequences(prompts)
    assert with_them.batch["rollout_log_probs"].shape == out.batch["responses"].shape
    torch.testing.assert_close(with_them.batch["responses"], out.batch["responses"], rtol=0, atol=0)  # same draw
