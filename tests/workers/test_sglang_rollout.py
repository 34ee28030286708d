"""The SGLang rollout engine, for real, on CPU (sglang 0.5.23 in ``.venv-sglang``): the HF engine's
layout, greedy agreement with it, log-probs equal to the actor's, in-memory weight sync after actor
updates (and a test that fails when it is skipped), two GRPO steps end to end, a tool conversation.

Runs in its own environment: ``bash scripts/setup_sglang_cpu.sh && bash scripts/test_sglang.sh``.
In the main environment (no SGLang) only the tests without the ``sglang`` mark run.

Tolerance: engine and actor both run fp32, so the two scorings of a token agree to float rounding
(measured 4.8e-7); the bound is 1e-4, and three optimiser steps at lr 1e-2 move them by > 5e-2.
"""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
import torch

from tests.workers import local_worker, make_prompts, worker_config
# the engine-independent helpers and fixtures the vLLM tests define (hf_engine: the HF engine on the
# same actor module, built from this module's ``group``; the tiny model with head dim 32)
from tests.workers.test_vllm_rollout import _AGENT_SCRIPT, _max_abs, _run_python, _training_batch, _with_meta
from tests.trainer.test_e2e_judge import judge_dir  # noqa: F401 (fixture)
from tests.workers.test_vllm_rollout import hf_engine, vllm_model_dir  # noqa: F401 (fixtures)

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
LOGP_TOL = 1e-4
STALE_MIN = 5e-2
TP = 48
TEXTS = ["hello world", "a", "12+7=", "the quick brown fox jumps over the lazy dog!!"]
SGLANG_OVERRIDES = ["rollout.name=sglang", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
                    f"rollout.prompt_length={TP}", "rollout.max_num_seqs=64", "actor.optim.lr=1e-2"]


def sglang_test(fn):
    """Marked ``sglang`` (its own CI step) and skipped, saying how to run it, where SGLang is missing."""
    reason = "SGLang is not installed here; run scripts/setup_sglang_cpu.sh then scripts/test_sglang.sh"
    return pytest.mark.sglang(pytest.mark.skipif(not HAVE_SGLANG, reason=reason)(fn))


# --------------------------------------------------------------------------- main environment

def test_module_imports_without_sglang_and_maps_verl_keys():
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout import sglang_rollout as sr

    assert HAVE_SGLANG or "sglang" not in sys.modules
    cfg = OmegaConf.create({"dtype": "bf16", "load_format": "dummy_dtensor", "prompt_length": 16,
                            "response_length": 8, "max_num_seqs": 4, "free_cache_engine": True, "seed": 3,
                            "tensor_model_parallel_size": 2, "gpu_memory_utilization": 0.4,
                            "engine_kwargs": {"sglang": {"max_running_requests": 2}}})
    cpu = sr.build_engine_kwargs(cfg, "/m", "cpu", rank=1)
    assert (cpu["dtype"], cpu["load_format"], cpu["context_length"], cpu["random_seed"]) == ("bfloat16", "dummy", 24, 4)
    assert cpu["max_running_requests"] == 2  # engine_kwargs.sglang wins
    assert (cpu["device"], cpu["attention_backend"], cpu["tp_size"], cpu["sleep_on_idle"]) == ("cpu", "torch_native", 1,
                                                                                               True)
    assert cpu["max_total_tokens"] == 4096 and "enable_memory_saver" not in cpu and cpu["skip_tokenizer_init"]
    gpu = sr.build_engine_kwargs(cfg, "/m", "cuda")
    assert (gpu["tp_size"], gpu["mem_fraction_static"], gpu["enable_memory_saver"]) == (2, 0.4, True)
    assert gpu["enable_weights_cpu_backup"]  # a step without an update generates with the last weights
    assert "device" not in gpu and "max_total_tokens" not in gpu


@pytest.mark.skipif(HAVE_SGLANG, reason="SGLang is installed here")
def test_engine_without_sglang_names_the_install_commands(tiny_model_dir):
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout

    with pytest.raises(ImportError, match=r"pip install sglang.*setup_sglang_cpu\.sh"):
        SGLangRollout(None, OmegaConf.create({}), 0, 2, model_path=str(tiny_model_dir))


