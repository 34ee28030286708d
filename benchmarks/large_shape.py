"""One large model shape on one GPU, through the real trainer, beside the planner's prediction (issue 49, item 5).

    python -m benchmarks.large_shape --device cuda                    # both runs below; estimated 3-4 min, never run yet
    python -m benchmarks.large_shape --runs qwen2.5-7b:lora --device cuda
    python -m benchmarks.large_shape --runs tiny:lora tiny:full-offload --device cpu --prompts 2 --n 2 \\
        --response-length 8 --micro 2 --steps 2                       # the CPU dry run, under a minute
    python -m benchmarks.large_shape --shape qwen2.5-3b --mode full-offload --device cuda --out r.json   # one run, here

Runs (``SHAPE:MODE``): ``qwen2.5-7b:lora`` is Qwen2.5-7B's shape, weights in bf16 and frozen, a LoRA
adapter (rank 64, alpha 32, all linear layers: verl's Qwen2.5 GRPO LoRA example) trained in fp32 by
peft; ``qwen2.5-3b:full-offload`` is Qwen2.5-3B's shape fully fine-tuned, fp32 master weights computing
in bf16 (the one-GPU default) with ``fsdp_config.optimizer_offload=true`` (AdamW's moments on the host
between steps). Both GRPO, P prompts × n samples from the arithmetic task, one optimiser step a step, no
KL (``benchmarks/rlfoundry_grpo.py``'s verl keys), ``trainer.worker_backend=local`` (one rank, in this
process). The shapes are the ``config.json`` values Hugging Face publishes for Qwen/Qwen2.5-7B and
Qwen/Qwen2.5-3B (hidden, layers, heads, KV heads, MLP width, vocabulary, tied head; the planner counts
7,615,616,512 parameters for the 7B, its model card's 7.61 B); the tokenizer is the project's byte
tokenizer padded with filler tokens to the vocabulary (``rlfoundry.models.tiny.build_tokenizer``), since
no machine here has Qwen's.

No weight file exists: the model directory holds config.json and the tokenizer only, and the FSDP
engine's ``load_hf_model`` is replaced, in this process only, by ``from_config`` under
``torch.device(<the GPU>)`` in the dtype the engine asks for, seeded: random weights are made on the
device and no host copy of the model is ever built (``from_pretrained`` would read a 15 GB file into
host memory first). The start-up path check's "has *.safetensors" is relaxed to "has config.json" for
the same reason. Everything else (config, planner start-up check, LoRA, offload, rollout, update) is the
code a user's run takes. The rollout's compiled decode is off (``--rollout-compile`` turns it on): its
capture is start-up cost this measurement is not about, and ``bench`` in scripts/gpu_check.sh measures it.

Printed per step: wall time (CUDA synchronised), tokens (the batch's valid prompt + response tokens,
counted from its masks) and tokens/s, the update's and the step's model FLOP utilisation, and peak
memory, each with the planner's prediction (``rlfoundry.plan_cli.plan_args`` on the same overrides,
in-process: ``rlfoundry plan --gpu <preset>``) and measured/predicted. Model FLOPs per token of a forward
are ``benchmarks.realistic.model_costs``: 2 per weight of the layers' linears and the LM head (the
embedding is a lookup; biases and norms left out), plus attention's 4·layers·hidden per context token at
the mean context (half the sequence). A step's FLOPs: a forward over every valid token for the
generation (prefill + decode), one for the old log-probs when that pass runs, and for the update 6 per
weight in full fine-tuning (forward 2, backward 4) or 4 with LoRA (the frozen weights take no weight
gradient: the planner's count), plus attention's 3 forwards either way. MFU is against the bf16 matmul peak measured on
the device (``benchmarks.realistic.machine_peaks``: the faster of an 8192³ product and the model's widest
layer), the datasheet figure printed beside it. Memory: on CUDA ``torch.cuda.max_memory_allocated`` and
``max_memory_reserved`` over the step (reset at its start) against the plan's worst phase (which
includes a 2 GiB runtime allowance the allocator does not see); on the CPU the process's peak RSS so far
(``ru_maxrss``, host memory, never reset) against the CPU plan. Writes ``<results-dir>/<name>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import DEFAULT_WORK_DIR, REPO_ROOT, RESULTS_DIR, Workload, format_table, save_results

# Hugging Face's config.json of Qwen/Qwen2.5-7B and Qwen/Qwen2.5-3B (architecture keys only; both have
# rope_theta 1e6 and rms_norm_eps 1e-6, which change no cost). "tiny": the CPU dry run's model.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=260, tie_word_embeddings=False),  # the byte tokenizer's own 260
}
LORA_RANK, LORA_ALPHA = 64, 32
MODES: dict[str, list[str]] = {
    # the frozen base in bf16 (verl's ref/rollout dtype; an fp32 base would double its 15 GB for nothing)
    "lora": [f"actor_rollout_ref.model.lora_rank={LORA_RANK}", f"actor_rollout_ref.model.lora_alpha={LORA_ALPHA}",
             "actor_rollout_ref.model.target_modules=all-linear", "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16"],
    "full-offload": ["actor_rollout_ref.actor.fsdp_config.optimizer_offload=true"],
}
DEFAULT_RUNS = ["qwen2.5-7b:lora", "qwen2.5-3b:full-offload"]
UPDATE_FLOPS_PER_WEIGHT = {"lora": 4, "full-offload": 6}  # the planner's (rlfoundry/plan/timing.py)


def model_config(shape: str, layers: int | None = None, hidden: int | None = None) -> dict[str, Any]:
    """The shape's config keys, with ``--layers`` / ``--hidden`` replacing its own (MLP width scales with hidden)."""
    keys = dict(SHAPES[shape])
    if layers:
        keys["num_hidden_layers"] = layers
    if hidden:
        keys["intermediate_size"] = keys["intermediate_size"] * hidden // keys["hidden_size"]
        keys["hidden_size"] = hidden
    return keys


