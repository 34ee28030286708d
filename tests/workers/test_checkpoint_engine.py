"""The checkpoint engine's bridge between a trainer and a separate rollout process (workers/checkpoint_engine.py).

Two processes, each with its own torch.distributed world (as two worker pools have), join a bridge
group; the trainer changes its weights and streams them in small buckets; afterwards the rollout's
model gives the trainer's log-probs, bit for bit — and before the sync it did not (the test can fail).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rlfoundry.workers.checkpoint_engine import CheckpointEngine

pytestmark = pytest.mark.slow

_SCRIPT = r"""
import json, os, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp

def run(rank, model_dir, bridge_port, world_ports, out_dir):
    torch.set_num_threads(1)
    # each side's own world of one rank (a trainer pool and a rollout pool)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(world_ports[rank]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from transformers import AutoModelForCausalLM
    from rlfoundry.workers.checkpoint_engine import CheckpointEngine

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.arange(3, 19).view(2, 8)
    log_probs = lambda: torch.log_softmax(model(input_ids=ids).logits, -1)
    bridge = CheckpointEngine.connect("127.0.0.1", bridge_port, rank, 2, bucket_megabytes=0.05)
    extra = {"extra.bf16": torch.linspace(-1, 1, 7, dtype=torch.bfloat16), "extra.flags": torch.tensor([True, False]),
             "extra.scalar": torch.tensor(3.5, dtype=torch.float64)}
    with torch.no_grad():
        if rank == 0:  # the trainer: an update the rollout has not seen
            for p in model.parameters():
                p.mul_(1.5).add_(0.01)
            stats = bridge.send(list(model.named_parameters()) + list(extra.items()))
            result = {"stats": [stats.tensors, stats.bytes, stats.buckets], "log_probs": log_probs().tolist()}
        else:
            before = log_probs()
            params, received = dict(model.named_parameters()), {}
            for name, tensor in bridge.receive():
                if name in params:
                    params[name].copy_(tensor)
                else:
                    received[name] = tensor
            result = {"before": before.tolist(), "log_probs": log_probs().tolist(),
                      "extra_equal": all(torch.equal(received[k], v) and received[k].dtype == v.dtype
                                         for k, v in extra.items())}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()

if __name__ == "__main__":
    ports = [int(p) for p in sys.argv[3].split(",")]
    mp.spawn(run, args=(sys.argv[1], int(sys.argv[2]), ports, sys.argv[4]), nprocs=2)
"""


def test_a_sync_over_the_bridge_gives_the_rollout_the_trainers_log_probs(tmp_path):
    import subprocess

    from rlfoundry.models.tiny import save_tiny_model
    from rlfoundry.single_controller.base.worker import find_free_port
    from tests.trainer import _e2e as E

    model_dir = save_tiny_model(tmp_path / "model")
    ports = [find_free_port() for _ in range(3)]
    script = tmp_path / "bridge.py"  # a file: spawned children import run() from it
    script.write_text(_SCRIPT)
    proc = subprocess.run([sys.executable, str(script), str(model_dir), str(ports[0]), f"{ports[1]},{ports[2]}",
                           str(tmp_path)], capture_output=True, text=True, env=E.subprocess_env(), timeout=300,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-4000:]
    trainer = json.loads((tmp_path / "rank0.json").read_text())
    rollout = json.loads((tmp_path / "rank1.json").read_text())
    from transformers import AutoModelForCausalLM

    params = list(AutoModelForCausalLM.from_pretrained(model_dir).parameters())
    tensors, nbytes, buckets = trainer["stats"]
    assert tensors == len(params) + 3 and nbytes == 4 * sum(p.numel() for p in params) + 7 * 2 + 2 + 8
    assert buckets > 3  # 0.05 MB buckets: the stream was cut
    assert rollout["extra_equal"]  # dtypes (bf16, bool, float64) and shapes (a scalar) survive
    assert torch.equal(torch.tensor(rollout["log_probs"]), torch.tensor(trainer["log_probs"]))
    assert (torch.tensor(rollout["before"]) - torch.tensor(trainer["log_probs"])).abs().max() > 1e-3


def test_the_bridge_checks_its_arguments():
    with pytest.raises(ValueError, match="update_weights_bucket_megabytes=0 must be > 0"):
        CheckpointEngine(None, 0, 2, bucket_megabytes=0)
    with pytest.raises(RuntimeError, match="only the bridge's rank 0"):
        CheckpointEngine(None, 1, 2).send([])
    with pytest.raises(RuntimeError, match="receivers have rank >= 1"):
        next(CheckpointEngine(None, 0, 2).receive())
