"""rlfoundry vs TRL at a realistic layer shape, each phase against what this machine can do.

    python -m benchmarks.realistic                                   # 8 layers; responses 32 and 128
    python -m benchmarks.realistic --num-layers 24 --response-lengths 32 --repeats 1
    python -m benchmarks.realistic --rlfoundry-keys tuned            # with the runner's speed keys
    python -m benchmarks.realistic --device cuda --layers 24         # one GPU, bf16 compute
    python -m benchmarks.realistic --shape qwen2.5-0.5b-vocab --layers 24   # + the real 151,936 vocabulary

The model has Qwen2.5-0.5B's layer shape (hidden 896, MLP 4864, 14 heads, 2 KV heads; the project's
byte tokenizer, so the vocabulary is small and the layers are the cost; ``--shape qwen2.5-0.5b-vocab``
adds its 151,936-token vocabulary and tied LM head, the byte tokenizer padded with filler tokens, so
the log-softmax over the vocabulary weighs as in the real model), random weights, fp32
(``--device cuda``: fp32 master weights computing in bf16 on one GPU, for both frameworks).
GRPO, ``--prompts-per-step`` × ``--n`` samples, one optimiser step per step, the same workload for
both frameworks (``benchmarks/common.py``). By default rlfoundry gets only the keys a verl user
would write (``--rlfoundry-keys verl``, one worker): its defaults are what is measured.

In the same run, before the frameworks, a child process with the same thread count measures the
machine: the fp32 matrix-product peak (the faster of torch's default path and oneDNN, at the
model's widest layer and 512 rows) and the memory read bandwidth (summing a 1 GiB tensor); with
``--device cuda`` the GPU's bf16 matrix-product peak (the faster of an 8192³ product and the model's
widest layer at 512 rows, CUDA-event timed) and its memory read bandwidth (summing 1 GiB of bf16),
and a decode step reads 2 bytes per weight instead of 4. Then per
phase: time; for the actor update (forward + backward: 3 × the forward's FLOPs, counted over the
valid tokens) its achieved FLOP/s as a fraction of that peak; for generation, tokens/s against the
roofline bound (each decode step reads every weight once and does 2 FLOPs per weight and token,
so it takes at least max(weight bytes / bandwidth, FLOPs / peak)); peak tree memory (PSS).
With ``--hf-static-generate``, after the frameworks, transformers' own ``generate`` with its static
cache (compiled on CUDA by transformers itself) samples the same step's rows on the same model (bf16 on
CUDA), timed after a first call that pays the compile: issue 34's reference for the decode, reported
as seconds per call and per token step beside rlfoundry's generation phase.
Writes ``benchmarks/results/<name>.json``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks.common import (
    REPO_ROOT,
    _child_env,
    MISMATCH_COLUMNS,
    add_workload_args,
    format_table,
    interleaved_runs,
    median_row,
    paired_ratios,
    prepare,
    save_results,
    workload_from_args,
)

_PEAKS_CODE = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[1]))
k, n = int(sys.argv[2]), int(sys.argv[3])
x, w = torch.randn(512, k), torch.randn(n, k)
def best(fn, reps=12):
    for _ in range(3): fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
flops = 2 * 512 * k * n
paths = {"mkl": lambda: torch.nn.functional.linear(x, w)}
if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"):
    paths["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
gflops = {name: flops / best(fn) / 1e9 for name, fn in paths.items()}
big = torch.ones(2**28)  # 1 GiB of fp32
read = 4 * big.numel() / best(lambda: big.sum(), reps=8) / 1e9
print(json.dumps({"matmul_gflops": max(gflops.values()), "matmul_gflops_by_path": gflops, "read_gb_s": read}))
"""


_CUDA_PEAKS_CODE = r"""
import json, sys, torch
k, n = int(sys.argv[2]), int(sys.argv[3])
dev, bf16 = torch.device("cuda"), torch.bfloat16
def best(fn, reps=10):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(); fn(); stop.record(); stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return min(times)
gflops = {}
for name, (m, kk, nn) in {"bf16_model_layer_512_rows": (512, k, n), "bf16_8192": (8192, 8192, 8192)}.items():
    x, w = torch.randn(m, kk, device=dev, dtype=bf16), torch.randn(nn, kk, device=dev, dtype=bf16)
    gflops[name] = 2 * m * kk * nn / best(lambda: torch.nn.functional.linear(x, w)) / 1e9
    del x, w
big = torch.ones(2**29, device=dev, dtype=bf16)  # 1 GiB of bf16
read = 2 * big.numel() / best(lambda: big.sum()) / 1e9
print(json.dumps({"device": "cuda", "device_name": torch.cuda.get_device_name(), "dtype": "bf16",
                  "torch": torch.__version__, "matmul_gflops": max(gflops.values()),
                  "matmul_gflops_by_path": gflops, "read_gb_s": read}))
"""


