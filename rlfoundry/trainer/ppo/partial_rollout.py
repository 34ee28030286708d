"""Partial rollout (``async_training.partial_rollout=true``): generation in chunks that a weight sync
may come between.

Without it a sync waits for the rollout's generation in flight, however long its longest response.
Here a batch's samples are generated ``partial_rollout_chunk_tokens`` tokens at a time: between two
chunks the rollouter may pause, the weights change, and the unfinished samples go on from their
prompt plus what they have so far under the new weights. Each token keeps the log-prob of the policy
that sampled it (the chunk's), so ``rollout_log_probs`` is the behaviour policy token by token, as
the importance weights of ``algorithm.rollout_correction`` need; each sample records the first and
last weight version it was generated under (``param_version_start`` / ``param_version_end``).

A chunk is one ``generate_sequences`` call over the unfinished samples (n = 1 each, prompt plus
response so far, left-padded): any engine, any number of rollout ranks. The price is a prefill of
the sample's tokens per chunk (no KV cache survives a weight change anyway).

Multi-turn (``rollout.multi_turn``): the agent loops run in the driver, where the boundary is, and
their server's engine is a :class:`ChunkedEngine`: each of its calls (one batch of the trajectories'
turn requests) is a chunked generation over the rollout pool's plain engine, so a sync may come before
any turn's first chunk and between its chunks, while the trajectories wait on the server; their tools
and prompts stay as they were (nothing is re-run), and each turn's tokens keep their chunks' log-probs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rlfoundry.protocol import DataProto
from rlfoundry.utils import faults
from rlfoundry.utils.torch_functional import left_padded, rollout_layout

__all__ = ["ChunkedEngine", "ChunkedGeneration"]


@dataclass
class _Sample:
    prompt: list[int]
    budget: int  # response tokens it may have
    response: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    done: bool = False
    versions: list[int] = field(default_factory=list)
    param_version: int | None = None  # actor updates behind the weights of its first chunk (the oldest)


class ChunkedGeneration:
    """``generate(prompts, n, boundary)``: the engines' output layout, generated chunk by chunk.

    ``call``: one engine call (``rollout_wg.generate_sequences``); ``boundary()``: called between
    chunks, returns the weight version the next chunk samples with (it may wait for a sync).
    """

    def __init__(self, call: Callable[[DataProto], DataProto], *, response_length: int, chunk_tokens: int,
                 pad_id: int, eos_ids: list[int]):
        if chunk_tokens < 1:
            raise ValueError(f"partial_rollout_chunk_tokens={chunk_tokens} must be >= 1")
        self.call, self.width, self.chunk = call, int(response_length), int(chunk_tokens)
        self.pad_id, self.eos = int(pad_id), set(eos_ids)
        self.engine_calls = 0

    def generate(self, prompts: DataProto, n: int, boundary: Callable[[], int],
                 budgets: list[int] | None = None) -> DataProto:
        """``budgets``: each prompt's own response budget (an agent loop's requests), else the configured
        ``response_length`` each; the output's responses are as wide as the largest."""
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        budgets = [self.width] * len(prompts) if budgets is None else [int(b) for b in budgets]
        samples = [_Sample(ids[i][mask[i].bool()].tolist(), budgets[i]) for i in range(len(prompts)) for _ in range(n)]
        version = boundary()
        while True:
            live = [s for s in samples if not s.done]
            self._chunk(live, prompts.meta_info, version)
            if all(s.done for s in samples):
                break
            faults.inject("partial_rollout.between_chunks")  # tests: a crash with a generation half done
            version = boundary()
        tensors = rollout_layout(ids.repeat_interleave(n, dim=0), mask.repeat_interleave(n, dim=0),
                                 [s.response for s in samples], [[1] * len(s.response) for s in samples],
                                 [s.log_probs for s in samples], max(budgets), self.pad_id)
        extras = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        extras["param_version_start"] = np.array([s.versions[0] for s in samples], dtype=object)
        extras["param_version_end"] = np.array([s.versions[-1] for s in samples], dtype=object)
        if all(s.param_version is not None for s in samples):
            extras["param_version"] = np.array([s.param_version for s in samples], dtype=object)
        return DataProto.from_dict(tensors=tensors, non_tensors=extras, meta_info=dict(prompts.meta_info))

    def _chunk(self, live: list[_Sample], meta: dict, version: int) -> None:
        """One engine call: each live sample gains up to ``chunk`` tokens (fewer at its budget or EOS)."""
        step = min(self.chunk, max(s.budget - len(s.response) for s in live))
        batch = DataProto.from_dict(tensors=left_padded([s.prompt + s.response for s in live], self.pad_id),
                                    meta_info={**meta, "n": 1, "response_length": step})
        out = self.call(batch)
        self.engine_calls += 1
        engine_versions = out.non_tensor_batch.get("param_version")
        for k, s in enumerate(live):
            if s.param_version is None and engine_versions is not None:
                s.param_version = int(engine_versions[k])
            allowed = min(step, s.budget - len(s.response))
            length = min(int(out.batch["response_mask"][k].sum()), allowed)
            new = out.batch["responses"][k][:length].tolist()
            s.response += new
            s.log_probs += out.batch["rollout_log_probs"][k][:length].tolist()
            s.versions.append(version)
            s.done = (length < allowed or bool(new and new[-1] in self.eos)
                      or len(s.response) >= s.budget)


class ChunkedEngine:
    """An agent loop's engine (``GenerationServer``'s) for partial rollout: every call is a
    :class:`ChunkedGeneration` over the rollout pool's plain engine, with ``boundary`` (set per
    generation by the rollouter) before each chunk. ``config``: the typed ``rollout`` subtree (the
    agent loop reads ``n`` there). Draws are per engine call (no ``reserve_draws``): a seeded run's
    sampled tokens then depend on where the chunks fall; greedy ones do not."""

    def __init__(self, chunked: ChunkedGeneration, config: Any):
        self.chunked, self.config = chunked, config
        self.eos_token_ids = sorted(chunked.eos)
        self.boundary: Callable[[], int] | None = None

    def generate_sequences(self, requests: DataProto) -> DataProto:
        meta = dict(requests.meta_info)
        if "multi_modal_inputs" in requests.non_tensor_batch:
            raise ValueError("async_training.partial_rollout=true with rollout.multi_turn does not take image rows "
                             "yet (their turns would lose their pixels between chunks); set partial_rollout=false")
        if meta.get("top_logprobs"):  # a request's own seed is refused by the server already (no reserve_draws)
            raise ValueError("async_training.partial_rollout=true with rollout.multi_turn: a request asked for top "
                             "log-probs (an openai_agent loop), which the chunked engine does not give; set "
                             "partial_rollout=false")
        if self.boundary is None:
            raise RuntimeError("ChunkedEngine.generate_sequences outside a rollouter's generation (no boundary set)")
        from rlfoundry.workers.rollout.agent_loop import ENGINE_ONLY

        budgets = meta.pop("max_response_lengths", None) or [int(meta["response_length"])] * len(requests)
        rows = DataProto(batch=requests.batch, meta_info={**meta, ENGINE_ONLY: True})
        return self.chunked.generate(rows, 1, self.boundary, budgets=budgets)
