"""The vLLM rollout engine's own parts, for real, on CPU (vllm-cpu): the verl-key mapping, seeded
sampling from the rollout state, the prefix-cache reset at a sync, a rollout pool of its own (fully
async), two FSDP ranks, a Megatron actor at tensor parallel 2, LoRA (adapter and merged syncs), the
calculator demo. What every engine must do (layout, agreement with the HF engine and the actor, weight
syncs, GRPO end to end, tool conversations, a judge) is ``test_rollout_contract.py``, whose ``vllm``
parameter runs here too. The helpers below (``_with_meta``, ``_training_batch``, ``_run_python``,
the agent script) are shared with it.

Runs in its own environment: ``bash scripts/setup_vllm_cpu.sh && bash scripts/test_vllm.sh``.
In the main environment (no vLLM) only the tests without the ``vllm`` mark run.

Tolerance: engine and actor both run fp32 here, so the two scorings of the same token agree to
float rounding (|Δlogp| measured ~5e-6); the bound is 1e-3, while one optimiser step at lr 1e-2 moves
them by > 5e-2, so a missed weight sync cannot hide inside it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import sys

import pytest
import torch

from tests.trainer.test_e2e_quickstart import gsm8k_parquet  # noqa: F401 (fixture)
from tests.workers import local_worker, make_prompts, one_thread, worker_config  # noqa: F401 (fixture)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_test(fn):
    """Marked ``vllm`` (its own CI step) and skipped, saying how to run it, where vLLM is missing."""
    reason = "vLLM is not installed here; run scripts/setup_vllm_cpu.sh then scripts/test_vllm.sh"
    return pytest.mark.vllm(pytest.mark.skipif(not HAVE_VLLM, reason=reason)(fn))


LOGP_TOL = 1e-3
STALE_MIN = 5e-2  # how far an un-synced engine must be off for the sync tests to mean anything
TP = 48  # prompt width; the long prompt fills a 32-token KV block, so the prefix cache is exercised
TEXTS = ["hello world", "a", "12+7=", "the quick brown fox jumps over the lazy dog!!"]
VLLM_OVERRIDES = [
    "rollout.name=vllm", "rollout.dtype=float32", "rollout.load_format=dummy_dtensor",
    f"rollout.prompt_length={TP}", "rollout.max_num_seqs=64",
    "rollout.engine_kwargs.vllm.enable_prefix_caching=true",  # passed to vLLM as is (verl has no rollout key for it)
    "rollout.engine_kwargs.vllm.block_size=32", "actor.optim.lr=1e-2",
]


def _with_meta(data, **meta):
    copy = data.select()
    copy.meta_info.update(meta)
    return copy


def _max_abs(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float((a - b)[mask.bool()].abs().max())


# --------------------------------------------------------------------------- main environment


def test_module_imports_without_vllm_and_maps_verl_keys():
    """Importing the engine module never imports vLLM; the config map is a pure function."""
    from omegaconf import OmegaConf
    from transformers import Qwen2Config

    from rlfoundry.workers.rollout import vllm_rollout as vr

    assert HAVE_VLLM or "vllm" not in sys.modules
    hf = Qwen2Config(hidden_size=64, num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    cfg = OmegaConf.create({"dtype": "bf16", "load_format": "dummy_dtensor", "prompt_length": 16,
                            "response_length": 8, "max_num_seqs": 4, "free_cache_engine": True,
                            "engine_kwargs": {"vllm": {"swap_space": 0, "max_num_seqs": 2}}})
    cpu = vr.build_engine_kwargs(cfg, "/m", hf, "cpu")
    assert (cpu["dtype"], cpu["load_format"], cpu["max_model_len"]) == ("bfloat16", "dummy", 24)
    assert cpu["max_num_seqs"] == 2 and cpu["swap_space"] == 0  # engine_kwargs.vllm wins
    assert "enable_sleep_mode" not in cpu and cpu["kv_cache_memory_bytes"] == 64 << 20  # floor: tiny model
    gpu = vr.build_engine_kwargs(cfg, "/m", hf, "cuda")
    assert gpu["enable_sleep_mode"] is True and "kv_cache_memory_bytes" not in gpu
    assert (gpu["logprobs_mode"], gpu["generation_config"]) == ("processed_logprobs", "vllm")
    # TP 2 runs as one engine per rank (the config layer warns; test_config.py)
    assert vr.build_engine_kwargs(OmegaConf.merge(cfg, {"tensor_model_parallel_size": 2}), "/m", hf, "cuda")[
        "tensor_parallel_size"] == 1
    assert vr.hf_parameter_name("model._orig_mod.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight") == \
        "model.layers.0.mlp.up_proj.weight"


@pytest.mark.skipif(HAVE_VLLM, reason="vLLM is installed here")
def test_engine_without_vllm_names_the_install_commands(tiny_model_dir):
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout

    with pytest.raises(ImportError, match=r"pip install -e '\.\[vllm\]'.*setup_vllm_cpu\.sh"):
        VLLMRollout(None, OmegaConf.create({}), 0, 2, model_path=str(tiny_model_dir))


def test_the_engine_refuses_routing_replay_before_it_starts(tiny_moe_dir):
    """``enable_rollout_routing_replay`` on a vLLM engine built without the trainer's config check (which refuses it
    too: test_routing_replay_config.py): its batches would carry no ``routed_experts`` and R3 would replay nothing."""
    from omegaconf import OmegaConf

    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout

    with pytest.raises(ValueError, match=r"enable_rollout_routing_replay=true with rollout\.name=vllm: the engine "
                                         r"cannot return .*V2 model runner"):
        VLLMRollout(None, OmegaConf.create({"enable_rollout_routing_replay": True}), 0, 2, model_path=str(tiny_moe_dir))
    assert HAVE_VLLM or "vllm" not in sys.modules  # refused before vLLM is imported


# --------------------------------------------------------------------------- vLLM environment


@pytest.fixture(scope="module")
def vllm_model_dir(tmp_path_factory):
    """The tiny Qwen2 with head_dim 32 (64 / 2 heads): vLLM-CPU has no attention kernel below 32."""
    from rlfoundry.models.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen2-hd32"), num_heads=2, num_kv_heads=1, seed=3)


@pytest.fixture(scope="module")
def vtokenizer(vllm_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(vllm_model_dir)


@pytest.fixture(scope="module")
def prompts(vtokenizer):
    return make_prompts(vtokenizer, TEXTS, max_prompt_length=TP)


@pytest.fixture(scope="module")
def group(vllm_model_dir):
    """Actor (FSDP2, fp32) + colocated vLLM engine, built by the worker from rollout.name=vllm."""
    if not HAVE_VLLM:
        pytest.skip("vLLM is not installed")
    return local_worker(worker_config(vllm_model_dir, VLLM_OVERRIDES), role="actor_rollout")


@pytest.fixture(scope="module")
def hf_engine(group):
    """The HF engine on the very module the actor trains: the reference for greedy output."""
    from rlfoundry.workers.rollout.hf_rollout import HFRollout

    w = group.worker
    return HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                     eos_token_id=w.tokenizer.eos_token_id)


def _greedy(engine_or_group, prompts):
    return engine_or_group.generate_sequences(_with_meta(prompts, validate=True))


def _actor_log_probs(group, out, temperature=1.0):
    out = _with_meta(out, temperature=temperature)
    return group.compute_log_prob(out).batch["old_log_probs"]


@vllm_test
def test_rollout_name_vllm_builds_the_vllm_engine(group):
    from rlfoundry.workers.rollout import get_rollout_class
    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout, vLLMRollout

    assert get_rollout_class("vllm") is VLLMRollout is vLLMRollout
    assert isinstance(group.worker.rollout, VLLMRollout)
    assert group.worker.rollout.syncs >= 1  # load_format=dummy_dtensor: weights came from the actor


@vllm_test
def test_seeded_sampling_reproduces_from_the_rollout_state(group, prompts):
    engine = group.worker.rollout
    state = engine.state_dict()
    first = group.generate_sequences(_with_meta(prompts, n=2)).batch["responses"]
    second = group.generate_sequences(_with_meta(prompts, n=2)).batch["responses"]
    engine.load_state_dict(state)
    again = group.generate_sequences(_with_meta(prompts, n=2)).batch["responses"]
    assert torch.equal(first, again) and not torch.equal(first, second)



@vllm_test
def test_an_agent_loops_requests_sample_the_same_however_they_are_batched(group, vtokenizer):
    """vLLM seeds each request from the key the agent loop's server gives it (trajectory, turn): the same
    tokens whether a batch's requests share engine calls or arrive one by one (the HF engine's check)."""
    from tests.workers.test_agent_loop_scheduling import check_draws_do_not_depend_on_batching

    check_draws_do_not_depend_on_batching(group.worker.rollout, vtokenizer, atol=1e-4)

def _training_batch(group, prompts, seed: int):
    """A rollout with random advantages and the actor's old log-probs: enough for one PPO step."""
    out = group.generate_sequences(_with_meta(prompts, n=2))
    out.meta_info["temperature"] = 1.0
    out = out.union(group.compute_log_prob(out).select(batch_keys=["old_log_probs"]))
    gen = torch.Generator().manual_seed(seed)
    mask = out.batch["response_mask"]
    out.batch["advantages"] = torch.randn(mask.shape, generator=gen) * mask
    return out


