"""Peak memory of the actor's log-probs and update with and without ``model.use_fused_kernels``.

    python -m benchmarks.fused_kernels_memory                      # Qwen2.5-0.5B's shape, 2 layers, 151,936 vocab
    python -m benchmarks.fused_kernels_memory --rows 8 --response-length 512 --layers 4

The model has Qwen2.5-0.5B's layer shape and real vocabulary with its tied LM head
(``benchmarks/common.py``'s ``qwen2.5-0.5b-vocab``; random weights, fp32 on the CPU), so the head's
(tokens, 151,936) logits, not the layers, decide the memory. Each variant runs in a fresh process on
the FSDP engine (padded forward, ``cpu_kernels`` off): build, then ``compute_log_prob`` (log-probs and
entropy, no graph) twice, then two ``update_actor`` steps (NLL − 0.01 × entropy, AdamW; the first
creates the optimiser's moments). Figures: the peak RSS (``VmHWM``, reset through
``/proc/self/clear_refs`` before each measured phase) above the RSS at its start, for the second
log-prob pass and the second update (forward, backward, step): what the pass allocates for itself, not
the first call's one-time library and cache pages. Linux only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

_CODE = r'''
import json, sys, tempfile, time, torch
import torch.distributed as dist
from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.protocol import DataProto

model_dir, rows, tp, tr, fused = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
torch.set_num_threads(int(sys.argv[6]))
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
def status(key):  # MiB, from /proc/self/status (VmRSS: now, VmHWM: peak since the last reset)
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) / 1024

def reset_peak():  # Linux >= 4.0: VmHWM back to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return status("VmRSS")
engine = FSDPEngine.build(FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), grad_clip=1.0, cpu_kernels="off",
                                           optim=OptimConfig(lr=1e-6), use_fused_kernels=fused), "cpu", role="actor")
gen = torch.Generator().manual_seed(0)
ids = torch.randint(3, 250, (rows, tp + tr), generator=gen)
mask = torch.ones_like(ids)
data = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(-1) - 1,
                                    "responses": ids[:, tp:], "response_mask": mask[:, tp:]})

def loss(out, batch, info):
    m = batch["response_mask"]
    value = ((-out["log_probs"] - 0.01 * out["entropy"]) * m).sum() / info["batch_num_tokens"]
    return LossOutput(value, {"actor/loss": float(value.detach())}, {})

plan = UpdatePlan(mini_batch_size=rows, micro=MicroBatching(size=rows))
engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=rows))  # first call: libraries, caches
base = reset_peak()
t0 = time.perf_counter()
lp = engine.infer_batch(data, LogProbs(entropy=True), MicroBatching(size=rows))
t1 = time.perf_counter()
log_prob_mib = status("VmHWM") - base
metrics = engine.train_batch(data, LogProbs(entropy=True), loss, plan)  # creates AdamW's moments
base = reset_peak()
t2 = time.perf_counter()
engine.train_batch(data, LogProbs(entropy=True), loss, plan)
t3 = time.perf_counter()
print(json.dumps({"fused": fused, "log_prob_mib": log_prob_mib, "update_mib": status("VmHWM") - base,
                  "log_prob_s": t1 - t0, "update_s": t3 - t2, "steady_rss_mib": base,
                  "mean_log_prob": float(lp["log_probs"].mean()), "loss": metrics["actor/loss"][0],
                  "grad_norm": metrics["actor/grad_norm"][0]}))
'''


def main(argv: list[str] | None = None) -> list[dict]:
    from benchmarks.common import SHAPES
    from rlfoundry.models.tiny import save_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--response-length", type=int, default=256)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    shape = dict(SHAPES["qwen2.5-0.5b-vocab"])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = save_tiny_model(Path(tmp) / "model", num_layers=args.layers, **shape)
        tokens = args.rows * args.response_length
        print(f"{args.layers} layers of Qwen2.5-0.5B, vocabulary {shape['vocab_size']:,} (tied), {args.rows} rows x "
              f"({args.prompt_length} + {args.response_length}) tokens: response logits {tokens} x "
              f"{shape['vocab_size']:,} fp32 = {tokens * shape['vocab_size'] * 4 / 2**20:.0f} MiB")
        for fused in (False, True):
            out = subprocess.run([sys.executable, "-c", _CODE, str(model_dir), str(args.rows), str(args.prompt_length),
                                  str(args.response_length), str(int(fused)), str(args.threads)],
                                 check=True, capture_output=True, text=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            results.append(row)
            print(f"use_fused_kernels={str(fused).lower():5}: log-prob peak +{row['log_prob_mib']:6.0f} MiB "
                  f"({row['log_prob_s']:.1f} s), update peak +{row['update_mib']:6.0f} MiB ({row['update_s']:.1f} s); "
                  f"mean log-prob {row['mean_log_prob']:.6f}, loss {row['loss']:.6f}, grad norm {row['grad_norm']:.6f}")
    return results


if __name__ == "__main__":
    main()
