"""Bad input through the real entry point: exit code 2 and one paragraph that names the thing and the
fix. Cases already covered elsewhere are listed in docs/errors.md with their tests; these are the rest.

Most cases call ``main_ppo.main`` in this process (it returns the exit code); one goes through
``python -m rlfoundry.trainer.main_ppo`` to check the real command line too.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.reliability.conftest import run_main

REPO = Path(__file__).resolve().parents[2]


def _parquet(path: Path, prompts: list[str], drop_prompt: bool = False) -> Path:
    rows = [{"data_source": "rlfoundry/arithmetic", "prompt": [{"role": "user", "content": p}],
             "reward_model": {"ground_truth": "1"}, "extra_info": {"index": i}} for i, p in enumerate(prompts or ["x"])]
    table = pa.Table.from_pylist(rows)
    table = table.drop(["prompt"]) if drop_prompt else table
    pq.write_table(table if prompts else table.slice(0, 0), path)
    return path


@pytest.fixture(scope="module")
def bare_tokenizer_model(tiny_model_dir, tmp_path_factory) -> Path:
    """The tiny model with a tokenizer that has neither a pad token nor a chat template."""
    from rlfoundry.models.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("bare") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = build_tokenizer(chat_template=False)
    tok.pad_token = None
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    tok.save_pretrained(out)
    return out


def test_tokenizer_without_pad_token_pads_with_eos_and_warns(bare_tokenizer_model):
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import load_tokenizer

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tok = load_tokenizer(load_config([f"actor_rollout_ref.model.path={bare_tokenizer_model}"]))
    assert tok.pad_token_id == tok.eos_token_id is not None
    assert any("has no pad token; using EOS" in str(w.message) for w in caught)


def _cases(tmp: Path, bare: Path) -> dict[str, tuple[list[str], list[str]]]:
    """case → (overrides, substrings the message must contain)."""
    data = lambda f: [f"data.train_files={f}", f"data.val_files={f}"]  # noqa: E731
    no_fn = tmp / "reward_without_fn.py"
    no_fn.write_text("def other(**kwargs):\n    return 1.0\n")
    return {
        "no_chat_template": ([f"actor_rollout_ref.model.path={bare}"], ["chat template", "data.apply_chat_template=False"]),
        "parquet_missing_prompt": (data(_parquet(tmp / "noprompt.parquet", ["a", "b"], drop_prompt=True)),
                                   ["noprompt.parquet has no column 'prompt' (data.prompt_key)", "Set data.prompt_key"]),
        "empty_dataset": (data(_parquet(tmp / "empty.parquet", [])), ["empty.parquet'] hold no rows", "data.train_files"]),
        "prompt_over_limit": (data(_parquet(tmp / "long.parquet", ["x" * 300] * 4)) + ["data.max_prompt_length=64"],
                              ["longer than data.max_prompt_length=64", "data.truncation=error",
                               "data.filter_overlong_prompts=True"]),
        "resume_path_without_checkpoint": (["trainer.resume_mode=resume_path", f"trainer.resume_from_path={tmp}"],
                                           ["trainer.resume_from_path=", "holds no checkpoint", "global_step_N"]),
        "gae_without_critic_model": (["algorithm.adv_estimator=gae", "critic.model.path=null"],
                                     ["needs a critic model", "set critic.model.path", "algorithm.adv_estimator=grpo"]),
        "reward_file_missing": ([f"custom_reward_function.path={tmp / 'nope.py'}"],
                                ["custom_reward_function.path=", "nope.py does not exist"]),
        "reward_function_missing": ([f"custom_reward_function.path={no_fn}"], ["has no function 'compute_score'"]),
    }


CASES = ["no_chat_template", "parquet_missing_prompt", "empty_dataset", "prompt_over_limit",
         "resume_path_without_checkpoint", "gae_without_critic_model", "reward_file_missing", "reward_function_missing"]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_exits_2_naming_the_fix(case, tiny_model_dir, bare_tokenizer_model, tmp_path, capsys):
    extra, expected = _cases(tmp_path, bare_tokenizer_model)[case]
    argv = [f"actor_rollout_ref.model.path={tiny_model_dir}", f"trainer.default_local_dir={tmp_path / 'run'}",
            "data.train_batch_size=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "trainer.logger=file", *extra]
    code, err = run_main(argv, capsys)
    assert code == 2, err[-2000:]
    assert "Traceback" not in err
    for text in expected:
        assert text in err, (text, err[-1500:])


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    env.pop("RLFOUNDRY_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "rlfoundry.trainer.main_ppo", *args], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=300)


def test_wrong_type_on_the_command_line_exits_2_naming_key_and_type(tmp_path):
    proc = _cli("data.train_batch_size=abc", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.train_batch_size" in proc.stderr and "'abc'" in proc.stderr and "integer" in proc.stderr


@pytest.mark.parametrize("engine, install", [("vllm", "setup_vllm_cpu.sh"), ("sglang", "setup_sglang_cpu.sh")])
def test_rollout_engine_not_installed_exits_2_before_loading_models(tiny_model_dir, tmp_path, capsys, engine, install):
    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    code, err = run_main([f"actor_rollout_ref.model.path={tiny_model_dir}", f"actor_rollout_ref.rollout.name={engine}",
                          f"trainer.default_local_dir={tmp_path / 'run'}"], capsys)
    assert code == 2 and "Traceback" not in err, err[-2000:]
    assert f"rollout.name={engine} needs the '{engine}' package, which is not installed" in err
    assert "rollout.name=hf" in err and install in err