@vllm_test
def test_a_weight_sync_resets_vllms_prefix_cache(group, hf_engine, prompts):
    """vLLM caches prompts' KV blocks across calls: a sync that kept them would sample the long prompt
    from the old weights (the skipped-sync and update parts every engine shares: test_rollout_contract)."""
    engine = group.worker.rollout

    def engine_vs_actor():
        out = _greedy(group, prompts)
        return _max_abs(out.batch["rollout_log_probs"], _actor_log_probs(group, out), out.batch["response_mask"])

    # 1. an update whose sync is skipped: the engine still samples from the old weights (verify mode
    # off, which would refuse the update: test_verify_mode_catches_a_skipped_corrupted_or_partial_pull)
    syncs = engine.syncs
    engine.sync_weights = lambda *a, **k: None  # instance attribute shadows the method
    try:
        with _unverified(group):
            group.update_actor(_training_batch(group, prompts, seed=0))
    finally:
        del engine.sync_weights
    stale = engine_vs_actor()
    assert stale > STALE_MIN, f"one lr=1e-2 step should move log-probs by > {STALE_MIN}, moved {stale:.2e}"

    # 2. a sync without the prefix-cache reset: the long prompt's cached KV block is stale
    reset, engine.llm.reset_prefix_cache = engine.llm.reset_prefix_cache, lambda *a, **k: True
    try:
        engine.sync_weights()
        assert engine_vs_actor() > STALE_MIN
    finally:
        engine.llm.reset_prefix_cache = reset

    # 3. a proper sync brings vLLM back in line with the actor and with the HF engine
    engine.sync_weights()
    assert engine_vs_actor() < LOGP_TOL
    assert torch.equal(_greedy(group, prompts).batch["responses"], _greedy(hf_engine, prompts).batch["responses"])

    # 4. the worker's own hook: update_actor syncs by itself
    group.update_actor(_training_batch(group, prompts, seed=1))
    assert engine.syncs == syncs + 3
    assert engine_vs_actor() < LOGP_TOL


