"""``--config-name ppo_megatron_trainer`` end to end on two CPU processes: GRPO with the KL loss
(reference on Megatron) at tensor, pipeline and context parallel 2, and PPO with the critic on
Megatron at tensor parallel 2, against the same runs with strategy=fsdp on two ranks. Same seeds:
the same samples at every step, which needs the HF rollout's copy of the policy refreshed from the
Megatron weights after each update, and the same losses, values and gradient norms. Resumed runs
give the straight run's third step; ``rlfoundry export`` turns their checkpoints into HF directories."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.trainer._e2e import subprocess_env, tiny_overrides, write_reward_file

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)

# optim.eps=1e-4 (as tests/engines/test_megatron_engine.py): Megatron and FSDP sum the gradients in
# another order, and with eps=1e-8 Adam moves a weight whose gradient is ~0 anywhere in [-lr, lr] on
# either side (#51), which steps 2 and 3 (their samples, losses, grad norms) would inherit; with 1e-4
# each step changes by at most lr/eps = 100x its gradient's rounding (~1e-5 on a weight)
COMMON = ["trainer.n_gpus_per_node=2", "trainer.worker_backend=process", "trainer.total_training_steps=3",
          "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.1",
          "actor_rollout_ref.actor.optim.lr=1e-2", "actor_rollout_ref.actor.optim.eps=1e-4",
          "actor_rollout_ref.actor.use_rollout_log_probs=false"]
LAYOUTS = {"tp2": "tensor_model_parallel_size=2", "pp2": "pipeline_model_parallel_size=2",
           "cp2": "context_parallel_size=2"}


def _run(tmp_path, name: str, model, reward, extra: list[str], config_name: str | None = None,
         log: list[str] | None = None) -> list[dict]:
    run_dir = tmp_path / name
    args = [sys.executable, "-m", "rlfoundry.trainer.main_ppo"]
    if config_name:
        args += ["--config-name", config_name]
    args += tiny_overrides(model, run_dir, *COMMON, f"trainer.run_dir={run_dir}",
                           f"custom_reward_function.path={reward}", *extra)
    out = subprocess.run(args, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    if log is not None:
        log += (out.stdout + out.stderr).splitlines()
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "timing_s/step" in r]


@pytest.fixture(scope="module")
def fsdp_run(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp")
    return _run(tmp, "fsdp", tiny_model_dir, write_reward_file(tmp), [])


# CI time: PP=2 end to end is heavy (tests/engines/test_megatron_engine.py has PP=2 and its interleaved
# schedule equal FSDP's update; test_megatron_checkpoint.py exports a PP=2 model for the rollout)
@pytest.mark.parametrize("layout", [pytest.param(k, marks=pytest.mark.heavy) if k == "pp2" else k for k in sorted(LAYOUTS)])
def test_tensor_and_pipeline_parallel_grpo_match_fsdp(tiny_model_dir, tmp_path, fsdp_run, layout):
    fsdp = fsdp_run
    sizes = [f"actor_rollout_ref.{role}.megatron.{LAYOUTS[layout]}" for role in ("actor", "ref")]
    megatron = _run(tmp_path, layout, tiny_model_dir, write_reward_file(tmp_path), sizes, config_name="ppo_megatron_trainer")
    assert [r["step"] for r in megatron] == [1, 2, 3]
    for a, b in zip(fsdp, megatron):
        # identical samples at steps 2 and 3 only if the rollout follows the Megatron updates
        assert a["response_length/mean"] == b["response_length/mean"], a["step"]
        assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"], abs=1e-6), a["step"]
        # steps 2-3 at weights up to ~1e-5 apart (COMMON's eps), TP/PP re-associating the sums
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
    assert megatron[-1]["actor/kl_loss"] > 0  # the policy moved away from the reference


@pytest.mark.heavy  # CI: the PPO test below resumes at TP=2 too (on Ray); this is the process back end's
def test_tensor_parallel_resume_gives_the_straight_runs_third_step(tiny_model_dir, tmp_path):
    """Two steps with a checkpoint each, then a new process resumes (resume_mode=auto) to step 3:
    the same samples (the rollout's HF copy follows the loaded weights), losses and gradient norm.
    The process back end (the PPO test below runs on Ray): its ranks start megatron-core's writer processes."""
    reward = write_reward_file(tmp_path)
    common = [*(f"actor_rollout_ref.{r}.megatron.{LAYOUTS['tp2']}" for r in ("actor", "ref")), "trainer.save_freq=1"]
    straight = _run(tmp_path, "straight", tiny_model_dir, reward, common, config_name="ppo_megatron_trainer")
    _run(tmp_path, "split", tiny_model_dir, reward, [*common, "trainer.total_training_steps=2"],
         config_name="ppo_megatron_trainer")
    resumed = _run(tmp_path, "split", tiny_model_dir, reward, common, config_name="ppo_megatron_trainer")
    assert (tmp_path / "split" / "global_step_2" / "actor" / "mcore").is_dir()
    a, b = straight[-1], next(r for r in resumed if r["step"] == 3)
    for key in ("critic/score/mean", "response_length/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key  # the same arithmetic resumed


PPO = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-2", "critic.optim.eps=1e-4",  # eps: as COMMON's
       "critic.ppo_micro_batch_size_per_gpu=2"]


# CI time (137 s): heavy; CI has the critic's update against FSDP2's at four layouts
# (tests/engines/test_megatron_critic.py) and Megatron resume/export (test_megatron_checkpoint.py)
@pytest.mark.heavy
@pytest.mark.ray
def test_ppo_with_the_critic_on_megatron_matches_fsdp_resumes_and_exports(tiny_model_dir, tmp_path):
    import transformers

    reward = write_reward_file(tmp_path)
    ppo = [*PPO, f"critic.model.path={tiny_model_dir}"]
    fsdp = _run(tmp_path, "fsdp", tiny_model_dir, reward, ppo)
    tp2 = [*ppo, *(f"actor_rollout_ref.{r}.megatron.{LAYOUTS['tp2']}" for r in ("actor", "ref")),
           "trainer.save_freq=1", "trainer.worker_backend=ray"]  # the critic's layout follows the actor's
    straight = _run(tmp_path, "straight", tiny_model_dir, reward, tp2, config_name="ppo_megatron_trainer")
    value_keys = ("critic/vf_loss", "critic/grad_norm", "critic/values/mean", "actor/pg_loss", "actor/grad_norm")
    for a, b in zip(fsdp, straight):
        assert a["response_length/mean"] == b["response_length/mean"], a["step"]
        for key in value_keys:
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
    assert straight[-1]["critic/values/mean"] != 0  # the value head learned: not a vacuous match
    _run(tmp_path, "split", tiny_model_dir, reward, [*tp2, "trainer.total_training_steps=2"], config_name="ppo_megatron_trainer")
    resumed = _run(tmp_path, "split", tiny_model_dir, reward, tp2, config_name="ppo_megatron_trainer")
    a, b = straight[-1], next(r for r in resumed if r["step"] == 3)
    for key in ("critic/score/mean", "response_length/mean", *value_keys):
        assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-7), key  # the same arithmetic resumed
    out = tmp_path / "exported"
    cli = subprocess.run([sys.executable, "-m", "rlfoundry.cli", "export", str(tmp_path / "split"), str(out)],
                         capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    policy = transformers.AutoModelForCausalLM.from_pretrained(out)
    base = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert any(not p.equal(q) for p, q in zip(policy.parameters(), base.parameters()))  # three updates in it


@pytest.mark.heavy  # CI: tests/engines/test_megatron_offload.py, offload = no offload bitwise on the worker
def test_offload_keys_run_ppo_exactly_as_without(tiny_model_dir, tmp_path):
    """verl's ``megatron.param_offload`` / ``grad_offload`` / ``optimizer_offload`` on the actor, the
    reference and the critic (PPO at TP=2, checkpoints every step): every step's samples, losses,
    values, KL and gradient norms are the run's without offload, bit for bit. The weight sync reads the
    released parameters back for the rollout's copy after each update, log-probs and values bring them
    back for their passes, the checkpoints for theirs."""
    reward = write_reward_file(tmp_path)
    tp2 = [*PPO, f"critic.model.path={tiny_model_dir}", "trainer.save_freq=1",
           *(f"actor_rollout_ref.{r}.megatron.{LAYOUTS['tp2']}" for r in ("actor", "ref"))]
    offload = [f"{role}.megatron.{flag}=true" for role in ("actor_rollout_ref.actor", "actor_rollout_ref.ref", "critic")
               for flag in ("param_offload", "grad_offload", "optimizer_offload")]
    plain = _run(tmp_path, "plain", tiny_model_dir, reward, tp2, config_name="ppo_megatron_trainer")
    log: list[str] = []
    offloaded = _run(tmp_path, "offloaded", tiny_model_dir, reward, [*tp2, *offload], config_name="ppo_megatron_trainer",
                     log=log)
    assert [r["step"] for r in offloaded] == [1, 2, 3]
    said = [line for line in log if "megatron offload releases" in line]  # the keys reached each engine
    for role, parts in (("actor", "params, grads, optimizer"), ("ref", "params"), ("critic", "params, grads, optimizer")):
        assert sum(f"engine: {role}: megatron offload releases its {parts} between" in line for line in said) == 1, said
    compared = ("actor/", "critic/", "response_length/", "rollout/")
    for a, b in zip(plain, offloaded):
        keys = sorted(k for k in a if k.startswith(compared))
        assert keys and keys == sorted(k for k in b if k.startswith(compared))
        assert {k: a[k] for k in keys} == {k: b[k] for k in keys}, a["step"]
    assert plain[-1]["critic/values/mean"] != 0 and plain[-1]["actor/kl_loss"] > 0  # both models moved
