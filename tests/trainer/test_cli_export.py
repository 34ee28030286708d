"""``rlfoundry export <checkpoint> <hf_dir>``: the exported model is the trainer's actor, logit for logit."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow


def _export(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "rlfoundry", "export", *args], capture_output=True, text=True,
                          env=E.subprocess_env(), timeout=300)


@pytest.fixture(scope="module")
def trained(tiny_model_dir, tmp_path_factory):
    """Two GRPO steps at a large lr, checkpointing every step.

    The dense test scorer gives non-zero advantages (the arithmetic score of a random policy is
    all zeros, so only weight decay would move the weights).
    """
    run_dir = tmp_path_factory.mktemp("export_run")
    reward = E.write_reward_file(tmp_path_factory.mktemp("reward"))
    run = E.train(E.tiny_overrides(tiny_model_dir, run_dir, "trainer.save_freq=1",
                                   f"custom_reward_function.path={reward}",
                                   "actor_rollout_ref.actor.optim.lr=1e-2"), keep_trainer=True)
    return run, run_dir


def _actor_module(trainer):
    # the in-process back end keeps the worker object: colocated roles -> the actor's FSDP2 module
    return trainer.actor_rollout_wg.worker.workers["actor_rollout"].actor.module


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"]).logits.float()


@pytest.mark.numerics
def test_export_of_the_run_dir_gives_the_trainers_logits(trained, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, run_dir = trained
    hf_dir = tmp_path / "hf"
    proc = _export(str(run_dir), str(hf_dir))  # a run directory means its newest complete step
    assert proc.returncode == 0, proc.stderr[-3000:]
    exported = AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    batch = run.batches[-1]
    actor = _actor_module(run.trainer)
    # the exported safetensors hold the trainer's weights; the plain HF forward vs the engine's: fp32 rounding
    torch.testing.assert_close(_logits(exported, batch), _logits(actor, batch), atol=1e-5, rtol=1e-5)
    # it is the trained policy, not the starting weights
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    assert (_logits(base, batch) - _logits(exported, batch)).abs().max() > 1e-3
    # and the directory is complete: tokenizer included (a chat template for the next RL/SFT run)
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    assert tokenizer.chat_template and tokenizer.eos_token_id is not None


def test_export_of_an_earlier_step_and_of_a_non_checkpoint(trained, tmp_path):
    from transformers import AutoModelForCausalLM

    run, run_dir = trained
    proc = _export(str(run_dir / "global_step_1" / "actor"), str(tmp_path / "step1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    step1 = AutoModelForCausalLM.from_pretrained(tmp_path / "step1").eval()
    batch = run.batches[-1]
    # step 1's weights are what generated step 2's batch: they reproduce its old log-probs
    logp = torch.log_softmax(_logits(step1, batch)[:, -batch["responses"].shape[1] - 1:-1], dim=-1)
    old = logp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    # a recomputation over another batch layout: fp32 rounding of log-probs ~O(10) (rtol) plus ~0 ones (atol)
    torch.testing.assert_close(old[mask], batch["old_log_probs"][mask], atol=1e-4, rtol=1e-4)

    bad = _export(str(tmp_path), str(tmp_path / "out"))
    assert bad.returncode == 2 and "holds no complete checkpoint" in bad.stderr