@contextlib.contextmanager
def _unverified(group):
    """``rollout.checkpoint_engine.verify`` off for a block (a test that skips a sync on purpose)."""
    ce = group.worker.config.rollout.checkpoint_engine
    ce.verify = False
    try:
        yield
    finally:
        ce.verify = True


def _folded_actor_digests(group) -> tuple[dict[str, int], dict[str, list[str]]]:
    """The actor's HF weights' digests in the engine's dtype, folded into the engine's names."""
    from rlfoundry.workers.weight_sync import fold_digests, tensor_digest

    engine = group.worker.rollout
    dtypes = engine.weight_dtypes()
    sent = {name: tensor_digest(t, dtypes[name]) for name, t in group.worker.engine.iter_hf_weights()}
    return fold_digests(sent, engine.engine_weight_name)


@vllm_test
def test_vllms_digests_are_the_actors_under_its_fused_names(group, prompts):
    """Computed in vLLM's worker from its own weights (on CPU: as loaded, before the oneDNN repacking
    empties the linear layers' parameters): equal to the actor's HF weights summed into qkv_proj and
    gate_up_proj, the padded vocabulary rows left out; after an update they move with the actor."""
    assert group.worker.config.rollout.checkpoint_engine.verify  # the default
    group.update_actor(_training_batch(group, prompts, seed=3))  # a verified pull (raises if stale)
    expected, parts = _folded_actor_digests(group)
    held = group.worker.rollout.weight_digests()
    assert parts["model.layers.0.self_attn.qkv_proj.weight"] == [
        f"model.layers.0.self_attn.{p}_proj.weight" for p in "qkv"]
    assert parts["model.layers.1.mlp.gate_up_proj.weight"] == ["model.layers.1.mlp.gate_proj.weight",
                                                               "model.layers.1.mlp.up_proj.weight"]
    assert {k: held[k] for k in expected} == expected
    before = dict(held)
    group.update_actor(_training_batch(group, prompts, seed=4))
    after = group.worker.rollout.weight_digests()
    assert after["model.layers.0.self_attn.qkv_proj.weight"] != before["model.layers.0.self_attn.qkv_proj.weight"]
    assert {k: after[k] for k in expected} == _folded_actor_digests(group)[0]


def _hf_names(group) -> list[str]:
    return [name for name, _ in group.worker.engine.iter_hf_weights()]