def write_model_dir(shape: str, keys: dict[str, Any], work_dir: Path) -> Path:
    """config.json + the byte tokenizer padded to the vocabulary; no weights (they are made on the device)."""
    out = work_dir / "models" / f"{shape}-l{keys['num_hidden_layers']}-h{keys['hidden_size']}"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoConfig

    from rlfoundry.models.tiny import BOS_TOKEN, build_tokenizer

    tok = build_tokenizer(vocab_size=keys["vocab_size"])
    config = AutoConfig.for_model("qwen2", **keys,
                                  max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                                  pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                                  bos_token_id=tok.convert_tokens_to_ids(BOS_TOKEN))
    tmp = out.with_name(out.name + ".tmp")
    config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    tmp.rename(out)  # complete or absent
    return out


@contextlib.contextmanager
def weights_made_on_device(device: str, seed: int) -> Iterator[None]:
    """The FSDP engine's model loader builds the model from its config.json on ``device`` with seeded random
    weights (no file, no host copy); the start-up check accepts a directory without weight files."""
    import torch

    from rlfoundry.engines.fsdp import engine as fsdp_engine
    from rlfoundry.models.hf import check_model_dir, resolve_dtype
    from rlfoundry.trainer import config as trainer_config

    def load(path, model_kind="causal_lm", torch_dtype=torch.float32, trust_remote_code=False, override_config=None,
             enable_gradient_checkpointing=False, attn_implementation=None):
        from transformers import AutoConfig, AutoModelForCausalLM

        if model_kind != "causal_lm":
            raise ValueError(f"benchmarks.large_shape makes causal LMs only, not {model_kind}")
        config = AutoConfig.from_pretrained(check_model_dir(path))
        for key, value in dict(override_config or {}).items():
            setattr(config, key, value)
        torch.manual_seed(seed)  # seeds the CUDA generators too
        target = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
        with target:
            model = AutoModelForCausalLM.from_config(config, dtype=resolve_dtype(torch_dtype),
                                                     attn_implementation=attn_implementation)
        if enable_gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False  # as load_hf_model: the rollout asks for its cache explicitly
        return model

    saved = fsdp_engine.load_hf_model, trainer_config.is_hf_model_dir
    fsdp_engine.load_hf_model = load
    trainer_config.is_hf_model_dir = lambda p: (Path(p) / "config.json").is_file()
    try:
        yield
    finally:
        fsdp_engine.load_hf_model, trainer_config.is_hf_model_dir = saved


