"""The HF rollout's static-shape decode (``workers/rollout/static_decode.py``) gives the dynamic loop's
tokens, log-probs and lengths: greedy and seeded sampling, stop tokens ending rows at different steps,
several batch sizes and bucket shrinks, without per-token host syncs, and its step traces as one graph."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlfoundry.workers.rollout.hf_rollout import HFRollout
from rlfoundry.workers.rollout.static_decode import StaticDecoder, bucket_for, draw_uniforms
from tests.host_reads import count_host_reads
from tests.workers import make_prompts, one_thread, worker_config  # noqa: F401 (fixture)

TEXTS = ["hello world", "a", "the quick brown fox", "12+7=", "what is 3*4?"]
EOS_THIRD = list(range(0, 260, 3))  # a third of the vocabulary: samples end at assorted lengths


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)


def _engines(model, tiny_model_dir, tokenizer, overrides=(), sync_every=2, cpu_kernels=False):
    """The dynamic engine and the static one on the same module and seed; the static one reads the live
    count every ``sync_every`` steps (small here, so the bucket shrinks several times per call)."""
    cfg = worker_config(tiny_model_dir, ["rollout.response_length=20", *overrides])["rollout"]
    dynamic = HFRollout(model, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, cpu_kernels=cpu_kernels,
                        static_decode=False)
    static = HFRollout(model, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=True)
    static._static = StaticDecoder(model, sync_every=sync_every)
    return dynamic, static


def _generate(engine, prompts, **meta):
    data = prompts.select()
    data.meta_info.update(meta)
    return engine.generate_sequences(data).batch


def _assert_same(a, b):
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(a["response_mask"], b["response_mask"])
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["position_ids"], b["position_ids"])
    # the static decode vs the dynamic loop (other shapes, other blocking): fp32 rounding only: the same forward in
    # another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
    torch.testing.assert_close(a["rollout_log_probs"], b["rollout_log_probs"], atol=2e-5, rtol=0)


@pytest.mark.parametrize("prompts_n", [(1, 1), (3, 2), (5, 3), (4, 4)])  # 1, 6, 15, 16 rows: buckets 1, 8, 16, 16
@pytest.mark.parametrize("meta", [
    {"do_sample": False},
    {"eos_token_id": EOS_THIRD},
    {"eos_token_id": EOS_THIRD, "top_k": 20, "top_p": 0.9, "temperature": 0.7},
], ids=["greedy", "sampled", "top-k-top-p"])
@pytest.mark.numerics
def test_static_equals_dynamic(model, tiny_model_dir, tokenizer, prompts_n, meta):
    n_prompts, n = prompts_n
    dynamic, static = _engines(model, tiny_model_dir, tokenizer)
    prompts = make_prompts(tokenizer, TEXTS[:n_prompts])
    for _ in range(2):  # a second call: a new seed, the static caches reused
        a, b = _generate(dynamic, prompts, n=n, **meta), _generate(static, prompts, n=n, **meta)
        _assert_same(a, b)
    if meta.get("eos_token_id") and n_prompts * n > 1:
        lengths = a["response_mask"].sum(-1)
        assert len(set(lengths.tolist())) > 2 and lengths.min() < 20, "rows should end at different steps"


@pytest.mark.numerics
def test_greedy_rows_stopping_at_different_steps_shrink_the_bucket(model, tiny_model_dir, tokenizer):
    """Greedy EOS ids picked from what greedy decoding emits midway: rows end at different steps, the
    static batch drops from 16 slots to smaller buckets, and every output still equals the dynamic one."""
    dynamic, static = _engines(model, tiny_model_dir, tokenizer, sync_every=1)
    prompts = make_prompts(tokenizer, TEXTS[:4])
    free = _generate(dynamic, prompts, n=4, eos_token_id=[-5], do_sample=False)
    eos = sorted({int(t) for t in free["responses"][:, 2:9].flatten()})[:4]
    a = _generate(dynamic, prompts, n=4, do_sample=False, eos_token_id=eos)
    sizes = []
    repack = static._static._repack
    static._static._repack = lambda cache, keep, size, filled: sizes.append(size) or repack(cache, keep, size, filled)
    b = _generate(static, prompts, n=4, do_sample=False, eos_token_id=eos)
    _assert_same(a, b)
    assert sizes and sizes == sorted(sizes, reverse=True) and all(s < 16 for s in sizes)


@pytest.mark.numerics
def test_static_equals_the_cpu_default_path(model, tiny_model_dir, tokenizer):
    """Against the engine as the CPU runs it by default (the fused decode step of the CPU kernels)."""
    dynamic, static = _engines(model, tiny_model_dir, tokenizer, cpu_kernels=True)
    prompts = make_prompts(tokenizer, TEXTS[:3])
    _assert_same(_generate(dynamic, prompts, n=3, eos_token_id=EOS_THIRD),
                 _generate(static, prompts, n=3, eos_token_id=EOS_THIRD))


def test_the_host_reads_the_live_count_once_per_sync_interval_only(model, tiny_model_dir, tokenizer, monkeypatch):
    """No per-token host sync: over 20 tokens with ``sync_every=8`` the decode loop reads the device twice
    (the live count at steps 8 and 16), counted on every tensor-to-Python method (``tests/host_reads.py``)."""
    _, static = _engines(model, tiny_model_dir, tokenizer, sync_every=8)
    prompts = make_prompts(tokenizer, TEXTS[:2])
    decode, seen = static._static.decode, {}

    def counted_decode(*args, **kwargs):
        with count_host_reads(monkeypatch) as reads:
            out = decode(*args, **kwargs)
        seen["reads"] = reads
        return out

    static._static.decode = counted_decode
    _generate(static, prompts, n=2, eos_token_id=[-5])  # nobody stops: the whole 20 steps
    assert static._static.host_reads == 2
    assert [name for name, _ in seen["reads"]] == ["__int__", "__int__"], seen["reads"]


def test_uniforms_follow_the_output_row_not_the_slot():
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    every = draw_uniforms(g1, 5, torch.arange(5))
    # rows 4 and 1 packed into slots 0 and 1, two padding slots (5, 6) after them
    picked = draw_uniforms(g2, 5, torch.tensor([4, 1, 5, 6]))
    assert torch.equal(picked[:2], every[[4, 1]])
    assert [bucket_for(k) for k in (1, 2, 3, 8, 9, 64, 65)] == [1, 2, 4, 8, 16, 64, 128]


@pytest.mark.numerics
def test_the_decode_step_traces_as_one_graph(model, tiny_model_dir, tokenizer):
    """What CUDA graphs need: ``torch.compile(fullgraph=True)`` of the step raises on any graph break
    (data-dependent control flow, a host read, an unsupported op). The eager backend compiles nothing,
    so this runs in seconds on the CPU; the outputs still equal the dynamic loop's."""
    torch._dynamo.reset()
    dynamic, static = _engines(model, tiny_model_dir, tokenizer, sync_every=4)
    decoder = static._static
    decoder._step = torch.compile(decoder._forward, backend="eager", fullgraph=True, dynamic=False)
    prompts = make_prompts(tokenizer, TEXTS[:3])
    _assert_same(_generate(dynamic, prompts, n=2, eos_token_id=EOS_THIRD),
                 _generate(static, prompts, n=2, eos_token_id=EOS_THIRD))


