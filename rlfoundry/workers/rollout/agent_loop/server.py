"""Many trajectories' generation requests batched onto one rollout engine.

Each trajectory is a coroutine that awaits ``generate`` for its next assistant turn. The server
gathers the requests and runs one engine call (``generate_sequences`` on left-padded rows, in a worker
thread so tools keep running) for all of them; turns at different positions share the call. A call
starts when every live trajectory is waiting for the engine — the batch of the synchronous loop,
composed the same way whatever the tools' timing, so a seeded run draws the same tokens — or, when
some trajectories are still in their tools, ``grace_s`` after the first request: a slow tool then
delays the others by at most ``grace_s``, not by its own duration. The grace is timed by the event
loop's clock, the one its timeouts run on (a test's virtual-time loop makes it exact). A black-box
agent (``openai_agent``) runs its own code between requests, so how its requests are batched depends on
timing: on an engine that keys its draws (``reserve_draws``: HF, vLLM), each request's tokens are
sampled from a stream of its own, keyed by the batch's reserved call number, its trajectory and its turn
in that trajectory, so a seeded run samples the same tokens however the requests were batched (a
trajectory's concurrent requests are keyed in the order they reach the server). Each call's
meta-info carries every row's own budget (``max_response_lengths``): vLLM caps each request by it, the
HF engine generates to the largest and the server cuts each row to its own.

A request may carry a ``seed`` (the OpenAI endpoint's per-request seed): on an engine that keys its draws its
stream is then keyed by that seed alone (not by the batch, trajectory or turn), so the same seed and context
sample the same tokens; and ``top_logprobs`` = k: the engine call then asks for each step's k most likely
tokens (``serves_top_logprobs``: the HF engine) and the request gets them.

An engine that reports per row the weight versions it sampled under (``param_version_start`` /
``param_version_end`` / ``param_version``: partial rollout's ``ChunkedEngine``) has them kept per
trajectory too (``versions``): its first request's start and its last request's end.

The server keeps, per trajectory, what each request sampled and a digest of the context it sampled it
after (``sampled``); ``sampled_spans`` holds a training row against that record, so the mismatch audit can
tell the rows whose tokens the engine did not sample as they are trained (re-tokenisation, docs/on_policy.md).

Image rows (docs/vision.md): a request may carry its prompt's :class:`PromptVision` (the row's
``multi_modal_inputs``, ``multi_modal_data`` and 3-D rotary positions); the engine call then gets every
row's pixel inputs (``multi_modal_inputs``, what the HF engine reads), its images (``multi_modal_data``,
what vLLM reads; {} for text rows, both) and (B, 3, T) positions: the prompt's own, then text going on
from its last one in all three axes, as the single-turn rollout continues a prompt. Later turns extend
the context with text only, so their positions go on the same way.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlfoundry.models.vision import continued_positions
from rlfoundry.protocol import DataProto
from rlfoundry.utils.torch_functional import left_padded
from rlfoundry.workers.rollout.base import mixed_seed

__all__ = ["GenerationServer", "Generated", "PromptVision"]


@dataclass
class PromptVision:
    """An image prompt's inputs for every turn of its trajectory: ``multi_modal_inputs`` (the processor's
    ``pixel_values``, ``image_grid_thw``), ``positions`` (3, P), the prompt's 3-D rotary positions over
    its P tokens (no padding), and ``multi_modal_data`` (the row's ``{"image": [PIL images]}``, for engines
    that process the images themselves: vLLM). The context the engine continues starts with those P
    prompt tokens."""

    multi_modal_inputs: dict
    positions: torch.Tensor
    multi_modal_data: dict | None = None

    def context_positions(self, length: int) -> torch.Tensor:
        """(3, length): the prompt's positions, then each later (text) token one past the one before."""
        extra = length - self.positions.shape[1]
        if extra < 0:
            raise ValueError(f"an image prompt's context of {length} tokens is shorter than its prompt "
                             f"({self.positions.shape[1]} tokens)")
        return continued_positions(self.positions, extra)


_SEEDED = 1 << 41  # in the first slot of a seeded request's draw key: never a reserved call number
_DIGEST_BASE = -0x61C8864680B583EB  # 0x9E3779B97F4A7C15 as an int64: odd, so its powers mod 2**64 never vanish


def prefix_digests(ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(B, T) token rows whose real tokens (``mask`` 1) are contiguous -> (B, T) int64: at [b, j] a digest of row
    b's real tokens up to column j, sum_i id_i * BASE^(i+1) over them, mod 2**64 (torch's int64 products and
    sums wrap around, on the CPU and on CUDA alike).
    A running sum: every prefix of every row in one vectorised pass, where hashing each prefix on its own
    would read a row once per turn."""
    rank = mask.long().cumsum(-1)  # 1-based rank of each real token in its row
    powers = torch.full((ids.shape[-1],), _DIGEST_BASE, dtype=torch.long, device=ids.device).cumprod(0)
    return torch.where(mask.bool(), ids.long() * powers[(rank - 1).clamp(min=0)], 0).cumsum(-1)


@dataclass
class Generated:
    """One request's turn: the sampled ids (cut to its ``max_tokens``) and their log-probs; with
    ``top_logprobs`` asked, each step's most likely ``(token id, log-prob)`` pairs."""

    token_ids: list[int]
    log_probs: list[float]
    top: list[list[tuple[int, float]]] | None = None
    versions: dict[str, int] | None = None  # the weight versions it was sampled under (see the module docstring)