def overrides(a: argparse.Namespace, model_dir: Path, work_dir: Path) -> list[str]:
    """The run's key=value overrides: the benchmarks' GRPO verl keys, one local rank, the mode's keys."""
    from benchmarks.common import prepare_in_process
    from benchmarks.rlfoundry_grpo import verl_keys

    w = Workload(model_path=str(model_dir), prompts_per_step=a.prompts, n=a.n, max_prompt_length=a.prompt_length,
                 max_response_length=a.response_length, steps=a.steps, warmup_steps=a.warmup, device=a.device,
                 rlfoundry_workers=1)
    prepared = prepare_in_process(w, work_dir)
    return [*verl_keys(w, prepared, work_dir / f"run-{a.shape}-{a.mode}", a.micro), *MODES[a.mode],
            "trainer.worker_backend=local",
            f"actor_rollout_ref.rollout.use_torch_compile={'true' if a.rollout_compile else 'false'}", *a.override]


def plan_hardware(device: str):
    """The planner's hardware for the device in use: the H200/H100 preset where the name says so (as
    ``rlfoundry plan --gpu``), else the visible device's memory; on the CPU the host's memory."""
    from rlfoundry.plan.hardware import PRESETS, cpu_hardware
    from rlfoundry.plan.startup import visible_hardware

    if device != "cuda":
        return cpu_hardware()
    import torch

    name = torch.cuda.get_device_name()
    preset = next((PRESETS[k] for k, tag in (("h200-141g", "H200"), ("h100-80g", "H100")) if tag in name), None)
    return preset or visible_hardware("cuda")


def predict(cli: list[str], device: str) -> dict[str, Any]:
    """The planner on the same overrides: its worst phase's memory (and breakdown) and its phase times."""
    from rlfoundry.plan_cli import plan_args

    hw = plan_hardware(device)
    plan = plan_args(cli, hw)
    _, phase = plan.worst
    return {"hardware": hw.name, "tflops": hw.tflops, "fits": plan.fits, "peak_phase": phase.name,
            "peak_bytes": phase.total, "peak_breakdown": dict(phase.device), "times_s": dict(plan.times),
            "params_total": plan.layout["params_total"], "mfu_assumed": _assumed_mfu(plan.assumptions)}


def _assumed_mfu(assumptions: list[str]) -> str:
    return next((a for a in assumptions if a.startswith("training and prefill matmuls")), "")


def step_flops(costs: dict[str, float], tokens: int, samples: int, phases: dict[str, float], mode: str) -> dict[str, float]:
    """Model FLOPs of one step's phases from its valid tokens (see the module docstring)."""
    context = tokens / samples / 2  # mean position of a token in its sequence
    attention = costs["attention_flops_per_token_per_context"] * context
    forward = tokens * (costs["flops_per_token"] + attention)
    weights = costs["flops_per_token"] / 2
    out = {"gen": forward, "update_actor": tokens * (UPDATE_FLOPS_PER_WEIGHT[mode] * weights + 3 * attention)}
    for name in ("old_log_prob", "ref"):
        if name in phases:
            out[name] = forward
    return out


