"""The actor's update time on the CPU with ``actor.use_torch_compile`` (regional compile of the decoder
layers, engines/fsdp/compile.py) against eager, in one process, interleaved (same run, ratio).

    python -m benchmarks.compile_update                                   # 4 layers, hidden 256, 8 x 96 tokens
    python -m benchmarks.compile_update --layers 2 --hidden 64 --rows 4 --tokens 11   # the test model's shape

Three engines on one rank, fp32, padded forward: eager with ``model.cpu_kernels=off`` (the path GPUs
take), eager with ``cpu_kernels=auto`` (the CPU default: oneDNN linears) and compiled (which turns the
CPU kernels off). Each does ``--repeats`` updates of one mini-batch (2 micro-batches, NLL, AdamW) after
one warm-up update (for the compiled engine the warm-up pays the compile, reported apart); the figure
is the median and the minimum update time and their ratios to eager (on a machine shared with other
work the minimum is the least disturbed figure; the spread shows the load).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from rlfoundry.config.schema import FSDPConfig, OptimConfig
from rlfoundry.engines.base import LogProbs, LossOutput, MicroBatching, UpdatePlan
from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
from rlfoundry.models.tiny import save_tiny_model
from rlfoundry.protocol import DataProto


def _batch(rows: int, tokens: int, vocab: int, length_jitter: int) -> DataProto:
    gen = torch.Generator().manual_seed(length_jitter)
    ids = torch.randint(3, vocab, (rows, tokens), generator=gen)
    mask = torch.ones(rows, tokens, dtype=torch.long)
    mask[0, tokens - 1 - length_jitter:] = 0  # rows of several lengths, as rollouts give
    tr = tokens // 2
    return DataProto.from_dict(tensors={
        "input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
        "responses": ids[:, -tr:], "response_mask": mask[:, -tr:].clone()})


def _nll(outputs, batch, info) -> LossOutput:
    mask = batch["response_mask"]
    loss = -(outputs["log_probs"] * mask).sum() / info["batch_num_tokens"]
    return LossOutput(loss, {}, {})


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=12)
    args = p.parse_args(argv)
    from tests.engines.test_fsdp_utils import world_of_one

    world_of_one()
    path = save_tiny_model(Path(tempfile.mkdtemp()), hidden_size=args.hidden, num_layers=args.layers,
                           num_heads=max(4, args.hidden // 64), num_kv_heads=2)
    variants = {"eager (cpu_kernels=off)": dict(cpu_kernels="off"), "eager (cpu_kernels=auto)": dict(cpu_kernels="auto"),
                "compiled": dict(cpu_kernels="off", use_torch_compile=True)}
    engines = {name: FSDPEngine.build(FSDPEngineConfig(path=str(path), fsdp=FSDPConfig(), grad_clip=1.0,
                                                       optim=OptimConfig(lr=1e-5), **kw), "cpu", role="actor")
               for name, kw in variants.items()}
    plan = UpdatePlan(mini_batch_size=args.rows, micro=MicroBatching(size=args.rows // 2))
    vocab = engines["compiled"].module.config.vocab_size
    first, times = {}, {name: [] for name in engines}
    for name, engine in engines.items():  # warm-up: the compiled engine compiles here
        t = time.perf_counter()
        engine.train_batch(_batch(args.rows, args.tokens, vocab, 0), LogProbs(), _nll, plan)
        first[name] = time.perf_counter() - t
    for r in range(args.repeats):  # interleaved, each repeat another set of lengths (dynamic shapes)
        data = _batch(args.rows, args.tokens, vocab, 1 + r % 3)
        for name, engine in engines.items():
            t = time.perf_counter()
            engine.train_batch(data, LogProbs(), _nll, plan)
            times[name].append(time.perf_counter() - t)
    base = statistics.median(times["eager (cpu_kernels=off)"])
    fastest = min(times["eager (cpu_kernels=off)"])  # on a shared machine the minimum is the least disturbed
    out = {"shape": vars(args), "torch": torch.__version__, "threads": torch.get_num_threads(), "variants": {
        name: {"first_update_s": round(first[name], 3), "median_s": round(statistics.median(ts), 4),
               "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
               "vs_eager_off_median": round(base / statistics.median(ts), 3),
               "vs_eager_off_min": round(fastest / min(ts), 3)} for name, ts in times.items()}}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
