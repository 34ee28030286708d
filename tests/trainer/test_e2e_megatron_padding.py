"""Samples per step that divide the data-parallel ranks but not the world (issue 46): one prompt × n=3 on
Megatron at tensor parallel 2 (two ranks, one data-parallel rank). Every call pads the prompt (then its 3
samples) to the 2 ranks; generation and the log-probs drop what the padding produced, and the update
trains the 3 real samples once each. The same run on one FSDP rank pads nothing: it must give the same
samples, losses and gradient norms (a padding row trained would change the loss and the gradient)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer._e2e import subprocess_env, tiny_overrides, write_reward_file

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]

# optim.eps=1e-4 as tests/trainer/test_e2e_megatron.py: Megatron and FSDP sum gradients in another order
ODD = ["data.train_batch_size=1", "actor_rollout_ref.rollout.n=3", "actor_rollout_ref.actor.ppo_mini_batch_size=1",
       "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=3", "trainer.worker_backend=process",
       "trainer.total_training_steps=2", "actor_rollout_ref.actor.use_kl_loss=true",
       "actor_rollout_ref.actor.kl_loss_coef=0.1", "actor_rollout_ref.actor.optim.lr=1e-2",
       "actor_rollout_ref.actor.optim.eps=1e-4", "actor_rollout_ref.actor.use_rollout_log_probs=false"]
MEGATRON_TP2 = [f"actor_rollout_ref.{role}.megatron.tensor_model_parallel_size=2" for role in ("actor", "ref")]


def _run(tmp_path, name: str, model, ranks: int, extra: list[str], config_name: str | None = None) -> list[dict]:
    run_dir = tmp_path / name
    args = [sys.executable, "-m", "rlfoundry.trainer.main_ppo", *(["--config-name", config_name] if config_name else [])]
    args += tiny_overrides(model, run_dir, *ODD, f"trainer.n_gpus_per_node={ranks}", f"trainer.run_dir={run_dir}",
                           f"custom_reward_function.path={write_reward_file(tmp_path)}", *extra)
    out = subprocess.run(args, capture_output=True, text=True, env=subprocess_env(), timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "timing_s/step" in r]


def test_three_samples_on_two_tensor_parallel_ranks_train_like_one_rank(tiny_model_dir, tmp_path):
    one = _run(tmp_path, "fsdp1", tiny_model_dir, 1, [])
    two = _run(tmp_path, "tp2", tiny_model_dir, 2, MEGATRON_TP2, config_name="ppo_megatron_trainer")
    assert [r["step"] for r in two] == [1, 2]
    for a, b in zip(one, two):
        # 3 responses, not 6 (the padding prompt's samples dropped): the same lengths and scores
        assert a["response_length/mean"] == b["response_length/mean"], a["step"]
        assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"], abs=1e-6), a["step"]
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