@vllm_test
def test_verify_mode_catches_a_skipped_corrupted_or_partial_pull(group, prompts, monkeypatch):
    """The hybrid path (update_actor -> on_actor_update -> vLLM pulls the actor's weights): with verify
    on, a pull the engine skipped, a tensor corrupted on its way in (the ``sync_weights.tensor`` fault)
    and a load that drops one tensor each end the update with StaleWeightsError naming the tensor, and
    the stale engine then refuses to generate; the next good pull passes."""
    from rlfoundry.utils import faults
    from rlfoundry.utils.errors import StaleWeightsError

    worker, engine = group.worker, group.worker.rollout
    names = _hf_names(group)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    down = "model.layers.1.mlp.down_proj.weight"

    def caught(pattern: str) -> None:
        batch = _training_batch(group, prompts, seed=worker.param_version)
        with pytest.raises(StaleWeightsError, match=pattern):
            group.update_actor(batch)
        with pytest.raises(StaleWeightsError, match="weight sync after update_actor was skipped"):
            group.generate_sequences(prompts)
        monkeypatch.undo()
        faults.reset()
        worker._refresh_rollout()  # a good, verified pull: the engine is current again
        assert worker.rollout_version == worker.param_version

    # a skipped pull: every tensor differs, the first named
    monkeypatch.setattr(engine, "sync_weights", lambda *a, **k: None)
    caught(rf"tensor '{names[0]}' differs from the trainer's after the sync \((\d+) of \1 tensors differ")

    # one tensor corrupted after its digest was taken (as a broken loader would): named by the fused
    # tensor it went into, with its parts
    monkeypatch.setenv(faults.ENV_VAR, f"sync_weights.tensor@{names.index(q_proj) + 1}:nan")
    faults.reset()
    caught(r"tensor 'model\.layers\.0\.self_attn\.qkv_proj\.weight' \(the engine's tensor holding "
           rf"{q_proj}, .*\) differs .*\(1 of ")

    # the engine's load drops one tensor: that layer keeps its old weights
    rpc = engine.llm.collective_rpc

    def dropping(method, *args, kwargs=None, **kw):
        if method == "reload_weights":
            kwargs = {**kwargs, "weights_iterator": ((n, t) for n, t in kwargs["weights_iterator"] if n != down)}
        return rpc(method, *args, kwargs=kwargs, **kw)

    monkeypatch.setattr(engine.llm, "collective_rpc", dropping)
    caught(rf"tensor '{down}' differs .*\(1 of ")
    assert _greedy(group, prompts).batch["responses"].shape[0] == len(TEXTS)  # generates again


# The runs below get fresh processes: vLLM keeps its parallel state in module globals, so engines
# that come and go within one process would tear down each other's groups.


def _run_python(args: list[str], timeout: int = 540) -> str:
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, *args], cwd=root, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout


# vLLM's own start-up validation with and without its routed-experts option, in a fresh process: vLLM reads
# VLLM_USE_V2_MODEL_RUNNER once an engine has started (its envs cache), and building a config reseeds the RNGs.
_ROUTED_EXPERTS_PROBE = """
import json, os, sys
import vllm
from vllm.engine.arg_utils import EngineArgs
from vllm.triton_utils import HAS_TRITON

args = dict(model=sys.argv[1], dtype="float32", max_model_len=64, enforce_eager=True, skip_tokenizer_init=True,
            enable_prefix_caching=True, kv_cache_memory_bytes=64 << 20)
out = {"version": vllm.__version__, "has_triton": HAS_TRITON,
       "is_moe": EngineArgs(**args).create_engine_config().model_config.is_moe}
for runner in ("default", "1"):
    if runner == "1":
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    try:
        EngineArgs(**args, enable_return_routed_experts=True).create_engine_config()
        out[runner] = None
    except ValueError as e:
        out[runner] = str(e)
print(json.dumps(out))
"""


@vllm_test
def test_vllm_on_cpu_refuses_to_return_routed_experts_for_the_reason_the_start_up_error_gives(tmp_path):
    """The start-up error of routing replay with rollout.name=vllm (``VLLM_NO_ROUTED_EXPERTS``) held against the
    installed vLLM, on the tiny Qwen3-MoE: vLLM takes it for an MoE model and builds its config, and refuses
    ``enable_return_routed_experts`` for the runner reasons the error quotes. When this fails (another vLLM, a
    Triton CPU backend), vLLM may return the routing here: pass it through (docs/moe.md) and drop the error."""
    from rlfoundry.config.rollout_engines import VLLM_NO_ROUTED_EXPERTS
    from rlfoundry.models.tiny import save_tiny_model

    if torch.cuda.is_available():
        pytest.skip("on a GPU vLLM can return routed experts; rlfoundry's engine does not pass them through yet")
    moe = save_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_heads=2, num_kv_heads=1)  # head_dim 32 (vLLM-CPU)
    line = [ln for ln in _run_python(["-c", _ROUTED_EXPERTS_PROBE, str(moe)], timeout=300).splitlines()
            if ln.startswith("{")][-1]
    found = json.loads(line)
    assert found["is_moe"] is True and found["has_triton"] is False
    assert "vLLM " + ".".join(found["version"].split(".")[:2]) in VLLM_NO_ROUTED_EXPERTS
    default, v2 = "AuxOutput Connector requires Model Runner V2", "Model Runner V2 requires Triton"
    assert default in found["default"] and v2 in found["1"]
    assert default in VLLM_NO_ROUTED_EXPERTS and v2 in VLLM_NO_ROUTED_EXPERTS


def _two_vllm_grpo_steps(model_dir, run_dir, *extra: str) -> list[str]:
    """Overrides of a two-step GRPO run on the tiny model with rollout.name=vllm in fp32."""
    return [
        f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
        "actor_rollout_ref.rollout.max_num_seqs=32",
        "data.synthetic.train_size=32", "data.synthetic.val_size=4", "data.train_batch_size=4",
        "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "data.max_response_length=6",
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.logger=file",
        "actor_rollout_ref.rollout.calculate_log_probs=true",  # training/rollout_probs_diff_* are logged
        *extra,
    ]


