#!/usr/bin/env python
"""Smoke check and API probe for SGLang's in-process ``Engine`` on a CPU-only machine.

    bash scripts/setup_sglang_cpu.sh                      # builds ./.venv-sglang once
    .venv-sglang/bin/python scripts/sglang_cpu_probe.py [--quick] [--json-out probe.json]

It builds a tiny Qwen2 (head dim 32, byte-level tokenizer), starts ``sglang.Engine`` on it with the
CPU settings below and checks, against a plain Hugging Face model in this process:

1. greedy tokens and their log-probs (``meta_info["output_token_logprobs"]``) equal HF's;
2. sampling (``n`` > 1, temperature / top-p / top-k): output order, and which distribution the
   returned log-probs come from (temperature-scaled, not top-k/top-p renormalised); whether a
   per-request ``sampling_seed`` is honoured; ``stop_token_ids`` with several ids; ``ignore_eos``;
3. ``update_weights_from_tensor`` (HF parameter names, inside ``begin/end_weight_update``): the
   engine's greedy log-probs then equal the perturbed HF model's;
4. ``release_memory_occupation`` / ``resume_memory_occupation``;
5. what the engine does to the host process: child processes, env vars, signal handlers,
   multiprocessing start method, logging, rlimits; it runs beside a gloo process group and a
   child process of the host's own, and reports whether both survive ``Engine.shutdown()``;
6. (unless --quick) a second engine in the same process with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``,
   and whether a SIGTERM to the idle host still terminates it once the engine has served a request.

Exit status 0 only when the numeric checks (1, 3) and the clean shutdown pass; the rest is reported.
"""

from __future__ import annotations

# SGLang decides "CPU engine" at import time (sglang.srt.utils.common.is_cpu), so before any import.
import os

os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")

import argparse
import copy
import json
import logging
import multiprocessing as mp
import resource
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

TOL_GREEDY = 1e-4  # |Δ log-prob| allowed between SGLang and HF (fp32 on CPU)

ENGINE_KWARGS = dict(
    device="cpu",
    attention_backend="torch_native",
    disable_overlap_schedule=True,
    dtype="float32",
    skip_tokenizer_init=True,  # token ids in, token ids out
    tp_size=1,
    random_seed=1234,
    mem_fraction_static=0.05,  # share of *free host RAM* the profiler may use; capped below anyway
    max_total_tokens=4096,  # KV-cache size in tokens (min with the profiled capacity)
    context_length=512,
    max_running_requests=64,
    sleep_on_idle=True,  # without it the idle scheduler busy-polls one core at ~100%
    log_level="error",
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sleep_forever() -> None:  # a child of the host's own, to see whether Engine.shutdown() spares it
    time.sleep(3600)


def host_state() -> dict:
    import asyncio

    import torch

    sigs = {}
    for s in signal.valid_signals():
        try:
            handler = signal.getsignal(s)
        except (ValueError, OSError):
            continue
        name = s.name if isinstance(s, signal.Signals) else str(s)
        sigs[name] = getattr(handler, "__qualname__", None) or repr(handler)
    root = logging.getLogger()
    try:
        loop = asyncio.get_event_loop_policy().get_event_loop()
        loop_id = f"{type(loop).__name__}@{id(loop):x}"
    except RuntimeError:
        loop_id = None
    return {
        "env": dict(os.environ),
        "signals": sigs,
        "mp_start_method": mp.get_start_method(allow_none=True),
        "torch_num_threads": torch.get_num_threads(),
        "root_logger": [root.level, [type(h).__name__ for h in root.handlers]],
        "rlimit_nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "rlimit_stack": resource.getrlimit(resource.RLIMIT_STACK),
        "excepthook": repr(sys.excepthook),
        "asyncio_loop": loop_id,
        "dist_initialized": torch.distributed.is_initialized(),
    }


def diff_state(before: dict, after: dict) -> dict:
    out = {}
    for key in before:
        if key == "env":
            b, a = before["env"], after["env"]
            changed = {k: [b.get(k), a.get(k)] for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)}
            if changed:
                out["env"] = changed
        elif key == "signals":
            b, a = before["signals"], after["signals"]
            changed = {k: [b.get(k), a.get(k)] for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)}
            if changed:
                out["signals"] = changed
        elif before[key] != after[key]:
            out[key] = [before[key], after[key]]
    return out


