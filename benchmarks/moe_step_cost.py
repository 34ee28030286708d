"""What an MoE GRPO step costs against the dense model of the same active size, in one process.

    python -m benchmarks.moe_step_cost [--repeats 10 --threads 2 --response-length 32]

Two models of the same shape apart from the MLP, built from configs with the project's byte tokenizer
(seed 0): the MoE demo's body, a Qwen3-MoE of hidden 96 and 4 layers with 8 experts of width 96, 2 routed
per token (``scripts/make_demo_policy.py`` ``MOE_MODEL``), and its *dense twin*, a Qwen3 of hidden 96
and 4 layers whose one MLP is 192 wide: each token passes through the same number of MLP weights (2 × 96
= 192 columns per projection), so the two do the same matrix-product FLOPs per token and the ratio is
what routing, the grouped expert products and the replay cost on top.

One real trainer per variant (``main_ppo.build_trainer``, all in this process, ``trainer.worker_backend=
local``): the dense twin, the MoE, and the MoE as the demo runs it (routing replay R3, the old log-probs
recomputed, and the mismatch audit, whose unreplayed log-prob pass is one more forward). They take one
GRPO step each in turn, round after round, so that on a shared machine the steps of a round see the same
load; every response is ``--response-length`` tokens (``rollout.ignore_eos``), so all process the same
tokens. Reported: the median over the rounds of ``timing_s/step`` and of its phases, and the median of
each round's MoE/dense ratio. Writes
``benchmarks/results/moe_step_cost.json``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS_DIR, format_table, save_results

HIDDEN, LAYERS, EXPERTS, TOP_K, EXPERT_WIDTH = 96, 4, 8, 2, 96  # make_demo_policy.MOE_MODEL's shape
SHAPE = {"hidden_size": HIDDEN, "num_layers": LAYERS, "num_heads": 4, "num_kv_heads": 2, "seed": 0}
MODELS = {"dense": dict(arch="qwen3", intermediate_size=TOP_K * EXPERT_WIDTH, **SHAPE),
          "moe": dict(arch="qwen3_moe", intermediate_size=EXPERT_WIDTH, num_experts=EXPERTS,
                      num_experts_per_tok=TOP_K, **SHAPE)}
# the MoE demo's keys (rlfoundry/config/moe_grpo.yaml): R3, and the old-log-prob pass the replay metrics come from
DEMO = ["actor_rollout_ref.actor.router_replay.mode=R3", "actor_rollout_ref.rollout.enable_rollout_routing_replay=true",
        "actor_rollout_ref.actor.use_rollout_log_probs=false"]
VARIANTS = {  # name: (model, extra overrides)
    "dense": ("dense", ["trainer.mismatch_audit=false"]),
    "moe": ("moe", ["trainer.mismatch_audit=false"]),
    "moe_demo": ("moe", DEMO),
}
PHASES = ("step", "gen", "old_log_prob", "update_actor")


def _overrides(model_dir: Path, run_dir: Path, a: argparse.Namespace) -> list[str]:
    """The default demo's GRPO step (8 prompts × n=8, one mini-batch), fixed-length responses, nothing saved."""
    return [f"actor_rollout_ref.model.path={model_dir}", f"trainer.default_local_dir={run_dir}",
            f"data.train_batch_size={a.prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={a.prompts}",
            f"data.max_response_length={a.response_length}", "actor_rollout_ref.rollout.ignore_eos=true",
            f"trainer.total_training_steps={a.warmup_steps + a.repeats}", "trainer.val_before_train=false",
            "trainer.test_freq=-1", "trainer.save_freq=-1", "trainer.logger=file", "trainer.device=cpu",
            "trainer.worker_backend=local", "reward_model.reward_kwargs.num_workers=0"]


def _step(trainer: Any) -> dict[str, float]:
    """One training step as ``fit()`` runs it (its checkpoint, validation and logging left out): phase seconds."""
    trainer.state.global_steps += 1
    metrics = trainer.train_step()
    return {p: float(metrics.get(f"timing_s/{p}", 0.0)) for p in PHASES}


def measure(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Rounds of one step of every variant in turn, after ``a.warmup_steps`` untimed rounds. Steps a few
    seconds apart see the same load on a shared machine, so each round's ratio is a fair pair."""
    from rlfoundry.models.tiny import save_tiny_model
    from rlfoundry.trainer.config import load_config
    from rlfoundry.trainer.main_ppo import build_trainer

    dirs = {name: save_tiny_model(work / name, **kwargs) for name, kwargs in MODELS.items()}
    trainers = {v: build_trainer(load_config(_overrides(dirs[model], work / f"run-{v}", a) + extra))
                for v, (model, extra) in VARIANTS.items()}
    rounds: list[dict[str, dict[str, float]]] = []
    try:
        for r in range(a.warmup_steps + a.repeats):
            row = {v: _step(t) for v, t in trainers.items()}
            if r >= a.warmup_steps:
                rounds.append(row)
                print(f"[bench] round {len(rounds)}: " + ", ".join(f"{v} {x['step']:.3f} s" for v, x in row.items()))
    finally:
        for t in trainers.values():
            t.source.close()
    medians = {v: {p: statistics.median(row[v][p] for row in rounds) for p in PHASES} for v in VARIANTS}
    ratios = {v: {p: statistics.median(row[v][p] / row["dense"][p] for row in rounds)
                  for p in PHASES if all(row["dense"][p] > 0 for row in rounds)}
              for v in VARIANTS if v != "dense"}
    return {"rounds": rounds, "medians": medians, "ratios_to_dense": ratios}


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=10, help="timed rounds (one step of every variant each)")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed rounds first")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (n = 8 samples each)")
    p.add_argument("--response-length", type=int, default=32, help="tokens per response (every response)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (2: the demo machine)")
    p.add_argument("--work-dir", type=Path, default=None, help="models and runs (default: a temp dir)")
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        out = measure(a, a.work_dir or Path(tmp))
    rows = [{"variant": v, **{p: m[p] for p in PHASES}, **{f"x_{p}": out["ratios_to_dense"].get(v, {}).get(p)
                                                           for p in PHASES}} for v, m in out["medians"].items()]
    columns = [("variant", "variant", "")] + [(f"{p} s", p, ".3f") for p in PHASES] + \
              [(f"{p} / dense", f"x_{p}", ".2f") for p in PHASES]
    print(f"\n== GRPO step, MoE vs dense of the same active size: {a.prompts} prompts x 8 samples, "
          f"{a.response_length}-token responses, {a.threads} threads, medians of {a.repeats} rounds")
    print(format_table(rows, columns))
    payload = {**out, "args": {k: str(v) for k, v in vars(a).items()}, "models": MODELS}
    print(f"saved {save_results('moe_step_cost', payload, a.results_dir)}")
    return payload


if __name__ == "__main__":
    main()