def test_use_torch_compile_decides_the_path(model, tiny_model_dir, tokenizer):
    """verl's key: null (auto) compiles the static decode on CUDA only; the CPU keeps the dynamic loop."""
    def engine(*overrides, static=None):
        cfg = worker_config(tiny_model_dir, list(overrides))["rollout"]
        return HFRollout(model, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=static)

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert engine()._static_decoder(cpu) is None
    assert engine("rollout.use_torch_compile=false")._static_decoder(cuda) is None
    plain = engine(static=True)._static_decoder(cpu)
    assert plain is not None and plain._step == plain._forward  # static, not compiled
    auto_cuda = engine()._static_decoder(cuda)
    assert auto_cuda is not None and auto_cuda._step != auto_cuda._forward  # compiled (lazily: nothing runs here)
    assert math.isfinite(auto_cuda.sync_every)


def test_a_thread_other_than_the_importing_one_gets_graph_trees_state():
    """CUDA graph trees keep per-thread state that inductor sets up only on its importing thread; the
    agent loop's engine thread and the asynchronous rollouter decode elsewhere (on the H100 their
    first compiled step failed ``get_obj``'s assertion, issue 33). The lookup that failed must
    succeed on such a thread after ``_graph_trees_on_this_thread``."""
    import threading

    from torch._inductor import cudagraph_trees

    from rlfoundry.workers.rollout.static_decode import _graph_trees_on_this_thread

    seen: dict[str, object] = {}

    def probe():
        seen["before"] = torch._C._is_key_in_tls("tree_manager_containers")
        _graph_trees_on_this_thread()
        seen["containers"] = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
        seen["locks"] = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_locks")

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    assert seen["before"] is False  # what the engine thread found
    assert isinstance(seen["containers"], dict) and "locks" in seen
    # a thread that has the state keeps it (its graphs live in those containers)
    own = cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers")
    _graph_trees_on_this_thread()
    assert cudagraph_trees.get_obj(cudagraph_trees.local, "tree_manager_containers") is own
    assert seen["containers"] is not own


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_decode_on_cuda_from_a_worker_thread_equals_the_dynamic_loop(tiny_model_dir, tokenizer):
    """The compiled, CUDA-graphed decode run from a thread that is not the importing one (as the agent
    loop's engine thread runs it), greedy: the dynamic loop's tokens, row for row (inductor's fp32
    kernels round differently, so a near tie may flip one row's argmax; not most)."""
    from concurrent.futures import ThreadPoolExecutor

    gpu = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).cuda()
    cfg = worker_config(tiny_model_dir, ["rollout.response_length=20"])["rollout"]
    dynamic = HFRollout(gpu, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id, static_decode=False)
    compiled = HFRollout(gpu, cfg, tokenizer.pad_token_id, tokenizer.eos_token_id)  # use_torch_compile auto: on
    prompts = make_prompts(tokenizer, TEXTS[:3]).to("cuda")
    with ThreadPoolExecutor(1) as pool:
        got = pool.submit(_generate, compiled, prompts, n=2, do_sample=False).result()
    assert compiled._static_decoder(torch.device("cuda"))._graphs
    want = _generate(dynamic, prompts, n=2, do_sample=False)
    same_rows = (got["responses"].cpu() == want["responses"].cpu()).all(dim=1)
    assert same_rows.float().mean() >= 0.8, same_rows
