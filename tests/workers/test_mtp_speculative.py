"""Speculative decoding with MiMo's MTP layers as the draft (HF rollout, ``model.mtp.enable_rollout``):
greedy equals plain greedy, log-probs are the actor's, sampling keeps the target's distribution, the
start-up checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlfoundry.models.hf import load_hf_model
from rlfoundry.models.mimo import MTP_LAYER_PREFIX, save_tiny_mimo
from rlfoundry.protocol import DataProto
from rlfoundry.workers.rollout.hf_rollout import HFRollout
from tests.workers import local_worker, make_prompts, one_thread, worker_config  # noqa: F401 (fixture)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7="]


def _good_draft_mimo(src: Path, out: Path, layer_scale: float) -> Path:
    """A MiMo whose MTP layer predicts well: the target's decoder layers write ``layer_scale`` of their output
    (so the target is close to a bigram model: its next token depends mostly on the last one, but not only),
    and the MTP layer computes that bigram exactly: no attention or MLP output, ``input_proj`` passing the
    normed token embedding through, ``final_layernorm`` the target's final norm. Then lm_head(out_t) is the
    target's distribution after token t+1 if its layers wrote nothing."""
    shutil.copytree(src, out)
    tensors = load_file(str(out / "model.safetensors"))
    hidden = tensors["model.norm.weight"].shape[0]
    for name in list(tensors):
        if name.startswith("model.layers.") and name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = tensors[name] * layer_scale
    mtp = f"{MTP_LAYER_PREFIX}0."
    for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
        tensors[mtp + name] = torch.zeros_like(tensors[mtp + name])
    tensors[mtp + "token_layernorm.weight"] = torch.ones(hidden)
    tensors[mtp + "input_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    tensors[mtp + "final_layernorm.weight"] = tensors["model.norm.weight"].clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def mimo_dirs(tmp_path_factory):
    """``bad``: MTP weights random (save_tiny_mimo's); ``good``: ``_good_draft_mimo``; ``bigram``: the same at
    layer scale 0 (the draft is exact)."""
    base = save_tiny_mimo(tmp_path_factory.mktemp("mimo") / "bad")
    return {"bad": base, "good": _good_draft_mimo(base, base.parent / "good", 0.3),
            "bigram": _good_draft_mimo(base, base.parent / "bigram", 0.0)}


@pytest.fixture(scope="module")
def prompts(tokenizer):
    return make_prompts(tokenizer, TEXTS)


def _engines(model_dir: Path, k: int, **config):
    model = load_hf_model(model_dir).eval()
    cfg = {"response_length": 16, "n": 1, "seed": 3, **config}
    eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", 0)
    plain = HFRollout(model, cfg, 0, eos)
    spec = HFRollout(model, cfg, 0, eos, mtp_draft_path=model_dir, speculative_tokens=k)
    return plain, spec


def _meta(data: DataProto, **meta) -> DataProto:
    copy = data.select()
    copy.meta_info.update(meta)
    return copy


@pytest.mark.parametrize("draft,k", [("bad", 1), ("bad", 3), ("good", 1), ("good", 3), ("good", 5)])
def test_greedy_equals_plain_greedy_token_for_token(mimo_dirs, prompts, draft, k):
    plain, spec = _engines(mimo_dirs[draft], k)
    ref = plain.generate_sequences(_meta(prompts, do_sample=False, n=2))
    # EOS ids greedy emits midway: rows stop at different steps, and leave the batch at different rounds
    eos = sorted({int(t) for t in ref.batch["responses"][:, 4:7].flatten()})[:3]
    ref = plain.generate_sequences(_meta(prompts, do_sample=False, n=2, eos_token_id=eos))
    out = spec.generate_sequences(_meta(prompts, do_sample=False, n=2, eos_token_id=eos))
    assert torch.equal(out.batch["responses"], ref.batch["responses"])
    assert torch.equal(out.batch["response_mask"], ref.batch["response_mask"])
    torch.testing.assert_close(out.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], atol=1e-5, rtol=0)
    lengths = ref.batch["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 1, "the test should exercise early stops"
    drafted, accepted = out.batch["mtp_draft_tokens"], out.batch["mtp_accepted_tokens"]
    assert bool((accepted <= drafted).all()) and bool((drafted[lengths > 1] > 0).all())
    assert bool((drafted[lengths == 1] == 0).all())  # a row ending at its first token drafts nothing
    if draft == "good":  # ragged acceptance: rows accept different counts, some drafts rejected
        rate = accepted.sum() / drafted.sum()
        assert 0.2 < float(rate) < 1.0 and len(set((accepted / drafted).tolist())) > 1, (accepted, drafted)


def test_single_row_batches_match_the_batched_call(mimo_dirs, prompts):
    """Padding and batch layout: each prompt decoded alone equals its rows of the batched call."""
    _, spec = _engines(mimo_dirs["good"], 3)
    both = spec.generate_sequences(_meta(prompts, do_sample=False, n=1))
    for i in range(len(TEXTS)):
        alone = spec.generate_sequences(_meta(prompts[i:i + 1], do_sample=False, n=1))
        assert torch.equal(alone.batch["responses"][0], both.batch["responses"][i])


def test_top_logprobs_are_the_plain_loops(mimo_dirs, prompts):
    """``top_logprobs=k`` (the OpenAI endpoint): each emitted token's k most likely tokens and log-probs, as the
    plain loop gives them (greedy: the same tokens)."""
    plain, spec = _engines(mimo_dirs["good"], 3)
    ref = plain.generate_sequences(_meta(prompts, do_sample=False, top_logprobs=3))
    out = spec.generate_sequences(_meta(prompts, do_sample=False, top_logprobs=3))
    assert torch.equal(out.batch["rollout_top_ids"], ref.batch["rollout_top_ids"])
    torch.testing.assert_close(out.batch["rollout_top_logprobs"], ref.batch["rollout_top_logprobs"], atol=1e-5, rtol=0)


def test_a_multi_turn_tool_conversation_is_the_plain_engines(tmp_path, tokenizer):
    """``rollout.multi_turn.enable`` (agent loops over the engine): the taught tool policy made a MiMo (a random
    MTP layer) runs the same conversation greedily with the draft as ``test_agent_loop``'s does without it."""
    from rlfoundry.models.mimo import add_mtp_layers
    from tests.workers.test_agent_loop import QUESTION, TOOLS, _loop, _prompts, tool_policy

    policy = add_mtp_layers(tool_policy(tmp_path / "policy"))
    outs = []
    for extra in ([], ["model.mtp.enable_rollout=true", "model.mtp.num_speculative_tokens=2"]):
        group = local_worker(worker_config(policy, [
            "rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={TOOLS}",
            "rollout.response_length=200", "rollout.val_kwargs.n=1", *extra]), role="actor_rollout")
        speculator, calls = group.worker.rollout.speculator, []
        if speculator is not None:  # count the turns the draft decoded
            decode = speculator.decode
            speculator.decode = lambda *a, **k: calls.append(1) or decode(*a, **k)
        _, kwargs = _loop(tokenizer, {})
        data = _prompts(tokenizer, kwargs, [QUESTION])
        data.meta_info["validate"] = True  # greedy
        outs.append(group.generate_sequences(data))
    assert len(calls) >= 2  # each assistant turn
    assert outs[0].non_tensor_batch["num_turns"][0] == 3  # the tool was called and answered
    assert torch.equal(outs[1].batch["responses"], outs[0].batch["responses"])
    assert torch.equal(outs[1].batch["response_mask"], outs[0].batch["response_mask"])
    torch.testing.assert_close(outs[1].batch["rollout_log_probs"], outs[0].batch["rollout_log_probs"], atol=1e-5, rtol=0)


def test_sampled_log_probs_are_the_actors(mimo_dirs, prompts):
    """The rollout's log-probs of its sampled tokens equal the actor's ``compute_log_prob`` (fp32 tolerance,
    as for the plain loop: tests/workers/test_rollout_hf.py)."""
    group = local_worker(worker_config(mimo_dirs["good"], ["model.mtp.enable_rollout=true",
                                                          "model.mtp.num_speculative_tokens=3",
                                                          "rollout.temperature=0.8"]))
    out = group.generate_sequences(_meta(prompts, n=2, temperature=0.8))
    assert "mtp_draft_tokens" in out.batch.keys()
    out.meta_info["temperature"] = 0.8
    recomputed = group.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    torch.testing.assert_close(recomputed[mask], out.batch["rollout_log_probs"][mask], atol=1e-5, rtol=0)


# ---- distribution ------------------------------------------------------------------------------------------

TOP_K, WIDTH, ROWS = 6, 4, 6000


def _exact_paths(model, prompt_ids: torch.Tensor, temperature: float) -> torch.Tensor:
    """P(t1 … t4) under the target with top-k sampling, over all TOP_K^4 paths: (V,)*4 sparse as a dict."""
    probs = {(): 1.0}
    for _ in range(WIDTH):
        prefixes = list(probs)
        ids = torch.stack([torch.cat([prompt_ids, torch.tensor(p, dtype=torch.long)]) for p in prefixes])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, -1].float() / temperature
        from rlfoundry.workers.rollout.hf_rollout import filter_logits

        p = torch.softmax(filter_logits(logits, TOP_K, 1.0), dim=-1)
        nxt = {}
        for prefix, row in zip(prefixes, p):
            for t in row.nonzero().squeeze(1).tolist():
                nxt[prefix + (t,)] = probs[prefix] * float(row[t])
        probs = nxt
    return probs