class StepMeter:
    """Wraps ``PPOTrainer.train_step`` / ``train_on`` in this process: wall time, the batch's token counts,
    the trainer's phase times and the step's peak memory."""

    def __init__(self, device: str, on_step: Callable[[dict[str, Any]], None]):
        self.device, self.on_step, self._tokens = device, on_step, {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        from rlfoundry.trainer.ppo.ray_trainer import PPOTrainer

        step, on = PPOTrainer.train_step, PPOTrainer.train_on
        meter = self

        def train_on(trainer, batch, timing):
            b = batch.batch
            meter._tokens = {"samples": int(b["response_mask"].shape[0]), "tokens": int(b["attention_mask"].sum()),
                             "response_tokens": int(b["response_mask"].sum())}
            return on(trainer, batch, timing)

        def train_step(trainer, *args, **kwargs):
            meter._sync(reset=True)
            start = time.perf_counter()
            metrics = step(trainer, *args, **kwargs)
            meter._sync()
            meter.on_step({"step_s": time.perf_counter() - start, **meter._tokens, **meter._memory(),
                           "phases_s": {k.split("/", 1)[1]: float(v) for k, v in metrics.items()
                                        if k.startswith("timing_s/")},
                           "response_length_mean": float(metrics["response_length/mean"])})
            return metrics

        PPOTrainer.train_step, PPOTrainer.train_on = train_step, train_on
        try:
            yield
        finally:
            PPOTrainer.train_step, PPOTrainer.train_on = step, on

    def _sync(self, reset: bool = False) -> None:
        if self.device == "cuda":
            import torch

            torch.cuda.synchronize()
            if reset:
                torch.cuda.reset_peak_memory_stats()

    def _memory(self) -> dict[str, Any]:
        if self.device == "cuda":
            import torch

            return {"memory_source": "cuda max_memory_allocated/reserved over the step",
                    "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
                    "peak_reserved_bytes": torch.cuda.max_memory_reserved()}
        import resource

        return {"memory_source": "host: this process's peak RSS so far (ru_maxrss)",
                "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}


def figures(step: dict[str, Any], costs: dict[str, float], peak_gflops: float, plan: dict[str, Any],
            mode: str) -> dict[str, Any]:
    """One step's throughput, MFU and memory, each beside the plan: measured/predicted ratios."""
    phases = step["phases_s"]
    flops = step_flops(costs, step["tokens"], step["samples"], phases, mode)
    peak = peak_gflops * 1e9
    out = {"tokens_per_s": step["tokens"] / step["step_s"], "response_tokens_per_s": step["response_tokens"] / step["step_s"],
           "model_tflop": sum(flops.values()) / 1e12, "mfu_step": sum(flops.values()) / step["step_s"] / peak,
           "step_vs_plan": step["step_s"] / plan["times_s"]["step"]}
    if phases.get("update_actor"):
        out["mfu_update"] = flops["update_actor"] / phases["update_actor"] / peak
        out["mfu_update_datasheet"] = flops["update_actor"] / phases["update_actor"] / (plan["tflops"] * 1e12)
        out["update_vs_plan"] = phases["update_actor"] / plan["times_s"]["update_actor"]
    measured = step.get("peak_reserved_bytes") or step.get("peak_rss_bytes")
    out["memory_vs_plan"] = measured / plan["peak_bytes"]
    return out


def run_one(a: argparse.Namespace) -> dict[str, Any]:
    """One shape and mode through ``main_ppo.main``, in this process. Each step is printed and, with
    ``--out``, saved as it ends: a run stopped by its time limit keeps the steps it finished."""
    import torch

    from benchmarks.realistic import model_costs
    from rlfoundry.trainer import main_ppo

    torch.set_num_threads(a.threads)
    work = Path(a.work_dir)
    keys = model_config(a.shape, a.layers, a.hidden)
    model_dir = write_model_dir(a.shape, keys, work)
    cli = overrides(a, model_dir, work)
    peak_gflops = a.peak_gflops or _measure_peak(a, keys)  # before this process touches the GPU
    result = {"shape": a.shape, "mode": a.mode, "device": a.device, "model_config": keys, "overrides": cli,
              "costs": model_costs(str(model_dir), bytes_per_weight=2), "peak_gflops": peak_gflops,
              "warmup": a.warmup, "steps": []}

    def on_step(step: dict[str, Any]) -> None:
        result["steps"].append({**step, **figures(step, result["costs"], peak_gflops, result["plan"], a.mode)})
        print(step_line(len(result["steps"]), result["steps"][-1], result), flush=True)
        if a.out:
            a.out.write_text(json.dumps(result, indent=1) + "\n")

    with weights_made_on_device(a.device, a.seed):
        result["plan"] = predict(cli, a.device)
        if a.device == "cuda":
            result["device_name"] = torch.cuda.get_device_name()
        print(header(result), flush=True)
        with StepMeter(a.device, on_step).installed():
            code = main_ppo.main(cli)
    if code != 0:
        raise SystemExit(f"the trainer exited {code}")
    result["summary"] = summarise(result["steps"][a.warmup:] or result["steps"], result["plan"])
    if a.out:
        a.out.write_text(json.dumps(result, indent=1) + "\n")
    return result


def _measure_peak(a: argparse.Namespace, keys: dict[str, Any]) -> float:
    from benchmarks.realistic import machine_peaks

    w = Workload(hidden_size=keys["hidden_size"], intermediate_size=keys["intermediate_size"], device=a.device,
                 threads=a.threads, steps=2)
    return float(machine_peaks(w, a.threads)["matmul_gflops"])


def summarise(steps: list[dict[str, Any]], plan: dict[str, Any]) -> dict[str, Any]:
    """Medians over the measured steps (after the warm-up); memory: the largest step's."""
    def med(key):
        values = [s[key] for s in steps if s.get(key) is not None]
        return statistics.median(values) if values else None

    mem = max((s.get("peak_reserved_bytes") or s.get("peak_rss_bytes") or 0) for s in steps)
    return {"steps": len(steps), "step_s": med("step_s"), "tokens_per_s": med("tokens_per_s"),
            "response_tokens_per_s": med("response_tokens_per_s"), "mfu_update": med("mfu_update"),
            "mfu_step": med("mfu_step"), "update_vs_plan": med("update_vs_plan"), "step_vs_plan": med("step_vs_plan"),
            "peak_allocated_bytes": max((s.get("peak_allocated_bytes") or 0) for s in steps) or None,
            "peak_memory_bytes": mem, "memory_source": steps[0]["memory_source"],
            "plan_peak_bytes": plan["peak_bytes"], "memory_vs_plan": mem / plan["peak_bytes"]}


def _gib(n: float | None) -> str:
    return "-" if not n else f"{n / 2**30:.2f} GiB"


def header(r: dict[str, Any]) -> str:
    plan = r["plan"]
    return (f"\n== {r['shape']} {r['mode']} on {r.get('device_name', r['device'])}: {plan['params_total']:,} parameters, "
            f"{r['costs']['flops_per_token']:,.0f} FLOP/token forward; peak {r['peak_gflops'] / 1e3:.3g} TFLOP/s measured, "
            f"{plan['tflops']:g} datasheet\nplan ({plan['hardware']}): peak {_gib(plan['peak_bytes'])} in "
            f"'{plan['peak_phase']}', step {plan['times_s']['step']:.3g} s ({plan['mfu_assumed']})")


def step_line(i: int, s: dict[str, Any], r: dict[str, Any]) -> str:
    plan = r["plan"]
    ph, times = s["phases_s"], plan["times_s"]
    mem = (f"peak allocated {_gib(s['peak_allocated_bytes'])}, reserved {_gib(s['peak_reserved_bytes'])}"
           if "peak_reserved_bytes" in s else f"host peak RSS {_gib(s['peak_rss_bytes'])}")
    update = (f"update {ph['update_actor']:.2f} s (plan {times['update_actor']:.3g} s, {s['update_vs_plan']:.3g}x), "
              f"MFU update {s['mfu_update']:.1%}, " if "mfu_update" in s else "")
    return (f"step {i}{' (warm-up)' if i <= r['warmup'] else ''}: {s['step_s']:.2f} s (plan {times['step']:.3g} s, "
            f"{s['step_vs_plan']:.3g}x) | {s['tokens']:,} tokens ({s['response_tokens']:,} generated) "
            f"{s['tokens_per_s']:,.0f} tok/s | {update}step {s['mfu_step']:.1%} | {mem} (plan {_gib(plan['peak_bytes'])} "
            f"in '{plan['peak_phase']}', {s['memory_vs_plan']:.2f}x)")


SUMMARY_COLUMNS = [("run", "run", ""), ("s/step", "step_s", ".2f"), ("step/plan", "step_vs_plan", ".2f"),
                   ("tok/s", "tokens_per_s", ",.0f"), ("gen tok/s", "response_tokens_per_s", ",.0f"),
                   ("MFU update", "mfu_update", ".1%"), ("MFU step", "mfu_step", ".1%"),
                   ("update/plan", "update_vs_plan", ".2f"), ("peak GiB", "peak_gib", ".2f"),
                   ("plan GiB", "plan_gib", ".2f"), ("mem/plan", "memory_vs_plan", ".2f")]


def run_children(a: argparse.Namespace) -> dict[str, Any]:
    """Each ``SHAPE:MODE`` of ``--runs`` in a process of its own (its GPU memory its own), under ``--timeout``."""
    peak = a.peak_gflops or _measure_peak(a, model_config(a.runs[0].split(":")[0], a.layers, a.hidden))
    results = []
    for run in a.runs:
        shape, mode = run.split(":")
        out = Path(a.work_dir) / f"large-{shape}-{mode}.json"
        out.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "benchmarks.large_shape", "--shape", shape, "--mode", mode, "--out", str(out),
               "--peak-gflops", str(peak), *_shared_argv(a)]
        print(f"\n-- {run}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)}
        try:
            code = subprocess.run(cmd, cwd=str(REPO_ROOT), env=env, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        partial = json.loads(out.read_text()) if out.is_file() else {}  # the steps it finished, if it stopped
        results.append({**partial, "run": run, "wall_s": time.time() - t0})
        if code != 0 or "summary" not in partial:
            results[-1]["error"] = (f"exit {code} after {time.time() - t0:.0f} s, {len(partial.get('steps', []))} "
                                    "steps done (its output is above)")
    return {"peak_gflops": peak, "results": results}


def _shared_argv(a: argparse.Namespace) -> list[str]:
    argv = ["--device", a.device, "--prompts", str(a.prompts), "--n", str(a.n), "--prompt-length", str(a.prompt_length),
            "--response-length", str(a.response_length), "--micro", str(a.micro), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--threads", str(a.threads), "--seed", str(a.seed), "--work-dir", str(a.work_dir)]
    argv += [x for flag, v in (("--layers", a.layers), ("--hidden", a.hidden)) if v for x in (flag, str(v))]
    argv += ["--rollout-compile"] if a.rollout_compile else []
    return argv + [x for o in a.override for x in ("--override", o)]


def summary_rows(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for r in results:
        s = r.get("summary", {})
        rows.append({"run": r["run"], **s, "peak_gib": (s.get("peak_memory_bytes") or 0) / 2**30 or None,
                     "plan_gib": (s.get("plan_peak_bytes") or 0) / 2**30 or None})
    return rows


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="SHAPE:MODE",
                   help=f"each in a child process; shapes {sorted(SHAPES)}, modes {sorted(MODES)}")
    p.add_argument("--shape", choices=sorted(SHAPES), help="with --mode: one run in this process (what a child does)")
    p.add_argument("--mode", choices=sorted(MODES))
    p.add_argument("--layers", type=int, help="replace the shape's layer count")
    p.add_argument("--hidden", type=int, help="replace the shape's hidden size (the MLP width scales with it)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--n", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompt-length", type=int, default=64)
    p.add_argument("--response-length", type=int, default=128)
    p.add_argument("--micro", type=int, default=8, help="rows per micro-batch (update and log-probs)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out of the summary (still printed)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0, help="of the random weights")
    p.add_argument("--rollout-compile", action="store_true", help="the rollout's compiled (CUDA-graphed) decode")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE", help="extra trainer override")
    p.add_argument("--peak-gflops", type=float, help="the device's matmul peak (default: measured)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per child run")
    p.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR / "large")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--name", default=None, help="result file name (default large_<device>)")
    p.add_argument("--out", type=Path, help="with --shape/--mode: write the run's JSON here")
    return p


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    a = parser().parse_args(argv)
    if a.steps <= a.warmup:
        raise SystemExit(f"--steps ({a.steps}) must exceed --warmup ({a.warmup}): nothing would be measured")
    if a.shape or a.mode:
        if not (a.shape and a.mode):
            raise SystemExit("--shape and --mode go together")
        return run_one(a)
    bad = [r for r in a.runs if r.count(":") != 1 or r.split(":")[0] not in SHAPES or r.split(":")[1] not in MODES]
    if bad:
        raise SystemExit(f"--runs {bad}: SHAPE:MODE with SHAPE in {sorted(SHAPES)} and MODE in {sorted(MODES)}")
    out = run_children(a)
    print("\n== summary (medians after the warm-up; memory: the largest step's, "
          f"{'CUDA reserved' if a.device == 'cuda' else 'host peak RSS'}, against the plan's worst phase)")
    print(format_table(summary_rows(out["results"]), SUMMARY_COLUMNS))
    for r in out["results"]:
        if "error" in r:
            print(f"  {r['run']} FAILED: {r['error']}")
    path = save_results(a.name or f"large_{a.device}", out, a.results_dir)
    print(f"\nsaved {path}")
    return {**out, "path": str(path)}


if __name__ == "__main__":
    main()