def children() -> list[dict]:
    import psutil

    rows = []
    for p in psutil.Process().children(recursive=True):
        try:
            rows.append({"pid": p.pid, "ppid": p.ppid(), "name": p.name(), "cmdline": " ".join(p.cmdline())[:120],
                         "rss_mb": round(p.memory_info().rss / 2**20, 1), "threads": p.num_threads()})
        except Exception:  # noqa: BLE001 - a process may exit while listed
            pass
    return rows


# ---------------------------------------------------------------- Hugging Face references


def hf_greedy(model, prompt: list[int], n_new: int) -> tuple[list[int], list[float]]:
    import torch

    ids, toks, lps = list(prompt), [], []
    with torch.no_grad():
        for _ in range(n_new):
            logits = model(torch.tensor([ids])).logits[0, -1].float()
            lp = torch.log_softmax(logits, -1)
            t = int(torch.argmax(logits))
            toks.append(t)
            lps.append(float(lp[t]))
            ids.append(t)
    return toks, lps


def hf_scored(model, prompt: list[int], out: list[int], temperature: float, top_k: int, top_p: float) -> dict:
    """Log-prob of each sampled token under three candidate distributions."""
    import torch

    with torch.no_grad():
        logits = model(torch.tensor([prompt + out])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(out)]
    idx = torch.tensor(out)
    raw = torch.log_softmax(rows, -1).gather(1, idx[:, None])[:, 0]
    scaled_all = torch.log_softmax(rows / temperature, -1)
    scaled = scaled_all.gather(1, idx[:, None])[:, 0]
    # top-k then top-p renormalised, the distribution the token was drawn from
    probs = scaled_all.exp()
    sp, si = probs.sort(-1, descending=True)
    keep = (torch.arange(sp.shape[-1])[None, :] < top_k) & ((sp.cumsum(-1) - sp) <= top_p)
    sp = torch.where(keep, sp, torch.zeros_like(sp))
    sp = sp / sp.sum(-1, keepdim=True)
    renorm = torch.zeros_like(probs).scatter_(-1, si, sp).log().gather(1, idx[:, None])[:, 0]
    return {"raw": raw.tolist(), "temperature_scaled": scaled.tolist(), "scaled_topk_topp_renormalised": renorm.tolist()}


def max_abs(a, b) -> float:
    return max((abs(x - y) for x, y in zip(a, b, strict=True)), default=0.0)


def engine_tokens_and_logprobs(out: dict) -> tuple[list[int], list[float]]:
    lps = out["meta_info"]["output_token_logprobs"]  # [(logprob, token_id, text-or-None), ...]
    assert [t for _, t, _ in lps] == out["output_ids"], "output_token_logprobs ids differ from output_ids"
    return out["output_ids"], [lp for lp, _, _ in lps]


