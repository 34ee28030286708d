"""Memory and step time of LoRA against full fine-tuning: same model, same batch, same command line.

    python -m benchmarks.lora_memory                   # Qwen2.5-0.5B's layer shape, 4 layers, 2 repeats
    python -m benchmarks.lora_memory --layers 8 --repeats 1

Each run is ``rlfoundry train`` in a fresh process (GRPO with the KL loss, so a reference policy is
needed: full fine-tuning holds a second, frozen copy of the model; LoRA switches its adapter off
instead), one rank, random weights of the shape, 4 prompts × 4 samples, 32-token responses, 4 steps.
Per run: the rank's parameter bytes (all of them, frozen included, and the reference's), gradient
bytes (one fp32 gradient per trainable parameter: what backward allocates), optimiser-state bytes
(AdamW's moments as they are after the run), the process's peak RSS (``ru_maxrss``), and the median
step time after the first with its phases (generation, old log-probs, reference, actor update). Writes ``benchmarks/results/lora_memory.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.common import REPO_ROOT, SHAPES, format_table, save_results

PHASES = ("step", "gen", "old_log_prob", "ref", "update_actor")
MODES = {"full": [], "lora": ["actor_rollout_ref.model.lora_rank=16", "actor_rollout_ref.model.lora_alpha=32"]}

# Runs inside the child: train, then count the bytes the rank holds and its peak RSS.
_CHILD = r"""
import json, resource, sys
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.main_ppo import build_trainer

trainer = build_trainer(load_config(sys.argv[2:]))
trainer.fit()
worker = next(iter(trainer.actor_rollout_wg.worker.workers.values()))
engine = worker.engine
nbytes = lambda tensors: sum(t.numel() * t.element_size() for t in tensors)
ref = worker.ref_policy.engine if worker.ref_policy is not None and worker.ref_policy.engine is not engine else None
moments = [v for s in engine.optimizer.state.values() for k, v in s.items() if hasattr(v, "numel") and k != "step"]
print("RESULT " + json.dumps({
    "parameter_bytes": nbytes(engine.module.parameters()),
    "reference_bytes": nbytes(ref.module.parameters()) if ref is not None else 0,
    "gradient_bytes": nbytes(p for p in engine.module.parameters() if p.requires_grad),
    "optimizer_bytes": nbytes(moments),
    "trainable_parameters": sum(p.numel() for p in engine.module.parameters() if p.requires_grad),
    "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
}))
"""


def shape_model(layers: int, cache: Path) -> Path:
    path = cache / f"qwen2.5-0.5b-shape-l{layers}"
    shape = SHAPES["qwen2.5-0.5b"]
    code = ("import sys, json; from rlfoundry.models.tiny import save_tiny_model; "
            "save_tiny_model(sys.argv[1], num_layers=int(sys.argv[2]), **json.loads(sys.argv[3]))")
    subprocess.run([sys.executable, "-c", code, str(path), str(layers), json.dumps(shape)], check=True, cwd=REPO_ROOT)
    return path


def run_mode(mode: str, model: Path, run_dir: Path) -> dict[str, Any]:
    overrides = [f"actor_rollout_ref.model.path={model}", f"trainer.default_local_dir={run_dir}",
                 "trainer.total_training_steps=4", "trainer.test_freq=-1", "trainer.val_before_train=false",
                 "trainer.save_freq=-1", "trainer.logger=file", "data.train_batch_size=4",
                 "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
                 "data.max_response_length=32", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
                 "actor_rollout_ref.actor.use_kl_loss=true", *MODES[mode]]
    done = subprocess.run([sys.executable, "-c", _CHILD, "--", *overrides], cwd=REPO_ROOT, capture_output=True,
                          text=True, env={**__import__("os").environ, "PYTHONPATH": str(REPO_ROOT)})
    if done.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    result = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "timing_s/step" in r][1:]  # the first step warms up
    phase = lambda key: statistics.median(r.get(f"timing_s/{key}", 0.0) for r in steps)  # noqa: E731
    return {"mode": mode, **result, **{f"{key}_s": phase(key) for key in PHASES}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--repeats", type=int, default=2)
    a = p.parse_args(argv)
    runs: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        model = shape_model(a.layers, Path(tmp))
        for repeat in range(a.repeats):
            for mode in MODES:  # alternate, so drift in the machine's load hits both
                runs.append({"repeat": repeat, **run_mode(mode, model, Path(tmp) / f"{mode}-{repeat}")})
    mib = 2 ** 20
    rows = [{"mode": r["mode"], "repeat": r["repeat"], "params_mib": r["parameter_bytes"] / mib,
             "ref_mib": r["reference_bytes"] / mib, "grads_mib": r["gradient_bytes"] / mib,
             "optim_mib": r["optimizer_bytes"] / mib, "peak_rss_mib": r["peak_rss_bytes"] / mib,
             **{f"{k}_s": r[f"{k}_s"] for k in PHASES}} for r in runs]
    columns = [("mode", "mode", ""), ("repeat", "repeat", ""), ("params MiB", "params_mib", ".1f"),
               ("ref MiB", "ref_mib", ".1f"), ("grads MiB", "grads_mib", ".1f"), ("optim MiB", "optim_mib", ".1f"),
               ("peak RSS MiB", "peak_rss_mib", ".0f"), *((f"{k} s", f"{k}_s", ".2f") for k in PHASES)]
    print(format_table(rows, columns))
    payload = {"layers": a.layers, "shape": SHAPES["qwen2.5-0.5b"], "runs": runs}
    print(f"written {save_results('lora_memory', payload)}")
    return payload


if __name__ == "__main__":
    main()
