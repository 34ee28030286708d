"""The benchmarks' mismatch column: rollout-vs-trainer |Δ log p| beside the speed."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.common import logprob_diff_summary, median_row


def test_summary_takes_the_largest_max_and_the_mean_of_the_means():
    # by hand: max(0.1, 0.4, 0.2) = 0.4; (0.01 + 0.03 + 0.02) / 3 = 0.02
    steps = [{"max": 0.1, "mean": 0.01}, {"max": 0.4, "mean": 0.03}, {"max": 0.2, "mean": 0.02}]
    assert logprob_diff_summary(steps) == pytest.approx({"logprob_diff_max": 0.4, "logprob_diff_mean": 0.02})
    assert logprob_diff_summary([]) == {}


def test_median_row_keeps_the_column_only_when_every_run_has_it():
    base = {k: 1.0 for k in ("step_s", "step_inner_s", "startup_s", "gen_tokens_per_s", "samples_per_s",
                             "gen_tokens_per_step", "peak_rss_mb", "peak_tree_rss_mb", "peak_tree_pss_mb",
                             "reward_first", "reward_last")}
    runs = [base | {"logprob_diff_max": m, "logprob_diff_mean": m / 10} for m in (0.1, 0.3, 0.2)]
    assert median_row(runs)["logprob_diff_max"] == pytest.approx(0.2)
    assert "logprob_diff_max" not in median_row([runs[0], base])


def test_rlfoundry_runner_asks_for_the_rollout_log_probs_and_reads_the_trainer_metric(tmp_path):
    from types import SimpleNamespace

    from benchmarks.common import Workload
    from benchmarks.rlfoundry_grpo import logprob_diff, verl_keys

    prepared = SimpleNamespace(train_file=tmp_path / "t.parquet", model_dir=tmp_path / "m")
    assert "actor_rollout_ref.rollout.calculate_log_probs=true" in verl_keys(Workload(), prepared, tmp_path, rows=4)
    metrics = {"training/rollout_log_probs_diff_max": 0.5, "training/rollout_log_probs_diff_mean": 0.125}
    assert logprob_diff(metrics) == {"max": 0.5, "mean": 0.125}
    # use_rollout_log_probs: nothing rescored; the update's first forward against the rollout's
    reused = {"actor/log_ratio_abs_max": 0.25, "actor/log_ratio_abs_mean": 0.0625}
    assert logprob_diff(reused) == {"max": 0.25, "mean": 0.0625}
    assert logprob_diff(reused | metrics) == {"max": 0.5, "mean": 0.125}
    assert logprob_diff({}) is None


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlfoundry.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("m"), hidden_size=32, num_layers=2, seed=0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trl_sampler_log_probs_match_a_rescoring_of_the_shuffled_rows(model_and_tokenizer, temperature):
    """The recorder sees what ``generate`` sampled from; rescoring the same rows (shuffled, as TRL
    does) with the same fp32 model gives the same log-probs, and a shifted token shows as its shift."""
    from transformers import GenerationConfig

    from benchmarks.trl_grpo import SamplerLogProbs

    model, tok = model_and_tokenizer
    texts = ["1+2=", "what is 17*3?", "9-4"]
    tok.padding_side = "left"
    enc = tok([t for t in texts for _ in range(2)], return_tensors="pt", padding=True, add_special_tokens=False)
    config = GenerationConfig(do_sample=True, temperature=temperature, top_k=0, top_p=1.0, max_new_tokens=12,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    sampler = SamplerLogProbs(temperature)
    torch.manual_seed(0)
    with torch.no_grad():
        seq = sampler.wrap(model.generate)(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                           generation_config=config)
    width = seq.shape[1] - enc["input_ids"].shape[1]
    response = seq[:, -width:]
    is_eos = (response == tok.eos_token_id).int()
    ends = torch.where(is_eos.any(1), is_eos.argmax(1) + 1, width)
    response_mask = (torch.arange(width) < ends[:, None]).long()
    order = torch.tensor([4, 1, 5, 0, 3, 2])  # TRL shuffles its rows between generation and the loss
    ids = torch.cat([enc["input_ids"], response], 1)[order]
    mask = torch.cat([enc["attention_mask"], response_mask], 1)[order]
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits[:, -width - 1:-1] / temperature
    trainer_lp = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, -width:, None]).squeeze(-1)
    diff = sampler.diff(ids, mask, trainer_lp)
    assert diff is not None and diff["max"] < 1e-4
    shifted = trainer_lp.clone()
    shifted[0, 0] += 0.75  # the first response token is always valid
    assert sampler.diff(ids, mask, shifted)["max"] == pytest.approx(0.75, abs=1e-4)
    assert math.isfinite(diff["mean"])


def test_actor_log_ratio_abs_by_hand():
    from rlfoundry.workers.actor import _log_ratio_abs

    # valid tokens: |-1.0 - -1.5| = 0.5 and |-2.0 - -1.0| = 1.0 -> mean 0.75, max 1.0; the masked 9.0 is ignored
    log_prob = torch.tensor([[-1.0, -2.0, 9.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0]])
    m = _log_ratio_abs(log_prob, old, torch.tensor([[1, 1, 0]]))
    assert m == pytest.approx({"actor/log_ratio_abs_mean": 0.75, "actor/log_ratio_abs_max": 1.0})


def test_mini_batch_stats_keep_the_largest_micro_batch_maximum():
    from rlfoundry.engines.base import LossOutput
    from rlfoundry.engines.loop import MiniBatchStats

    stats = MiniBatchStats()
    stats.add(LossOutput(torch.tensor(0.0), {}, {}, {"actor/x_max": 0.3}), tokens=2.0)
    stats.add(LossOutput(torch.tensor(0.0), {}, {}, {"actor/x_max": 0.7}), tokens=1.0)
    stats.add(LossOutput(torch.tensor(0.0), {}, {}), tokens=1.0)  # a loss without maxima
    assert stats.reduce(1, None)["actor/x_max"] == pytest.approx(0.7)