_DENSE_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return (sum(ord(c) for c in solution_str) % 11) / 10.0
"""


@vllm_test
@pytest.mark.slow
def test_fully_async_with_a_vllm_rollout_pool_receives_every_sync(vllm_model_dir, tmp_path):
    """vLLM in a rollout pool of its own (fully async, staleness 0: every step samples with the weights
    it trains): its log-probs agree with the trainer's recomputed ones at every step, which only holds
    if the checkpoint engine's sync after each update reached vLLM (the lr makes one update visible)."""
    reward = tmp_path / "reward.py"
    reward.write_text(_DENSE_REWARD)
    args = ["-m", "rlfoundry", "train", "--config-name", "fully_async_ppo_trainer",
            *_two_vllm_grpo_steps(vllm_model_dir, tmp_path, "rollout.n_gpus_per_node=1", "data.train_batch_size=2",
                                  "async_training.require_batches=1", "async_training.staleness_threshold=0",
                                  "data.gen_batch_size=2", "trainer.total_training_steps=3", "trainer.test_freq=-1",
                                  "trainer.val_before_train=false", f"custom_reward_function.path={reward}",
                                  "actor_rollout_ref.actor.optim.lr=0.02")]
    _run_python(args)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2, 3] and all(steps[s]["async/sync_megabytes"] > 0 for s in steps)
    assert any(steps[s]["actor/grad_norm"] > 0 for s in steps)  # the updates moved the policy
    assert max(steps[s]["rollout_corr/log_ppl_abs_diff"] for s in steps) < LOGP_TOL


_TWO_RANK_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, model_dir, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from omegaconf import OmegaConf
    from transformers import AutoTokenizer
    from rlfoundry.engines.fsdp import utils as fu
    from rlfoundry.models.hf import load_hf_model
    from rlfoundry.workers.rollout.vllm_rollout import VLLMRollout
    from tests.workers import make_prompts

    module = fu.apply_fsdp2(load_hf_model(model_dir), "cpu")  # each rank holds half of every weight
    cfg = OmegaConf.create({"dtype": "float32", "load_format": "dummy_dtensor", "prompt_length": 24,
                            "response_length": 8, "max_num_seqs": 8, "n": 1, "do_sample": False})
    engine = VLLMRollout(module, cfg, pad_token_id=0, eos_token_id=2, rank=rank)
    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), [["hello", "a"], ["12+3=", "xyz"]][rank])
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(1.5)  # a change of the sharded weights the engine only sees through a sync
    engine.sync_weights()
    out = engine.generate_sequences(prompts)
    with torch.no_grad(), fu.unsharded(module):
        logits = module(input_ids=out.batch["input_ids"], attention_mask=out.batch["attention_mask"],
                        position_ids=out.batch["position_ids"]).logits[:, 23:-1].float()
    actor = torch.log_softmax(logits, -1).gather(-1, out.batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = out.batch["response_mask"].bool()
    engine.shutdown()
    dist.barrier()  # the worker's group survived the engine's shutdown
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"world": dist.get_world_size(), "max_abs_dlogp":
                   float((out.batch["rollout_log_probs"] - actor)[mask].abs().max())}, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2]), sys.argv[3]), nprocs=2)
"""


@vllm_test
@pytest.mark.slow
def test_two_fsdp_ranks_each_sync_their_own_engine(vllm_model_dir, tmp_path):
    """FSDP2 over two gloo ranks: shards are gathered per parameter and each rank's engine matches."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = tmp_path / "two_ranks.py"
    script.write_text(_TWO_RANK_SCRIPT)
    _run_python([str(script), str(vllm_model_dir), str(port), str(tmp_path)])
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["world"] == 2 and result["max_abs_dlogp"] < LOGP_TOL, (rank, result)


_MEGATRON_SCRIPT = r"""
import json, sys
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.main_ppo import build_trainer
from tests.workers import make_prompts

cfg = load_config(sys.argv[1:], config_name="ppo_megatron_trainer")
trainer = build_trainer(cfg)
summary = trainer.fit()
wg = trainer.actor_rollout_wg
probe = make_prompts(trainer.tokenizer, ["3+4=", "12+30=", "7+1=", "the quick brown fox"],
                     max_prompt_length=int(cfg.data.max_prompt_length))
probe.meta_info["validate"] = True
out = wg.generate_sequences(probe)
out.meta_info["temperature"] = 1.0
actor = wg.compute_log_prob(out).batch["old_log_probs"]
mask = out.batch["response_mask"].bool()
print("RESULT " + json.dumps({"global_step": summary["global_step"], "tokens": int(mask.sum()),
                              "max_abs_dlogp": float((out.batch["rollout_log_probs"] - actor)[mask].abs().max())}))
"""