# --------------------------------------------------------------------------- SGLang environment

@pytest.fixture(scope="module")
def group(vllm_model_dir):
    """Actor (FSDP2, fp32) + the SGLang engine, built by the worker from rollout.name=sglang."""
    if not HAVE_SGLANG:
        pytest.skip("SGLang is not installed")
    group = local_worker(worker_config(vllm_model_dir, SGLANG_OVERRIDES), role="actor_rollout")
    yield group
    group.worker.rollout.shutdown()


@pytest.fixture(scope="module")
def prompts(group):
    return make_prompts(group.worker.tokenizer, TEXTS, max_prompt_length=TP)


def _greedy(engine_or_group, prompts):
    return engine_or_group.generate_sequences(_with_meta(prompts, validate=True))


def _engine_vs_actor(group, prompts, **meta) -> float:
    """Greedy (no ``meta``) or sampled with ``meta``; the actor scores at the sampling temperature."""
    out = group.generate_sequences(_with_meta(prompts, **meta)) if meta else _greedy(group, prompts)
    scoring = _with_meta(out, temperature=meta.get("temperature", 1.0))
    actor = group.compute_log_prob(scoring).batch["old_log_probs"]
    return _max_abs(out.batch["rollout_log_probs"], actor, out.batch["response_mask"])


@sglang_test
def test_rollout_name_sglang_builds_the_engine_with_the_hf_layout(group, hf_engine, prompts):
    from rlfoundry.workers.rollout.sglang_rollout import SGLangRollout

    assert isinstance(group.worker.rollout, SGLangRollout)
    ours, ref = (e.generate_sequences(_with_meta(prompts, n=2)) for e in (group, hf_engine))
    assert set(ours.batch.keys()) == set(ref.batch.keys())
    for key in ref.batch.keys():
        assert ours.batch[key].shape == ref.batch[key].shape and ours.batch[key].dtype == ref.batch[key].dtype, key
    assert torch.equal(ours.batch["prompts"], ref.batch["prompts"])  # B·n rows, prompt i's at i·n, i·n+1
    mask, lengths = ours.batch["response_mask"], ours.batch["response_mask"].sum(-1)
    assert torch.equal(mask, (torch.arange(mask.shape[1]) < lengths[:, None]).long())  # 1 through EOS
    pad = group.worker.tokenizer.pad_token_id
    assert bool((ours.batch["responses"][mask == 0] == pad).all())


@sglang_test
def test_greedy_matches_the_hf_engine_token_for_token_and_log_probs(group, hf_engine, prompts):
    ours, ref = _greedy(group, prompts), _greedy(hf_engine, prompts)
    assert torch.equal(ours.batch["responses"], ref.batch["responses"])
    assert _max_abs(ours.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], ours.batch["response_mask"]) < LOGP_TOL


@sglang_test
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_match_the_actor_at_the_sampling_temperature(group, prompts, temperature):
    diff = _engine_vs_actor(group, prompts, n=3, temperature=temperature, top_k=50, top_p=0.9)
    assert diff < LOGP_TOL


@sglang_test
def test_actor_update_reaches_sglang_and_a_skipped_sync_is_detected(group, hf_engine, prompts):
    engine = group.worker.rollout
    syncs = engine.syncs
    engine.sync_weights = lambda *a, **k: None  # a skipped sync: the engine keeps the old weights
    try:
        for seed in range(3):
            group.update_actor(_training_batch(group, prompts, seed=seed))
    finally:
        del engine.sync_weights
    stale = _engine_vs_actor(group, prompts)
    assert stale > STALE_MIN, f"three lr=1e-2 steps should move log-probs by > {STALE_MIN}, moved {stale:.2e}"
    engine.sync_weights()
    assert _engine_vs_actor(group, prompts) < LOGP_TOL
    assert torch.equal(_greedy(group, prompts).batch["responses"], _greedy(hf_engine, prompts).batch["responses"])
    group.update_actor(_training_batch(group, prompts, seed=9))  # the worker's own hook syncs
    assert engine.syncs == syncs + 2 and _engine_vs_actor(group, prompts) < LOGP_TOL


