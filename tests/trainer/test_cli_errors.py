"""Config mistakes on the real command line: exit code 2, one readable paragraph, no traceback.

Each case runs ``python -m rlfoundry.trainer.main_ppo`` (and the ``rlfoundry train`` spelling) as
a user would; the config is checked before any model is loaded, so each takes ~2 s.
"""

from __future__ import annotations

import subprocess
import sys

from tests.trainer import _e2e as E


def _run(*args: str, module: str = "rlfoundry.trainer.main_ppo", cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], capture_output=True, text=True, env=E.subprocess_env(),
                          cwd=cwd, timeout=300)


def _assert_user_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr
    assert "ConfigError" in proc.stderr
    return proc.stderr


def test_misspelt_key_names_the_closest_valid_key(tmp_path):
    err = _assert_user_error(_run("actor_rollout_ref.actor.ppo_mini_batch_szie=4", cwd=tmp_path))
    assert "Unknown config key 'actor_rollout_ref.actor.ppo_mini_batch_szie'" in err
    assert "Did you mean 'actor_rollout_ref.actor.ppo_mini_batch_size'?" in err


def test_unknown_top_level_key_via_rlfoundry_train(tmp_path):
    err = _assert_user_error(_run("train", "trainer.total_epoch=2", module="rlfoundry", cwd=tmp_path))
    assert "Did you mean 'trainer.total_epochs'?" in err


def test_batch_sizes_that_do_not_divide_show_the_numbers(tmp_path):
    err = _assert_user_error(_run(
        "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.rollout.n=3", "algorithm.gamma=1.5", cwd=tmp_path))
    # 6 prompts per step cannot be cut into mini-batches of 4; and every problem is listed at once
    assert "data.train_batch_size=6 is not a multiple of actor_rollout_ref.actor.ppo_mini_batch_size=4" in err
    assert "2 config problem(s)" in err and "algorithm.gamma=1.5 must lie in [0, 1]" in err


def test_micro_batch_that_does_not_divide_the_per_rank_mini_batch(tmp_path):
    err = _assert_user_error(_run(
        "data.train_batch_size=8", "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.rollout.n=3",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5", cwd=tmp_path))
    # 4 prompts × n=3 = 12 samples per mini-batch on 1 rank; micro-batches of 5 do not divide 12
    assert "ppo_micro_batch_size_per_gpu=5 does not divide the 12 samples" in err


def test_missing_model_directory_is_a_user_error(tmp_path):
    err = _assert_user_error(_run(f"actor_rollout_ref.model.path={tmp_path / 'nope'}", cwd=tmp_path))
    assert "does not exist" in err and "actor_rollout_ref.model.path" in err


def test_entry_modules_import_no_torch():
    # Reward-pool processes (forkserver/spawn) re-import the main module: with torch at the top of
    # main_ppo every scorer process paid seconds of import before scoring its first sample.
    code = ("import sys, rlfoundry.trainer.main_ppo, rlfoundry.cli, rlfoundry.__main__; "
            "heavy = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; "
            "sys.exit(f'imported at module level: {heavy}' if heavy else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=E.subprocess_env(),
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
