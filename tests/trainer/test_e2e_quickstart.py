"""verl's quickstart command line runs with only the module name changed (and tiny sizes).

The keys below are those of verl's docs quickstart (PPO on GSM8K, "docs/start/quickstart.rst"):
same keys, values shrunk to a tiny local model on CPU, plus the three the issue allows
(``rollout.name=hf``, ``trainer.device=cpu``, ``trainer.total_training_steps=2``). The data is
made by our own preprocessing CLI from the real GSM8K files in ``../shared/data/gsm8k``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow


def _env() -> dict[str, str]:
    return E.subprocess_env()


@pytest.fixture(scope="module")
def gsm8k_parquet(shared_data, tmp_path_factory):
    # The head of the real GSM8K files (validating on all 1319 test problems costs a minute on CPU).
    raw, out = tmp_path_factory.mktemp("gsm8k_raw"), tmp_path_factory.mktemp("gsm8k")
    for split, rows in (("train", 64), ("test", 8)):
        lines = (shared_data / "gsm8k" / f"{split}.jsonl").read_text().splitlines()[:rows]
        (raw / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    proc = subprocess.run([sys.executable, "-m", "rlfoundry.data.preprocess", "gsm8k",
                           "--input", str(raw), "--output", str(out)],
                          capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr
    return out


def quickstart_args(data, model) -> list[str]:
    return [
        f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet",
        "data.train_batch_size=4",            # verl: 256
        "data.max_prompt_length=512",
        "data.max_response_length=8",         # verl: 512
        f"actor_rollout_ref.model.path={model}",
        "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2",       # verl: 64
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1",  # verl: 4
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",  # verl: 8
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.4",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "critic.optim.lr=1e-5",
        f"critic.model.path={model}",
        "critic.ppo_micro_batch_size_per_gpu=1",  # verl: 4
        "algorithm.kl_ctrl.kl_coef=0.001",
        "trainer.logger=console",
        "trainer.val_before_train=False",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.save_freq=10",
        "trainer.test_freq=10",
        "trainer.total_epochs=15",
        # additions: HF rollout, CPU, two steps; and (as verl's GSM8K example scripts do) drop the
        # prompts over 512 tokens -- our tiny tokenizer is byte-level, ~4x the tokens of Qwen's
        "data.filter_overlong_prompts=True",
        "actor_rollout_ref.rollout.name=hf",
        "trainer.device=cpu",
        "trainer.total_training_steps=2",
    ]


def test_verl_quickstart_command_line_runs_two_steps(gsm8k_parquet, tiny_model_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "rlfoundry.trainer.main_ppo",
                           *quickstart_args(gsm8k_parquet, tiny_model_dir)],
                          cwd=tmp_path, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    # verl's default checkpoint layout under the working directory: checkpoints/<project>/<experiment>
    (metrics,) = list((tmp_path / "checkpoints").rglob("metrics.jsonl"))
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        # PPO: critic.model.path given and no estimator named -> gae with the critic (verl's default)
        assert "critic/vf_loss" in r and "actor/pg_loss" in r and "critic/score/mean" in r
    # the last step validates on the GSM8K test split, reported per data source
    assert any(k.startswith("val-core/openai/gsm8k/reward/mean@1") for k in records[-1])
    assert (metrics.parent / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    # the vLLM-only keys are accepted with one warning that names them
    assert "gpu_memory_utilization" in proc.stderr