@vllm_test
@pytest.mark.slow
def test_megatron_actor_at_tp2_syncs_its_weights_to_vllm(tmp_path):
    """``--config-name ppo_megatron_trainer`` with rollout.name=vllm on two processes at tensor parallel 2:
    each rank's engine starts from and follows the Megatron actor's HF-named weight stream (gathered
    across the tensor-parallel ranks), so after two lr=1e-2 updates vLLM's log-probs of its own
    samples equal the actor's within 1e-4, and so do the sampled tokens' probabilities at every step."""
    from rlfoundry.models.tiny import save_tiny_model

    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    # head_dim 32 for vLLM-CPU's kernels; two key/value heads so that tensor parallel 2 splits them
    model_dir = save_tiny_model(tmp_path / "tiny-qwen2-kv2", num_heads=2, num_kv_heads=2, seed=3)
    overrides = _two_vllm_grpo_steps(model_dir, tmp_path, "trainer.test_freq=-1", "trainer.n_gpus_per_node=2",
                                     "trainer.worker_backend=process", "actor_rollout_ref.actor.optim.lr=1e-2",
                                     "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2")
    stdout = _run_python(["-c", _MEGATRON_SCRIPT, *overrides])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["global_step"] == 2 and result["tokens"] > 0
    assert result["max_abs_dlogp"] <= 1e-4, result
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = {r["step"]: r for r in records if "actor/pg_loss" in r}
    assert sorted(steps) == [1, 2]
    names = ("training/rollout_actor_probs_diff_max", "training/rollout_probs_diff_max")
    logged = [r[k] for r in steps.values() for k in names if k in r]
    # step 2 samples with the weights after update 1 and scores them with the actor: the sync worked
    assert len(logged) >= 2 and max(logged) <= 1e-4, logged


_AGENT_SCRIPT = r"""
import importlib, json, sys
from pathlib import Path
from tests.workers import local_worker, worker_config
from tests.workers.test_agent_loop import QUESTION, TOOLS, _loop, _prompts, tool_policy
from rlfoundry.models.tiny import build_tokenizer
from rlfoundry.workers.rollout.agent_loop import AgentLoop
from rlfoundry.workers.rollout.hf_rollout import HFRollout

if __name__ == "__main__":  # an engine may spawn processes that re-import this script
    module, name = sys.argv[2].split(":")  # the engine's overrides, e.g. tests.workers.test_vllm_rollout:VLLM_OVERRIDES
    path = tool_policy(Path(sys.argv[1]))
    multi_turn = ["rollout.multi_turn.enable=true", f"rollout.multi_turn.tool_config_path={TOOLS}",
                  "rollout.prompt_length=160", "rollout.response_length=200", "rollout.val_kwargs.n=1"]
    group = local_worker(worker_config(path, getattr(importlib.import_module(module), name) + multi_turn),
                         role="actor_rollout")
    w = group.worker
    tokenizer = build_tokenizer()
    _, kwargs = _loop(tokenizer, {})
    prompts = _prompts(tokenizer, kwargs, [QUESTION, "What is 2+2?"])
    prompts.meta_info["validate"] = True
    ours = group.generate_sequences(prompts)
    hf = HFRollout(w.actor.module, w.config.rollout, pad_token_id=w.tokenizer.pad_token_id,
                   eos_token_id=w.rollout.eos_token_ids)
    hf_loop = AgentLoop(hf, w.tokenizer, w.config.rollout.multi_turn, w.agent_loop.tools, 200, chat_template_kwargs=kwargs)
    ref = hf_loop.generate_sequences(prompts)
    mask = ours.batch["response_mask"].bool()
    print("RESULT " + json.dumps({
        "same_tokens": bool((ours.batch["responses"] == ref.batch["responses"]).all()),
        "same_mask": bool((ours.batch["response_mask"] == ref.batch["response_mask"]).all()),
        "turns": [int(t) for t in ours.non_tensor_batch["num_turns"]],
        "text": tokenizer.decode(ours.batch["responses"][0][ours.batch["attention_mask"][0, 160:].bool()]),
        "max_abs_dlogp": float((ours.batch["rollout_log_probs"] - ref.batch["rollout_log_probs"])[mask].abs().max()),
    }))
    w.rollout.shutdown()
"""


_CALCULATOR_SCRIPT = r"""
import json, sys
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.main_ppo import build_trainer

trainer = build_trainer(load_config(sys.argv[1:], config_name="calculator_grpo"))
summary = trainer.fit()
wg = trainer.actor_rollout_wg
worker = wg.worker.workers["actor_rollout"] if hasattr(wg.worker, "workers") else wg.worker  # colocated
print("RESULT " + json.dumps({"global_step": summary["global_step"], "engine": type(worker.rollout).__name__}))
worker.rollout.shutdown()
"""


