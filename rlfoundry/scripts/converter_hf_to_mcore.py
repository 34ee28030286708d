"""An HF checkpoint -> a megatron-core distributed checkpoint, in the layout verl's
``scripts/converter_hf_to_mcore.py`` writes and ``*.megatron.use_dist_checkpointing`` loads
(``engines/megatron/dist_weights.py``): the model's sharded state dict at the top of ``--output_path``.

    python -m rlfoundry.scripts.converter_hf_to_mcore --hf_model_path DIR --output_path DIR
    torchrun --nproc_per_node 2 -m rlfoundry.scripts.converter_hf_to_mcore ... --pp_size 2

The model is built with mbridge (any family the Megatron engine takes) on CPU processes joined by gloo
(one by default; under torchrun, the launched ranks, ``--pp_size`` of them per model copy, an MoE model's
experts spread over ``--ep_size`` of them). The checkpoint loads at any tensor / pipeline / expert layout;
the layout here only spreads the work. verl's arguments are kept;
``--dtype`` (default bfloat16, what verl's converter writes) is this one's.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

__all__ = ["convert_hf_to_mcore", "main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hf_model_path", required=True, help="the Hugging Face model directory")
    p.add_argument("--output_path", required=True, help="the dist checkpoint's directory (new or empty)")
    p.add_argument("--pp_size", type=int, default=1, help="pipeline stages over the launched ranks")
    p.add_argument("--ep_size", type=int, default=1,
                   help="expert parallelism over the launched ranks (MoE models; each rank holds 1/ep of the experts)")
    p.add_argument("--use_cpu_initialization", action="store_true",
                   help="accepted for verl's command lines: the model is always built on the CPU here")
    p.add_argument("--test", action="store_true", help="reload the checkpoint and compare every tensor")
    p.add_argument("--trust_remote_code", action="store_true",
                   help="accepted for verl's command lines: mbridge's families need no remote code")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "bf16", "float32", "fp32", "float16", "fp16"],
                   help="the stored tensors' dtype (verl's converter: bfloat16)")
    return p


def _check_output(out: Path) -> None:
    # verl's converter silently skips a non-empty directory; an old checkpoint left in place would load instead
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"--output_path {out}: exists and is not an empty directory; choose a new one")


def convert_hf_to_mcore(hf_model_path: str, output_path: str, pp_size: int = 1, dtype: str = "bfloat16",
                        test: bool = False, ep_size: int = 1) -> Path:
    """Write the dist checkpoint; every rank of the (initialised) default group takes part. ``test``:
    rebuild the model from what was written and compare it with the converted one, tensor by tensor."""
    import torch.distributed as dist

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.dist_weights import weights_equal
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig

    if dist.get_world_size() % (pp_size * ep_size):
        raise SystemExit(f"--pp_size {pp_size} × --ep_size {ep_size} does not divide the {dist.get_world_size()} "
                         "launched ranks")
    layout = dict(pipeline_model_parallel_size=pp_size, expert_model_parallel_size=ep_size,
                  use_distributed_optimizer=False, dtype=dtype)
    megatron = MegatronConfig(**layout)
    engine = MegatronEngine(MegatronEngineConfig(hf_model_path, megatron), "cpu", role="converter")
    engine.save_dist_weights(output_path)
    if test:
        reloaded = MegatronConfig(**layout, use_dist_checkpointing=True, dist_checkpointing_path=str(output_path))
        again = MegatronEngine(MegatronEngineConfig(hf_model_path, reloaded), "cpu", role="converter")
        differ = weights_equal(dict(engine.iter_hf_weights()), dict(again.iter_hf_weights()))
        if differ:
            raise SystemExit(f"--test: the reloaded checkpoint differs from the converted model in {differ}")
        if dist.get_rank() == 0:
            print(f"--test: every tensor of {output_path} equals the converted model's")
    return Path(output_path)


def main(argv: list[str] | None = None) -> int:
    import torch.distributed as dist

    from rlfoundry.engines.megatron.export import _single_process_group

    args = _parser().parse_args(argv)
    out = Path(args.output_path)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1  # torchrun: its ranks join one gloo group
    if launched and not dist.is_initialized():
        dist.init_process_group("gloo")
    with _single_process_group():
        _check_output(out)
        dist.barrier()  # every rank looked before any writes
        convert_hf_to_mcore(args.hf_model_path, str(out), args.pp_size, args.dtype, args.test, args.ep_size)
        if dist.get_rank() == 0:
            print(f"wrote {out} from {args.hf_model_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
