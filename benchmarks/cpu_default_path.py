"""Generation and actor-update time of the CPU default path, in one process, best of many calls.

    python -m benchmarks.cpu_default_path [--calls 12]

For A/B checks of a change on a shared machine, where whole-run benchmarks (``vs_trl``) swing
with the other tenants' load: each phase's *minimum* over ``--calls`` calls (the first is dropped)
is the least disturbed one. Run it alternately in two checkouts (``git worktree``) and compare the
minima. Workload: the test suite's tiny Qwen2 builders (``tests/workers``) at hidden 128 × 4
layers, 8 prompts × n=8, 64 sampled tokens (EOS off), ``model.cpu_kernels=auto`` (the CPU default),
one rank, one update per call (micro-batch = the whole batch), 2 threads. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main(argv: list[str] | None = None) -> dict[str, float]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=12)
    p.add_argument("--work-dir", default="/tmp/rlfoundry-cpu-default-path")
    a = p.parse_args(argv)

    import torch
    from transformers import AutoTokenizer

    from rlfoundry.models.tiny import save_tiny_model
    from tests.workers import local_worker, make_prompts, worker_config

    torch.set_num_threads(2)
    model_dir = save_tiny_model(a.work_dir, hidden_size=128, num_layers=4)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    group = local_worker(worker_config(model_dir, [
        "model.cpu_kernels=auto", "rollout.n=8", "rollout.response_length=64", "rollout.prompt_length=48",
        "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size_per_gpu=64",
        "rollout.log_prob_micro_batch_size_per_gpu=64"]))
    prompts = make_prompts(tokenizer, [f"what is {i} + {2 * i}?" for i in range(8)], max_prompt_length=48)
    prompts.meta_info["eos_token_id"] = [-5]  # no EOS: every call samples 64 tokens per row
    gen, update = [], []
    for _ in range(a.calls):
        start = time.perf_counter()
        data = group.generate_sequences(prompts)
        gen.append(time.perf_counter() - start)
        data.meta_info = {"temperature": 1.0}
        data = data.union(group.compute_log_prob(data))
        mask = data.batch["response_mask"]
        data.batch["advantages"] = torch.randn(mask.shape) * mask
        start = time.perf_counter()
        group.update_actor(data)
        update.append(time.perf_counter() - start)
    out = {"gen_min_s": min(gen[1:]), "gen_median_s": statistics.median(gen[1:]),
           "update_min_s": min(update[1:]), "update_median_s": statistics.median(update[1:])}
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