_E2E_SCRIPT = r"""
import json, sys
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.main_ppo import build_trainer
from tests.workers import make_prompts

if __name__ == "__main__":
    cfg = load_config(sys.argv[1:])
    trainer = build_trainer(cfg)
    summary = trainer.fit()
    wg = trainer.actor_rollout_wg
    worker = next(iter(wg.worker.workers.values()))
    probe = make_prompts(trainer.tokenizer, ["3+4=", "12+30="], max_prompt_length=int(cfg.data.max_prompt_length))
    probe.meta_info["validate"] = True
    out = wg.generate_sequences(probe)
    out.meta_info["temperature"] = 1.0
    actor = wg.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    print("RESULT " + json.dumps({
        "global_step": summary["global_step"], "engine": type(worker.rollout).__name__, "syncs": worker.rollout.syncs,
        "max_abs_dlogp": float((out.batch["rollout_log_probs"] - actor)[mask].abs().max()),
    }))
    worker.rollout.shutdown()
"""


@sglang_test
@pytest.mark.slow
def test_grpo_two_steps_end_to_end_with_sglang(vllm_model_dir, tmp_path):
    """main_ppo with rollout.name=sglang: two GRPO steps; each step's samples as SGLang scored them
    agree with the actor's recomputation (so step 2 sampled from update 1's weights)."""
    script = tmp_path / "e2e.py"
    script.write_text(_E2E_SCRIPT)
    stdout = _run_python([str(script),
        f"actor_rollout_ref.model.path={vllm_model_dir}", f"trainer.default_local_dir={tmp_path}",
        "actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_num_seqs=32", "actor_rollout_ref.actor.optim.lr=1e-2",
        "data.synthetic.train_size=32", "data.synthetic.val_size=4", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=6",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.logger=file", "trainer.test_freq=2",
        "actor_rollout_ref.rollout.calculate_log_probs=true"])  # training/rollout_probs_diff_* are logged
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["global_step"] == 2 and result["engine"] == "SGLangRollout"
    assert result["syncs"] == 3  # load_format=dummy_dtensor start-up + one per actor update
    assert result["max_abs_dlogp"] < LOGP_TOL
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    names = ("training/rollout_actor_probs_diff_max", "training/rollout_probs_diff_max")
    logged = [r[k] for r in steps for k in names if k in r]
    assert len(steps) == 2 and len(logged) >= 2 and max(logged) < LOGP_TOL, logged


@sglang_test
@pytest.mark.slow
def test_sglang_and_hf_engines_give_the_same_tool_conversation(tmp_path):
    """rollout.multi_turn.enable with rollout.name=sglang (the agent loop calls the engine from its own
    threads): greedy, the calculator tool, the policy taught one tool conversation: SGLang's
    trajectories equal the HF engine's token for token and mask for mask."""
    script = tmp_path / "agent.py"  # a file: SGLang's spawned processes re-import the main module
    script.write_text(_AGENT_SCRIPT)
    stdout = _run_python([str(script), str(tmp_path / "policy"), "tests.workers.test_sglang_rollout:SGLANG_OVERRIDES"])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["same_tokens"] and result["same_mask"], result
    assert result["turns"][0] == 3 and "<tool_response>\n56088\n</tool_response>" in result["text"], result
    assert result["max_abs_dlogp"] < LOGP_TOL


@sglang_test
@pytest.mark.slow
def test_a_judge_served_by_sglang_writes_the_hf_engines_judgements(judge_dir, tmp_path):
    """reward.reward_model.rollout.name=sglang: the SFT'd judge of tests/trainer/test_e2e_judge.py, greedy."""
    from tests.trainer.test_e2e_judge import ENGINE_SCRIPT, check_engine_result

    script = tmp_path / "judge.py"
    script.write_text(ENGINE_SCRIPT)
    check_engine_result(_run_python([str(script), str(judge_dir), str(tmp_path / "run"), "sglang"]), "SGLangRollout")
