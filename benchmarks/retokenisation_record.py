"""Cost of the mismatch audit's re-tokenisation record in a multi-turn rollout (docs/on_policy.md).

    python -m benchmarks.retokenisation_record                          # 128 trajectories, 4 turns, 1024 tokens
    python -m benchmarks.retokenisation_record --trajectories 512 --turns 8 --response-length 8192

A synthetic rollout through the real functions, no model: every turn is one engine call whose input rows
are left-padded as ``GenerationServer._rows`` pads them and digested as it digests them (``prefix_digests``),
each trajectory sampling half of its turn's tokens (the other half stands for a tool reply); the rows are
then laid out as the agent loop lays them out (``rollout_layout``) and held against the record
(``agent_loop._retokenised_from``). Printed: the record's two costs beside the padding and layout work the
agent loop does anyway. 2026-11-29, 2-core AMD EPYC VM shared with four other jobs: 19 ms digests and 60 ms
check (padding 117 ms, layout 135 ms) at the defaults; 1.1 s and 1.2 s (padding 4.7 s, layout 3.9 s) at 512
trajectories, 8 turns, 8192 tokens.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from rlfoundry.protocol import DataProto
from rlfoundry.utils.torch_functional import left_padded, rollout_layout
from rlfoundry.workers.rollout.agent_loop import _retokenised_from
from rlfoundry.workers.rollout.agent_loop.server import GenerationServer, prefix_digests


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=128)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=1024)
    parser.add_argument("--prompt-length", type=int, default=256)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rng = random.Random(0)
    tokens = lambda n: [rng.randrange(1000, 150000) for _ in range(n)]  # noqa: E731
    n, step = args.trajectories, args.response_length // args.turns
    server = GenerationServer(engine=object(), pad_id=0, meta={}, grace_s=1.0)
    prompts = [tokens(args.prompt_length) for _ in range(n)]
    responses, masks = [[] for _ in range(n)], [[] for _ in range(n)]
    times = {"padding_s": 0.0, "digests_s": 0.0}
    for _ in range(args.turns):
        contexts = [prompts[k] + responses[k] for k in range(n)]
        started = time.perf_counter()
        rows = left_padded(contexts, 0)
        times["padding_s"] += time.perf_counter() - started
        started = time.perf_counter()
        digests = prefix_digests(rows["input_ids"], rows["attention_mask"])[:, -1].tolist()
        times["digests_s"] += time.perf_counter() - started
        for k in range(n):
            sampled = tokens(step // 2)
            server.sampled.setdefault(k, []).append((len(contexts[k]), digests[k], sampled))
            responses[k] += sampled + tokens(step - step // 2)
            masks[k] += [1] * (step // 2) + [0] * (step - step // 2)
    started = time.perf_counter()
    layout = rollout_layout(torch.tensor(prompts), torch.ones(n, args.prompt_length, dtype=torch.long), responses,
                            masks, [[0.0] * len(r) for r in responses], args.response_length, 0)
    times["layout_s"] = time.perf_counter() - started
    started = time.perf_counter()
    column = _retokenised_from(server, DataProto.from_dict(tensors=layout), list(range(n)))
    times["check_s"] = time.perf_counter() - started
    if list(column) != [-1] * n:
        raise AssertionError("every row was laid out as sampled, yet the record names re-tokenised rows")
    return times


if __name__ == "__main__":
    print({k: round(v, 4) for k, v in main().items()})