@vllm_test
@pytest.mark.slow
def test_the_calculator_demo_trains_with_vllm_rollout(tmp_path):
    """main_ppo with rollout.multi_turn (the packaged calculator demo) and rollout.name=vllm: two GRPO
    steps on tool trajectories (32 per step; the policy calls in about one sample of ten), vLLM's
    log-probs of the sampled tokens agreeing with the actor's."""
    stdout = _run_python(["-c", _CALCULATOR_SCRIPT, f"trainer.default_local_dir={tmp_path}",
                          "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.dtype=float32",
                          "actor_rollout_ref.rollout.calculate_log_probs=true",  # the engine's log-probs, logged
                          "actor_rollout_ref.rollout.max_num_seqs=32", "data.synthetic.train_size=32",
                          "data.synthetic.val_size=8", "data.train_batch_size=4", "actor_rollout_ref.rollout.n=8",
                          "actor_rollout_ref.actor.ppo_mini_batch_size=4", "trainer.total_training_steps=2",
                          "trainer.test_freq=2", "trainer.save_freq=-1", "trainer.logger=file"])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {"global_step": 2, "engine": "VLLMRollout"}
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == 2 and max(r["num_turns/max"] for r in steps) == 3  # a call, its answer, a final turn
    assert all(r["multi_turn/tool_calls/mean"] > 0 for r in steps), [r["multi_turn/tool_calls/mean"] for r in steps]
    names = ("training/rollout_actor_probs_diff_max", "training/rollout_probs_diff_max")
    logged = [r[k] for r in steps for k in names if k in r]
    assert logged and max(logged) < LOGP_TOL, logged


_LORA_SCRIPT = r"""
import json, sys
import torch
from tests.workers import local_worker, make_prompts, worker_config
from tests.workers.test_vllm_rollout import VLLM_OVERRIDES, TEXTS, TP, _training_batch, _with_meta

model_dir, mode = sys.argv[1], sys.argv[2]
lora = ["model.lora_rank=8", "model.lora_alpha=16", f"rollout.lora_sync={mode}"]
group = local_worker(worker_config(model_dir, VLLM_OVERRIDES + lora), role="actor_rollout")
engine, tokenizer = group.worker.rollout, group.worker.tokenizer
prompts = make_prompts(tokenizer, TEXTS, max_prompt_length=TP)

def engine_vs_actor():
    out = group.generate_sequences(_with_meta(prompts, validate=True))
    actor = group.compute_log_prob(_with_meta(out, temperature=1.0)).batch["old_log_probs"]
    mask = out.batch["response_mask"].bool()
    return float((out.batch["rollout_log_probs"] - actor)[mask].abs().max())

result = {"start": engine_vs_actor(), "enable_lora": bool(engine.engine_kwargs.get("enable_lora"))}
engine.sync_weights = lambda *a, **k: None  # a skipped sync: the engine keeps the old adapter
verify = group.worker.config.rollout.checkpoint_engine
verify.verify = False  # merged syncs are verified, and the skip would fail the update (see the verify tests)
try:
    for seed in range(3):
        group.update_actor(_training_batch(group, prompts, seed=seed))
finally:
    del engine.sync_weights
    verify.verify = True
result["stale"] = engine_vs_actor()
engine.sync_weights()
result["synced"] = engine_vs_actor()
group.update_actor(_training_batch(group, prompts, seed=9))  # the worker's own hook syncs
result["after_update"] = engine_vs_actor()
import tempfile
saved = tempfile.mkdtemp() + "/actor"
group.save_checkpoint(saved)
group.update_actor(_training_batch(group, prompts, seed=10))
group.load_checkpoint(saved)  # the actor goes back a step: the engine must follow (a resumed run)
result["after_load"] = engine_vs_actor()

# verify mode (on): the syncs above passed it; what it compares, and what it catches
from rlfoundry.utils.errors import StaleWeightsError

def refused(seed):
    try:
        group.update_actor(_training_batch(group, prompts, seed=seed))
    except StaleWeightsError as e:
        return str(e)
    return None

if mode == "adapter":
    expected, held = engine.adapter_digests(*group.worker._adapter_for_rollout())
    result["adapter_tensors"] = [len(expected), len(held), sum(expected[k] == held.get(k) for k in expected)]
engine.sync_weights = lambda *a, **k: None  # a skipped sync: the engine keeps the old adapter / weights
result["skipped"] = refused(11)
del engine.sync_weights
group.worker._refresh_rollout()  # a good, verified sync: current again
if mode == "adapter":  # one adapter tensor altered between the trainer's record and vLLM's load
    victim = "base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"
    load = engine.adapter.load

    def corrupting(llm, tap=None):
        def record_then_corrupt(config, tensors):
            tap(config, dict(tensors))
            tensors[victim] = tensors[victim] + 1e-2
        load(llm, record_then_corrupt)

    engine.adapter.load = corrupting
    result["corrupted"] = refused(12)
    del engine.adapter.load
    group.worker._refresh_rollout()
result["after_verify"] = engine_vs_actor()
print("RESULT " + json.dumps(result))
engine.shutdown()
"""