@dataclass
class _Request:
    key: int  # the trajectory's index: rows are ordered by it, so a batch does not depend on arrival order
    token_ids: list[int]
    max_tokens: int
    future: asyncio.Future
    vision: PromptVision | None = None
    draw_key: int = 0  # (reserved call, trajectory, turn) mixed: the key of its sampling stream
    top_logprobs: int = 0
    context_digest: int = 0  # prefix_digests of token_ids, set by _rows


_VERSION_KEYS = ("param_version_start", "param_version_end", "param_version")


def _versions(out: DataProto, k: int) -> dict[str, int] | None:
    """Row ``k``'s weight versions where the engine reports a sample's span (partial rollout), else None."""
    columns = out.non_tensor_batch
    if "param_version_start" not in columns:
        return None
    return {name: int(columns[name][k]) for name in _VERSION_KEYS if name in columns}


class GenerationServer:
    """Args: engine (``generate_sequences`` over left-padded rows, ``n=1``), pad id, the meta-info every
    engine call carries (validation flag, sampling overrides), and the grace period in seconds."""

    def __init__(self, engine: Any, pad_id: int, meta: dict[str, Any], grace_s: float):
        self.engine, self.pad_id, self.meta, self.grace_s = engine, pad_id, dict(meta), float(grace_s)
        self.eos_ids = set(getattr(engine, "eos_token_ids", None) or [])
        self.live = 0  # trajectories started and not yet finished
        self.engine_calls = 0
        reserve = getattr(engine, "reserve_draws", None)
        self._salt = reserve() if callable(reserve) else None  # None: the engine draws per call
        self._turns: dict[int, int] = {}  # requests so far per trajectory
        self._pending: list[_Request] = []
        self._wake: asyncio.Event | None = None
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="rlfoundry-engine")
        # per trajectory: (context length, digest of the context, sampled ids) of each request answered. A
        # digest, not the context: a trajectory's turns would otherwise hold a copy of its whole context each
        self.sampled: dict[int, list[tuple[int, int, list[int]]]] = {}
        # per trajectory: {param_version_start, param_version_end, param_version}, where the engine reports them
        self.versions: dict[int, dict[str, int]] = {}

    @property
    def seeds_requests(self) -> bool:
        """Whether a request's own ``seed`` can key its draws (the engine keys them: HF, vLLM)."""
        return self._salt is not None

    @property
    def serves_top_logprobs(self) -> bool:
        return bool(getattr(self.engine, "serves_top_logprobs", False))

    # ---- the trajectories' side ------------------------------------------------------------

    def join(self) -> None:
        self.live += 1

    def leave(self) -> None:
        self.live -= 1
        self._notify()

    async def generate(self, key: int, token_ids: list[int], max_tokens: int, vision: PromptVision | None = None,
                       *, seed: tuple[int, ...] | None = None, top_logprobs: int = 0) -> Generated:
        """The next turn after ``token_ids``; ``vision``: the image prompt they start with (see the module
        docstring), None for a text context; ``seed`` (non-negative ints): key the draws by it alone (only
        where ``seeds_requests``); ``top_logprobs``: how many of each step's most likely tokens to return."""
        if seed is not None and self._salt is None:
            raise ValueError("this rollout engine draws per engine call: a request cannot carry its own seed")
        future = asyncio.get_running_loop().create_future()
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        draw_key = 0 if self._salt is None else mixed_seed(_SEEDED, *seed) if seed is not None else \
            mixed_seed(self._salt, key, turn)
        self._pending.append(_Request(key, list(token_ids), int(max_tokens), future, vision, draw_key,
                                      int(top_logprobs)))
        self._notify()
        return await future

    # ---- the engine's side ----------------------------------------------------------------------

    async def serve(self) -> None:
        """Runs until cancelled: waits for a batch (see the module docstring), runs it, repeats."""
        self._wake = asyncio.Event()
        try:
            while True:
                await self._wait_for_batch()
                batch, self._pending = sorted(self._pending, key=lambda r: r.key), []
                try:
                    outputs = await asyncio.get_running_loop().run_in_executor(self._executor, self._run, batch)
                except Exception as e:  # noqa: BLE001 - every waiting trajectory gets the engine's error
                    for request in batch:
                        request.future.set_exception(e)
                    continue
                for request, output in zip(batch, outputs):
                    self.sampled.setdefault(request.key, []).append(
                        (len(request.token_ids), request.context_digest, output.token_ids))
                    self._record_versions(request.key, output.versions)
                    request.future.set_result(output)
        finally:
            self._executor.shutdown(wait=False)

    async def _wait_for_batch(self) -> None:
        clock, first = asyncio.get_running_loop().time, None
        while True:
            if self._pending:
                first = clock() if first is None else first
                left = self.grace_s - (clock() - first)
                if len(self._pending) >= self.live or left <= 0:
                    return
            else:
                left = None
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except asyncio.TimeoutError:
                pass

    def _record_versions(self, key: int, versions: dict[str, int] | None) -> None:
        """A trajectory's versions: its first request's start (and actor version), its latest request's end."""
        if versions:
            held = self.versions.setdefault(key, dict(versions))
            held["param_version_end"] = versions["param_version_end"]

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    def sampled_spans(self, key: int, ids: torch.Tensor, digests: torch.Tensor) -> list[tuple[int, int]]:
        """The spans ``[a, b)`` of ``ids`` (a training row of trajectory ``key``, its real tokens (n,); ``digests``
        (n,): ``prefix_digests`` of them) whose tokens a request of the trajectory sampled after exactly
        ``ids[:a]``. A request's tokens may be cut short in the row (a stop string)."""
        spans = []
        for length, digest, sampled in self.sampled.get(key, ()):
            if not 0 < length < len(ids) or int(digests[length - 1]) != digest:
                continue
            window = ids[length:length + len(sampled)].tolist()
            same = len(window) if window == sampled[:len(window)] else \
                next(j for j, (x, y) in enumerate(zip(window, sampled)) if x != y)  # a list compare first: C speed
            spans.append((length, length + same))
        return spans

    def _run(self, batch: list[_Request]) -> list[Generated]:
        """One engine call for the batch's rows (in the server's thread, which also digests each request's
        context for ``sampled``: off the event loop)."""
        self.engine_calls += 1
        budget = max(r.max_tokens for r in batch)
        meta = {**self.meta, "n": 1, "response_length": budget, "max_response_lengths": [r.max_tokens for r in batch]}
        if self._salt is not None:
            meta["sample_keys"] = [r.draw_key for r in batch]
        top_k = max(r.top_logprobs for r in batch)
        if top_k:
            meta["top_logprobs"] = top_k
        out = self.engine.generate_sequences(self._rows(batch, meta))
        # to Python lists in one copy per tensor (from the engine's device), not one sync per row
        lengths = out.batch["response_mask"].sum(-1).tolist()
        responses, log_probs = out.batch["responses"].tolist(), out.batch["rollout_log_probs"].tolist()
        top_ids = top_values = None
        if top_k and "rollout_top_ids" in out.batch.keys():
            top_ids, top_values = out.batch["rollout_top_ids"].tolist(), out.batch["rollout_top_logprobs"].tolist()
        results = []
        for k, request in enumerate(batch):
            length = min(int(lengths[k]), request.max_tokens)
            top = None
            if request.top_logprobs and top_ids is not None:
                top = [list(zip(top_ids[k][t][:request.top_logprobs], top_values[k][t][:request.top_logprobs]))
                       for t in range(length)]
            results.append(Generated(responses[k][:length], log_probs[k][:length], top, _versions(out, k)))
        return results

    def _rows(self, batch: list[_Request], meta: dict) -> DataProto:
        """The engine's input, on the engine's device where it has one (the HF engine: its module's); each
        request's ``context_digest`` from the host copy (``sampled``)."""
        device = getattr(self.engine, "device", None)
        tensors = left_padded([r.token_ids for r in batch], self.pad_id)
        digests = prefix_digests(tensors["input_ids"], tensors["attention_mask"])[:, -1].tolist()
        for r, digest in zip(batch, digests):
            r.context_digest = digest
        if device is not None:
            tensors = {k: v.to(device) for k, v in tensors.items()}
        if all(r.vision is None for r in batch):
            return DataProto.from_dict(tensors=tensors, meta_info=meta)
        # (B, 3, T): image rows their prompt's positions and on; text rows 0, 1, … in each axis; padding
        # 1 (as the model's get_rope_index fills it; masked out, so any value would do)
        width = tensors["input_ids"].shape[1]
        positions = torch.ones((len(batch), 3, width), dtype=torch.long)
        for i, r in enumerate(batch):
            n = len(r.token_ids)
            row = r.vision.context_positions(n) if r.vision is not None else torch.arange(n).expand(3, n)
            positions[i, :, width - n:] = row
        tensors["position_ids"] = positions.to(tensors["input_ids"].device)
        inputs, data = np.empty(len(batch), dtype=object), np.empty(len(batch), dtype=object)
        inputs[:] = [r.vision.multi_modal_inputs if r.vision is not None else {} for r in batch]
        data[:] = [(r.vision.multi_modal_data or {}) if r.vision is not None else {} for r in batch]
        non_tensors = {"multi_modal_inputs": inputs}
        if any(r.vision is not None and r.vision.multi_modal_data for r in batch):
            non_tensors["multi_modal_data"] = data
        return DataProto.from_dict(tensors=tensors, non_tensors=non_tensors, meta_info=meta)