_HF_GENERATE_CODE = r"""
import json, statistics, sys, time, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, device, n, new_tokens, repeats, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
torch.set_num_threads(threads)
prompts = [m for m in json.loads(sys.stdin.read()) for _ in range(n)]  # each prompt's n samples, as GRPO's step
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"
dtype = torch.bfloat16 if device == "cuda" else torch.float32  # what rlfoundry decodes in on that device
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
enc = tok.apply_chat_template(prompts, add_generation_prompt=True, padding=True, return_tensors="pt",
                              return_dict=True).to(device)
def sync():
    if device == "cuda":
        torch.cuda.synchronize()
def call():
    sync(); start = time.perf_counter()
    out = model.generate(**enc, do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=new_tokens,
                         cache_implementation="static", pad_token_id=tok.pad_token_id)
    sync()
    return time.perf_counter() - start, out.shape[1] - enc["input_ids"].shape[1]
first, _ = call()  # transformers compiles the static-cache decode step here (on CUDA)
calls = [call() for _ in range(repeats)]
gen = statistics.median(t for t, _ in calls)
steps = statistics.median(k for _, k in calls)
print(json.dumps({"rows": len(prompts), "first_call_s": first, "gen_s": gen, "steps": steps,
                  "ms_per_step": 1e3 * gen / max(steps, 1), "calls_s": [t for t, _ in calls]}))
"""