@vllm_test
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_a_lora_actor_reaches_vllm_as_an_adapter_or_merged(vllm_model_dir, mode):
    """LoRA on the actor: vLLM gets the adapter alone (a LoRA request on the base it read from disk) or
    the merged weights; either way it scores its tokens as the actor does (also after a checkpoint
    load, as on resume), and a skipped sync shows."""
    pytest.importorskip("peft")
    stdout = _run_python(["-c", _LORA_SCRIPT, str(vllm_model_dir), mode])
    result = json.loads(next(line for line in stdout.splitlines() if line.startswith("RESULT "))[7:])
    assert result["enable_lora"] == (mode == "adapter")
    assert result["stale"] > STALE_MIN, result
    assert max(result["start"], result["synced"], result["after_update"], result["after_load"],
               result["after_verify"]) < 1e-4, result
    # verify mode (rollout.checkpoint_engine.verify, on) checks both kinds of sync and names a stale tensor
    if mode == "adapter":  # vLLM's LoRA layers' A/B (B scaled by alpha/r) against the peft tensors sent
        count = result["adapter_tensors"][0]
        assert count == 2 * 7 * 2 and result["adapter_tensors"] == [count] * 3, result  # A, B x 7 modules x 2 layers
        assert re.search(r"adapter on rank 0 \(param_version \d+\): tensor 'base_model\.model\.model\.layers\.\d+\."
                         r"\w+\.\w+_proj\.lora_[AB]\.weight' differs", result["skipped"]), result["skipped"]
        assert re.search(r"tensor 'base_model\.model\.model\.layers\.1\.self_attn\.v_proj\.lora_B\.weight' "
                         r"differs .*\(1 of \d+ tensors differ\)", result["corrupted"]), result["corrupted"]
    else:  # merged: the full-weights path, under vLLM's fused names
        assert re.search(r"tensor 'model\.layers\.\d+\.\w+\.\w+_proj\.weight'.* differs", result["skipped"]), result


def _verl_lora_grpo_args(data, model) -> list[str]:
    """verl's LoRA GRPO example (examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh): its keys, the
    sizes cut to a tiny model on the CPU (verl's values in the comments), plus fp32, CPU and two steps."""
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={data}/train.parquet",
        f"data.val_files={data}/test.parquet", "data.train_batch_size=4",  # verl: 16
        "data.max_prompt_length=512", "data.max_response_length=8",  # verl: 1024
        "data.filter_overlong_prompts=True", "data.truncation=error", "data.shuffle=False",
        f"actor_rollout_ref.model.path={model}", "actor_rollout_ref.model.use_shm=True",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",  # verl: 64, 32
        "actor_rollout_ref.actor.optim.lr=3e-3",  # verl: 3e-6 (a 3B model); large enough to move a tiny one
        "actor_rollout_ref.model.use_remove_padding=True", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",  # verl: 40
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",  # verl: 40
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",  # verl: 2
        "actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=2",  # verl: 5
        "actor_rollout_ref.rollout.calculate_log_probs=true",  # verl: off; on, training/rollout_probs_diff_* are logged
        "actor_rollout_ref.rollout.load_format=safetensors", "actor_rollout_ref.rollout.layered_summon=True",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",  # verl: 40
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=['console','file']", "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2.5_3b_grpo_lora", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=2", "trainer.test_freq=2", "trainer.total_epochs=15",  # verl: 20, 5
        # additions: fp32 on the CPU (vLLM and the actor score alike), two steps
        "actor_rollout_ref.rollout.dtype=float32", "trainer.device=cpu", "trainer.total_training_steps=2",
    ]


@vllm_test
@pytest.mark.slow
def test_verl_lora_grpo_command_line_trains_with_vllm_and_exports_both_formats(vllm_model_dir, gsm8k_parquet,
                                                                               tmp_path):
    pytest.importorskip("peft")
    stdout = _run_python(["-m", "rlfoundry.trainer.main_ppo", *_verl_lora_grpo_args(gsm8k_parquet, vllm_model_dir),
                          f"trainer.default_local_dir={tmp_path / 'run'}"])
    assert "finished at step 2" in stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "actor/pg_loss" in r]
    assert len(steps) == 2 and any(k.startswith("val-core/openai/gsm8k") for k in records[-1])
    # each step's samples as vLLM scored them (the adapter it was sent) vs the actor's recomputation
    names = ("training/rollout_actor_probs_diff_max", "training/rollout_probs_diff_max")
    diffs = [r[k] for r in steps for k in names if k in r]
    assert len(diffs) >= 2 and max(diffs) < 1e-4, diffs
    for fmt in ("merged", "adapter"):
        _run_python(["-m", "rlfoundry", "export", str(tmp_path / "run"), str(tmp_path / fmt), "--format", fmt])
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(vllm_model_dir),
                                        str(tmp_path / "adapter")).eval()
    base = AutoModelForCausalLM.from_pretrained(vllm_model_dir).eval()
    ids = torch.tensor([[5, 17, 60, 99, 3, 44]])
    with torch.no_grad():
        want, got, start = (m(input_ids=ids).logits for m in (merged, adapted, base))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert (want - start).abs().max() > 1e-4  # the adapter trained