def _chi_square_p(counts: dict, expected: dict, n: int) -> float:
    """Pearson's chi-square test of ``counts`` against ``expected`` probabilities; cells with fewer than 5
    expected draws pooled into one."""
    stat, small_obs, small_exp, cells = 0.0, 0, 0.0, 0
    for key, prob in expected.items():
        e = prob * n
        if e < 5:
            small_obs, small_exp = small_obs + counts.get(key, 0), small_exp + e
            continue
        stat += (counts.get(key, 0) - e) ** 2 / e
        cells += 1
    if small_exp > 0:
        stat += (small_obs - small_exp) ** 2 / small_exp
        cells += 1
    assert not set(counts) - set(expected), "a sampled path the target gives probability 0"
    # the chi-square survival function: the regularised upper incomplete gamma Q(df/2, stat/2)
    return float(torch.special.gammaincc(torch.tensor((cells - 1) / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def _marginal(paths: dict, which: slice) -> dict:
    out: dict = {}
    for path, p in paths.items():
        out[path[which]] = out.get(path[which], 0.0) + p
    return out


@pytest.mark.parametrize("draft", ["bad", "good"])
def test_sampling_keeps_the_target_distribution(mimo_dirs, tokenizer, draft):
    """Over ROWS independent rows (each its own uniforms), the empirical distribution of the 4 sampled tokens
    (the first plainly sampled, then rounds of k=2 drafts: acceptances, corrections and bonus tokens) matches
    the target's exact one under top-k / temperature: Pearson chi-square on (t2, t3) jointly and on t4, each
    p > 1e-4 (a correct sampler fails this 1 in 10^4 runs; a sampler that emits q's or p's tokens on rejection
    instead of the residual's fails it with the random draft at p ~ 0). The good draft's acceptance rate is
    well above the random one's."""
    model_dir = mimo_dirs[draft]
    _, spec = _engines(model_dir, 2, response_length=WIDTH, ignore_eos=True)  # every row samples WIDTH tokens
    prompt = make_prompts(tokenizer, ["the quick"], max_prompt_length=12)
    out = spec.generate_sequences(_meta(prompt, n=ROWS, temperature=0.9, top_k=TOP_K))
    samples = [tuple(r) for r in out.batch["responses"].tolist()]
    ids = prompt.batch["input_ids"][0][prompt.batch["attention_mask"][0].bool()]
    exact = _exact_paths(spec.module, ids, 0.9)
    for which in (slice(1, 3), slice(3, 4), slice(0, 1)):
        counts: dict = {}
        for s in samples:
            counts[s[which]] = counts.get(s[which], 0) + 1
        p = _chi_square_p(counts, _marginal(exact, which), ROWS)
        assert p > 1e-4, (which, p)
    rate = float(out.batch["mtp_accepted_tokens"].sum() / out.batch["mtp_draft_tokens"].sum())
    if draft == "good":
        assert rate > 0.5, rate
    else:
        assert rate < 0.35, rate


def test_keyed_draws_are_per_row_and_reproducible(mimo_dirs, prompts):
    """``sample_keys`` (agent loops' server): a row's samples depend on its key, not its batch slot."""
    _, spec = _engines(mimo_dirs["good"], 2)
    both = spec.generate_sequences(_meta(prompts, n=1, sample_keys=[5, 6, 7, 8]))
    alone = spec.generate_sequences(_meta(prompts[2:3], n=1, sample_keys=[7]))
    assert torch.equal(alone.batch["responses"][0], both.batch["responses"][2])


# ---- configuration -----------------------------------------------------------------------------------------

def test_start_up_checks(mimo_dirs, tiny_model_dir):
    import warnings

    from rlfoundry.trainer.config import ConfigError, load_config

    path = f"actor_rollout_ref.model.path={mimo_dirs['good']}"

    def load(*keys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # later keys win: a test's own model path replaces the MiMo
            return load_config([path, "actor_rollout_ref.model.mtp.enable_rollout=true", *keys])

    def error(*keys):
        with pytest.raises(ConfigError) as e:
            load(*keys)
        return str(e.value)

    assert load().actor_rollout_ref.model.mtp.enable_rollout
    assert load("actor_rollout_ref.model.mtp.num_speculative_tokens=3").actor_rollout_ref.model.mtp.num_speculative_tokens == 3
    for engine in ("vllm", "sglang"):
        message = error(f"actor_rollout_ref.rollout.name={engine}")
        assert f"rollout.name={engine}" in message and "HF rollout engine only" in message, message
    assert "use_torch_compile=true" in error("actor_rollout_ref.rollout.use_torch_compile=true")
    assert "exact_log_probs=true" in error("actor_rollout_ref.rollout.exact_log_probs=true")
    assert "enable_rollout_routing_replay=true" in error("actor_rollout_ref.rollout.enable_rollout_routing_replay=true")
    assert "method=mtp" in error("actor_rollout_ref.model.mtp.method=eagle")
    qwen = error(f"actor_rollout_ref.model.path={tiny_model_dir}")  # a Qwen2: no MTP layers to draft with
    assert "model_type mimo" in qwen and "not model_type 'qwen2'" in qwen, qwen
    assert "at least 1" in error("actor_rollout_ref.model.mtp.num_speculative_tokens=0")


# ---- end to end --------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_grpo_with_the_mtp_draft_reports_its_acceptance_rate(mimo_dirs, tmp_path):
    """A tiny GRPO run (in-process workers, the FSDP actor, the HF rollout drafting 2 tokens a round with the
    MTP layer): it trains, and each step logs ``rollout/mtp_accept_rate`` (the good draft: most accepted)."""
    from tests.trainer import _e2e as E

    run_dir = tmp_path / "run"
    run = E.train(E.tiny_overrides(mimo_dirs["good"], run_dir, "trainer.worker_backend=local",
                                   "algorithm.adv_estimator=grpo", "actor_rollout_ref.model.mtp.enable_rollout=true",
                                   "actor_rollout_ref.model.mtp.num_speculative_tokens=2",
                                   "data.max_response_length=8", "actor_rollout_ref.rollout.calculate_log_probs=true"))
    for step in (1, 2):
        record = run.step(step)
        assert 0.3 < record["rollout/mtp_accept_rate"] <= 1.0, record["rollout/mtp_accept_rate"]
        assert record["actor/pg_loss"] == record["actor/pg_loss"]  # a number, not NaN
    batch = run.batches[0]
    assert batch["mtp_accepted_tokens"].sum() <= batch["mtp_draft_tokens"].sum()