def hf_static_generate(w, prepared, threads: int, repeats: int = 3) -> dict[str, Any]:
    """transformers' ``generate`` with its static cache on the step's rows (``w.prompts_per_step``
    prompts × ``w.n``), in a child process on ``w.device``: the first call (compile included) and the
    median of ``repeats`` later ones, per call and per token step."""
    from benchmarks.common import load_prompts

    prompts = [m for m, _ in load_prompts(prepared.train_file)[: w.prompts_per_step]]
    args = [prepared.model_dir, w.device, w.n, w.max_response_length, repeats, threads]
    out = subprocess.run([sys.executable, "-c", _HF_GENERATE_CODE, *map(str, args)], input=json.dumps(prompts),
                         cwd=str(REPO_ROOT), env=_child_env(w, "trl"), capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": f"exit {out.returncode}: {out.stderr[-2000:]}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def versus_hf_generate(rows: list[dict[str, Any]], hf: dict[str, Any], w) -> dict[str, Any]:
    """rlfoundry's generation phase against transformers' static-cache ``generate`` on the same rows: the
    ratio of whole-call times (< 1: rlfoundry faster) and each one's time per token step (rlfoundry's
    batch decodes until its longest sample ends, bounded by the response length: taken as that)."""
    ours = next((r.get("gen_s") for r in rows if r.get("framework") == "rlfoundry"), None)
    if "error" in hf or not ours:
        return {}
    return {"rlfoundry_gen_s": ours, "hf_static_gen_s": hf["gen_s"], "rlfoundry/hf_static gen time": ours / hf["gen_s"],
            "rlfoundry_ms_per_step": 1e3 * ours / w.max_response_length, "hf_static_ms_per_step": hf["ms_per_step"]}


def machine_peaks(w, threads: int) -> dict[str, Any]:
    """GEMM peak (GFLOP/s) and read bandwidth (GB/s) of ``w.device``, in a child process: on the CPU
    fp32 with ``threads`` threads, on CUDA bf16 on the GPU."""
    widest = w.intermediate_size or 2 * w.hidden_size
    env = _child_env(w, "trl")  # one process with all the workload's threads
    code = _CUDA_PEAKS_CODE if w.device == "cuda" else _PEAKS_CODE
    out = subprocess.run([sys.executable, "-c", code, str(threads), str(w.hidden_size), str(widest)],
                         cwd=str(REPO_ROOT), env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"measuring the {w.device} peaks failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    peaks.setdefault("device", "cpu")
    peaks.setdefault("dtype", "fp32")
    return peaks


def model_costs(model_dir: str, bytes_per_weight: int = 4) -> dict[str, float]:
    """FLOPs per token of one forward (2 per weight of the layers and head, plus attention's per
    context token) and the bytes a decode step reads (every weight once: 4 bytes in fp32, 2 in bf16)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_dir)
    head_dim = c.hidden_size // c.num_attention_heads
    kv = c.num_key_value_heads * head_dim
    per_layer = c.hidden_size * (2 * c.hidden_size + 2 * kv) + 3 * c.hidden_size * c.intermediate_size
    weights = c.num_hidden_layers * per_layer + c.hidden_size * c.vocab_size  # the embedding is a lookup
    return {"weights": float(weights), "flops_per_token": 2.0 * weights,
            "attention_flops_per_token_per_context": 4.0 * c.num_hidden_layers * c.hidden_size,
            "decode_bytes_per_step": float(bytes_per_weight) * weights}


def _prompt_tokens(train_file: str, model_dir: str, per_step: int) -> float:
    """Mean chat-templated prompt length in tokens (what every framework feeds the model)."""
    from transformers import AutoTokenizer

    from benchmarks.common import load_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    rows = load_prompts(train_file)[:per_step]
    lengths = [len(_token_ids(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True))) for m, _ in rows]
    return sum(lengths) / len(lengths)


def _token_ids(encoded: Any) -> list[int]:
    """The ids of one tokenized prompt: transformers 5's ``apply_chat_template(tokenize=True)`` returns
    a ``BatchEncoding`` (a dict; its ``len()`` is its number of keys, 2), older versions the id list."""
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def phase_efficiency(median: dict[str, Any], w, costs: dict[str, float], peaks: dict[str, Any],
                     prompt_len: float) -> dict[str, Any]:
    """Actor-update FLOP/s / peak and generation time bound / time, from a framework's medians."""
    phases = median.get("phases_s", {})
    samples = w.samples_per_step
    resp = median["gen_tokens_per_step"] / samples  # mean generated tokens per sample
    seq = prompt_len + resp
    attention = costs["attention_flops_per_token_per_context"] * seq / 2  # mean context: half the sequence
    forward = samples * seq * (costs["flops_per_token"] + attention)
    peak = peaks["matmul_gflops"] * 1e9
    out: dict[str, Any] = {"forward_tflop": forward / 1e12}
    update = phases.get("update_actor")
    if update:
        out["update_frac_of_peak"] = 3 * forward / update / peak
    gen = phases.get("gen")
    if gen:
        steps = w.max_response_length  # the batch decodes until its longest sample ends (bounded by this)
        flops = forward  # prefill + decode: one forward's worth of token positions
        bound = max(costs["decode_bytes_per_step"] * steps / (peaks["read_gb_s"] * 1e9), flops / peak)
        out["gen_bound_s"] = bound
        out["gen_frac_of_bound"] = bound / gen
    return out


COLUMNS = [("framework", "framework", ""), ("s/step", "step_s", ".2f"), ("samples/s", "samples_per_s", ".2f"),
           ("gen s", "gen_s", ".2f"), ("gen/bound", "gen_frac_of_bound", ".0%"), ("old_lp s", "old_s", ".2f"),
           ("update s", "update_s", ".2f"), ("update/peak", "update_frac_of_peak", ".0%"),
           ("tree PSS MB", "peak_tree_pss_mb", ".0f"), *MISMATCH_COLUMNS]
GPU_COLUMNS = [("GPU peak MB", "peak_gpu_mb", ".0f")]  # --device cuda: torch's peak allocation, rank 0


def compare(a: argparse.Namespace, layers: int, response_length: int, peaks: dict[str, Any]) -> dict[str, Any]:
    w = workload_from_args(a, num_layers=layers, max_response_length=response_length)
    prepared = prepare(w, a.work_dir)
    costs = model_costs(prepared.model_dir, bytes_per_weight=2 if w.device == "cuda" else 4)
    prompt_len = _prompt_tokens(prepared.train_file, prepared.model_dir, w.prompts_per_step)
    runs = interleaved_runs(a.frameworks, w, prepared, a.repeats, a.work_dir / "runs",
                            label=f"l{layers}-len{response_length}", timeout_s=a.timeout)
    rows = []
    for fw, fw_runs in runs.items():
        m = median_row(fw_runs)
        if "error" in m:
            rows.append({"framework": fw, "error": m["error"]})
            continue
        ph = m.get("phases_s", {})
        rows.append({"framework": fw, **m, **phase_efficiency(m, w, costs, peaks, prompt_len),
                     "gen_s": ph.get("gen"), "old_s": ph.get("old_log_prob"), "update_s": ph.get("update_actor")})
    ratios = {}
    if "rlfoundry" in runs and "trl" in runs:
        for key in ("samples_per_s", "peak_tree_pss_mb"):
            ratios[f"rlfoundry/trl {key}"] = paired_ratios(runs["rlfoundry"], runs["trl"], key)
    out = {"workload": w.to_json(), "costs": costs, "prompt_tokens": prompt_len, "rows": rows, "ratios": ratios,
           "runs": runs}
    if a.hf_static_generate:  # after the frameworks, so that it never shares the machine with them
        hf = hf_static_generate(w, prepared, a.threads)
        out["hf_static_generate"] = {**hf, **versus_hf_generate(rows, hf, w)}
    return out


def print_result(result: dict[str, Any]) -> None:
    w = result["workload"]
    print(f"\n== {w['num_layers']} layers, response length {w['max_response_length']}: {w['prompts_per_step']} "
          f"prompts x n={w['n']}, rlfoundry keys: {w['rlfoundry_keys']}, {w['threads']} threads, "
          f"{w.get('device', 'cpu')}, vocabulary {w.get('vocab_size') or 'bytes'}; "
          f"forward {result['rows'][0].get('forward_tflop', 0):.3f} TFLOP/step")
    columns = COLUMNS + (GPU_COLUMNS if w.get("device") == "cuda" else [])
    print(format_table([r for r in result["rows"] if "error" not in r], columns))
    for r in result["rows"]:
        if "error" in r:
            print(f"  {r['framework']} FAILED: {r['error'][:1500]}")
    for name, r in result["ratios"].items():
        if r:
            print(f"  {name}: {r['median']:.2f}x  [per-round {', '.join(f'{x:.2f}' for x in r['per_repeat'])}]")
    hf = result.get("hf_static_generate")
    if hf and "error" in hf:
        print(f"  transformers static-cache generate FAILED: {hf['error'][:1500]}")
    elif hf:
        mine = (f"; rlfoundry's generation {hf['rlfoundry_gen_s']:.2f} s ({hf['rlfoundry_ms_per_step']:.2f} ms/step), "
                f"{hf['rlfoundry/hf_static gen time']:.2f}x its time") if "rlfoundry_gen_s" in hf else ""
        print(f"  transformers static-cache generate, {hf['rows']} rows: {hf['gen_s']:.2f} s a call "
              f"({hf['ms_per_step']:.2f} ms/step over {hf['steps']:.0f} steps; first call {hf['first_call_s']:.1f} s){mine}")


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, nargs="+", default=[8], help="decoder layers (the model is built per count)")
    p.add_argument("--response-lengths", type=int, nargs="+", default=[32, 128])
    p.add_argument("--frameworks", nargs="+", default=["rlfoundry", "trl"], choices=["rlfoundry", "trl"])
    p.add_argument("--name", default="realistic")
    p.add_argument("--hf-static-generate", action="store_true",
                   help="also time transformers' generate with its static cache on the same rows (issue 34)")
    add_workload_args(p)
    p.set_defaults(shape="qwen2.5-0.5b", prompts_per_step=4, n=4, steps=3, repeats=2, rlfoundry_keys="verl",
                   rlfoundry_workers=1)
    a = p.parse_args(argv)
    peaks = machine_peaks(workload_from_args(a), a.threads)
    where = f"{peaks['device_name']}, " if peaks.get("device_name") else ""
    print(f"machine: {where}{peaks['dtype']} matmul {peaks['matmul_gflops']:.0f} GFLOP/s "
          f"({', '.join(f'{k} {v:.0f}' for k, v in peaks['matmul_gflops_by_path'].items())}), "
          f"read {peaks['read_gb_s']:.1f} GB/s ({a.threads} threads)", flush=True)
    results = [compare(a, layers, length, peaks) for layers in a.layers for length in a.response_lengths]
    for result in results:
        print_result(result)
    path = save_results(a.name, {"peaks": peaks, "results": results}, a.results_dir)
    print(f"\nsaved {path}")
    return {"results": results, "path": str(path)}


if __name__ == "__main__":
    main()
