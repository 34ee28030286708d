"""Peak memory of the entropy and its backward: verl's plain formula against rlfoundry's block-wise one.

    python -m benchmarks.entropy_memory                  # 4096 rows x 16384 vocabulary, fp32 (256 MiB)
    python -m benchmarks.entropy_memory --rows 8192 --vocab 32768

Why ``entropy_from_logits_with_chunking`` and ``entropy_checkpointing`` are on the no-effect list:
``utils/torch_functional.py`` always computes the entropy in blocks of at most 2**25 values and its
backward recomputes each block's softmax from saved row statistics, which is what the two verl keys
buy together. Each variant runs in a fresh process; the figure is the process's peak RSS
(``ru_maxrss``) after ``H.sum().backward()`` minus its RSS once the logits exist (so the gradient,
the same size as the logits, is part of both).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

_CODE = r'''
import resource, sys, torch
rows, vocab, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0), requires_grad=True)
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if which == "rlfoundry":
    from rlfoundry.utils.torch_functional import entropy_from_logits
    h = entropy_from_logits(logits)
else:  # verl's entropy_from_logits: the whole softmax, kept by autograd for backward
    pd = torch.nn.functional.softmax(logits, dim=-1)
    h = torch.logsumexp(logits, dim=-1) - torch.sum(pd * logits, dim=-1)
h.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(f"{which:>10}: {(peak - base) / 1024:6.0f} MiB above the logits, sum of H {float(h.detach().sum()):.4f}")
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--vocab", type=int, default=16384)
    args = parser.parse_args()
    print(f"logits: {args.rows} x {args.vocab} fp32 = {args.rows * args.vocab * 4 / 2**20:.0f} MiB")
    for which in ("verl-plain", "rlfoundry"):
        subprocess.run([sys.executable, "-c", _CODE, str(args.rows), str(args.vocab), which], check=True)


if __name__ == "__main__":
    main()