# ---------------------------------------------------------------- the probe


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", help="where to write the tiny model (default: a temp dir)")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--quick", action="store_true", help="skip the second engine (SGLANG_RETURN_ORIGINAL_LOGPROB)")
    ap.add_argument("--json-out", help="also write the report here")
    args = ap.parse_args(argv)

    import psutil
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from rlfoundry.models.tiny import save_tiny_model

    report: dict = {"timings_s": {}, "checks": {}}
    T = report["timings_s"]
    ok = True

    def step(name):
        class _Timer:
            def __enter__(self):
                self.t = time.perf_counter()
                print(f"[probe] {name} ...", flush=True)

            def __exit__(self, *exc):
                T[name] = round(time.perf_counter() - self.t, 3)
                print(f"[probe] {name}: {T[name]:.2f} s", flush=True)

        return _Timer()

    tmp = tempfile.TemporaryDirectory(prefix="sglang-probe-")
    model_dir = Path(args.model_dir or tmp.name) / "tiny-qwen2"
    with step("build_tiny_model"):
        save_tiny_model(model_dir, num_heads=2, num_kv_heads=1, seed=3)
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cfg = hf.config
    report["model"] = {"hidden": cfg.hidden_size, "heads": cfg.num_attention_heads, "kv_heads": cfg.num_key_value_heads,
                       "head_dim": cfg.hidden_size // cfg.num_attention_heads, "vocab": cfg.vocab_size,
                       "eos_token_id": cfg.eos_token_id}

    # The host owns a gloo process group and a child process before the engine exists.
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)
    sentinel = mp.get_context("fork").Process(target=_sleep_forever, daemon=True)
    sentinel.start()

    import sglang

    report["versions"] = {"sglang": sglang.__version__, "torch": torch.__version__,
                          "transformers": __import__("transformers").__version__}
    before = host_state()
    threads_before = psutil.Process().num_threads()
    with step("engine_start"):
        engine = sglang.Engine(model_path=str(model_dir), **ENGINE_KWARGS)
    after_start = host_state()
    report["host_changes_after_start"] = diff_state(before, after_start)
    report["host_threads"] = [threads_before, psutil.Process().num_threads()]
    report["engine_processes"] = children()
    report["engine_child_pids"] = engine.get_all_child_pids()
    sched = [psutil.Process(pid) for pid in engine.get_all_child_pids()]
    for p in sched:
        p.cpu_percent(None)
    time.sleep(2)
    report["engine_idle_cpu_percent"] = {p.name(): p.cpu_percent(None) for p in sched}
    info = engine.get_server_info()
    report["kv_cache"] = {k: info.get(k) for k in ("max_total_num_tokens", "max_total_tokens", "mem_fraction_static",
                                                   "max_running_requests", "context_length", "chunked_prefill_size")}

    prompts = [list(range(5, 13)), [40, 41, 42], list(range(100, 120))]
    n_new = args.max_new_tokens

    # 1. greedy vs HF -------------------------------------------------------------------------------
    with step("hf_greedy_reference"):
        ref = [hf_greedy(hf, p, n_new) for p in prompts]
    with step("engine_greedy"):
        outs = engine.generate(input_ids=prompts, return_logprob=True,
                               sampling_params={"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True})
    tok_eq, dmax = True, 0.0
    for (rt, rl), o in zip(ref, outs):
        et, el = engine_tokens_and_logprobs(o)
        tok_eq &= et == rt
        if et == rt:
            dmax = max(dmax, max_abs(el, rl))
    report["host_changes_after_first_request"] = diff_state(after_start, host_state())
    report["output_example"] = {k: (v if k != "meta_info" else {m: v[m] for m in ("finish_reason", "prompt_tokens",
                                "completion_tokens", "cached_tokens", "weight_version")} | {
                                "output_token_logprobs[:2]": v["output_token_logprobs"][:2],
                                "keys": sorted(v)}) for k, v in outs[0].items()}
    report["checks"]["greedy_tokens_equal_hf"] = tok_eq
    report["checks"]["greedy_max_abs_dlogprob"] = dmax
    ok &= tok_eq and dmax <= TOL_GREEDY

    # 2a. n > 1 with temperature / top-p / top-k ------------------------------------------------------
    samp = {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "max_new_tokens": 8, "n": 3, "ignore_eos": True}
    with step("engine_sample_n3"):
        souts = engine.generate(input_ids=prompts[:2], sampling_params=samp, return_logprob=True)
    diffs = {"raw": 0.0, "temperature_scaled": 0.0, "scaled_topk_topp_renormalised": 0.0}
    order_ok = len(souts) == 6
    for j, o in enumerate(souts):
        toks, lps = engine_tokens_and_logprobs(o)
        own = hf_scored(hf, prompts[j // 3], toks, samp["temperature"], samp["top_k"], samp["top_p"])
        other = hf_scored(hf, prompts[1 - j // 3], toks, samp["temperature"], samp["top_k"], samp["top_p"])
        order_ok &= max_abs(lps, own["temperature_scaled"]) < max_abs(lps, other["temperature_scaled"])
        for k in diffs:
            diffs[k] = max(diffs[k], max_abs(lps, own[k]))
    report["checks"]["sampling_n3_outputs"] = len(souts)
    report["checks"]["sampling_order_is_prompt_major"] = order_ok
    report["checks"]["sampling_logprob_max_abs_diff_vs"] = diffs
    report["checks"]["sampling_distinct_samples_per_prompt"] = [
        len({tuple(o["output_ids"]) for o in souts[i * 3:(i + 1) * 3]}) for i in range(2)]

    # 2b. per-request seeds -----------------------------------------------------------------------------
    seeded = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True, "sampling_seed": 123}
    with step("engine_sampling_seed"):
        a = engine.generate(input_ids=prompts[0], sampling_params=seeded)["output_ids"]
        b = engine.generate(input_ids=prompts[0], sampling_params=seeded)["output_ids"]
    report["checks"]["sampling_seed_same_seed_same_tokens"] = a == b
    try:
        sglang.Engine(model_path=str(model_dir), **{**ENGINE_KWARGS, "enable_deterministic_inference": True})
        report["checks"]["deterministic_inference_on_cpu"] = "started (unexpected)"
    except Exception as e:  # noqa: BLE001
        report["checks"]["deterministic_inference_on_cpu"] = f"{type(e).__name__}: {str(e)[:200]}"

    # 2c. stop_token_ids (several) and ignore_eos ------------------------------------------------------
    g = ref[0][0]
    stops = [g[6], g[4]]
    first = min(i for i, t in enumerate(g) if t in stops)
    with step("engine_stop_token_ids"):
        s1 = engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0.0, "max_new_tokens": n_new,
                                                                    "stop_token_ids": stops})
        s2 = engine.generate(input_ids=prompts[0], sampling_params={"temperature": 0.0, "max_new_tokens": n_new,
                                                                    "stop_token_ids": stops, "ignore_eos": True})
    report["checks"]["stop_token_ids"] = {
        "stops": stops, "expected_len_incl_stop": first + 1, "got": s1["output_ids"],
        "finish_reason": s1["meta_info"]["finish_reason"], "ok": s1["output_ids"] == g[: first + 1]}
    report["checks"]["ignore_eos_also_disables_stop_token_ids"] = len(s2["output_ids"]) == n_new

    # 3. weight update ---------------------------------------------------------------------------------
    hf2 = copy.deepcopy(hf)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in hf2.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    named = [(n, p.detach().clone()) for n, p in hf2.named_parameters()]
    with step("update_without_session"):
        r0 = engine.update_weights_from_tensor(named_tensors=named)
    report["checks"]["update_without_begin_weight_update"] = list(r0)
    with step("update_weights_from_tensor"):
        rb = engine.begin_weight_update()
        r1 = engine.update_weights_from_tensor(named_tensors=named, flush_cache=True)
        re_ = engine.end_weight_update()
    report["checks"]["update_results"] = {"begin": list(rb), "update": list(r1), "end": list(re_)}
    report["checks"]["caller_tensor_moved_to_shared_memory"] = bool(named[0][1].is_shared())
    report["checks"]["torch_sharing_strategy"] = torch.multiprocessing.get_sharing_strategy()
    with step("hf_greedy_reference_updated"):
        ref2 = [hf_greedy(hf2, p, n_new) for p in prompts]
    with step("engine_greedy_updated"):
        outs2 = engine.generate(input_ids=prompts, return_logprob=True,
                                sampling_params={"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True})
    tok_eq2, dmax2, dold = True, 0.0, 0.0
    for (rt, rl), (ot, ol), o in zip(ref2, ref, outs2):
        et, el = engine_tokens_and_logprobs(o)
        tok_eq2 &= et == rt
        if et == rt:
            dmax2 = max(dmax2, max_abs(el, rl))
        dold = max(dold, max_abs(el[:1], ol[:1]))
    report["checks"]["updated_greedy_tokens_equal_hf"] = tok_eq2
    report["checks"]["updated_greedy_max_abs_dlogprob"] = dmax2
    report["checks"]["updated_first_logprob_moved_by"] = dold
    ok &= tok_eq2 and dmax2 <= TOL_GREEDY and dold > 1e-3

    # 4. release / resume ------------------------------------------------------------------------------
    def engine_rss():
        return round(sum(r["rss_mb"] for r in children()), 1)

    mem = {"rss_mb_before": engine_rss()}
    try:
        with step("release_memory_occupation"):
            mem["release_result"] = repr(engine.release_memory_occupation())
        mem["rss_mb_released"] = engine_rss()
        with step("resume_memory_occupation"):
            mem["resume_result"] = repr(engine.resume_memory_occupation())
        mem["rss_mb_resumed"] = engine_rss()
        o = engine.generate(input_ids=prompts[0], return_logprob=True,
                            sampling_params={"temperature": 0.0, "max_new_tokens": n_new, "ignore_eos": True})
        et, el = engine_tokens_and_logprobs(o)
        mem["greedy_after_resume_matches"] = et == ref2[0][0] and max_abs(el, ref2[0][1]) <= TOL_GREEDY
    except Exception as e:  # noqa: BLE001
        mem["error"] = f"{type(e).__name__}: {e}"
    report["checks"]["release_resume"] = mem

    # 5. shutdown and what it does to the host --------------------------------------------------------
    with step("engine_shutdown"):
        engine.shutdown()
    time.sleep(0.5)
    left = [r for r in children() if r["pid"] != sentinel.pid]
    report["checks"]["children_left_after_shutdown"] = left
    report["checks"]["host_child_survived_shutdown"] = sentinel.is_alive()
    report["checks"]["host_child_exitcode"] = sentinel.exitcode
    if sentinel.is_alive():
        sentinel.kill()
    sentinel.join(5)
    t = torch.ones(2)
    dist.all_reduce(t)
    report["checks"]["host_gloo_group_works_after_shutdown"] = t.tolist() == [1.0, 1.0]
    report["host_changes_after_shutdown"] = diff_state(before, host_state())
    ok &= not [r for r in left if "resource_tracker" not in r["cmdline"]]

    # 6. a second engine in this process, raw (pre-temperature) log-probs ------------------------------
    if not args.quick:
        os.environ["SGLANG_RETURN_ORIGINAL_LOGPROB"] = "1"  # read by the scheduler subprocess at import
        try:
            with step("engine2_start"):
                e2 = sglang.Engine(model_path=str(model_dir), **ENGINE_KWARGS)
            o = e2.generate(input_ids=prompts[0], return_logprob=True, sampling_params={**samp, "n": 1})
            toks, lps = engine_tokens_and_logprobs(o)
            own = hf_scored(hf, prompts[0], toks, samp["temperature"], samp["top_k"], samp["top_p"])
            report["checks"]["original_logprob_env_max_abs_diff_vs"] = {
                k: max_abs(lps, v) for k, v in own.items()}
            # After the first request the tokenizer manager's event loop owns SIGTERM (and SIGQUIT):
            # does a SIGTERM to the idle host still terminate it?
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.5)
            report["checks"]["host_alive_after_sigterm_while_engine_idle"] = True
            report["checks"]["sigterm_handler_now"] = host_state()["signals"].get("SIGTERM")
            with step("engine2_shutdown"):
                e2.shutdown()
        except Exception as e:  # noqa: BLE001
            report["checks"]["second_engine"] = f"{type(e).__name__}: {e}"
            ok = False
        finally:
            os.environ.pop("SGLANG_RETURN_ORIGINAL_LOGPROB", None)

    dist.destroy_process_group()
    report["ok"] = bool(ok)
    text = json.dumps(report, indent=1, default=str)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text)
    tmp.cleanup()
    print(f"[probe] {'PASS' if ok else 'FAIL'}: greedy max|Δlogprob| {dmax:.2e}, after update {dmax2:.2e}; "
          f"engine start {T['engine_start']:.1f} s", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":  # the engine's subprocesses are spawned: keep the guard
    sys.exit(main())
