"""Routing replay for mixture-of-experts models: record the experts each token was sent to, and run a
later forward with those experts instead of the router's own top-k (verl's ``router_replay``).

Why: a token's log-prob depends on which experts it went through. The rollout engine (another dtype,
other kernels, weights one sync behind) can pick a different top-k than the trainer for the same
token; the trainer then scores a path the sampler never took, and the importance ratio is off for
reasons no clipping knows about ("rollout routing replay", R3: Ma et al., 2025, arXiv:2510.11370).

Semantics, per router call of ``N`` tokens with top-``k`` routing over ``E`` experts:

- *record*: the router's own indices (N, k) are kept, one tensor per MoE layer in model order;
- *replay*: given indices (N, k) replace the router's; the gate weights are still the router's own
  softmax over its logits, taken at the given indices and renormalised over them where the model's
  ``norm_topk_prob`` says so. So the router keeps its gradient through the weights of the experts
  used, as Megatron's replayed ``topk_routing_with_score_function`` does. A given index < 0
  (``NO_EXPERT``: padding, or a position the rollout never fed through the model) keeps the
  router's own choice for that token.

The hook sits on transformers' router modules, whose forward returns (logits, weights, indices):
``Qwen3MoeTopKRouter`` and ``Qwen2MoeTopKRouter`` (transformers 5). A model without one of them has
no routing to record, and asking to replay on it is an error.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["NO_EXPERT", "ROUTER_CLASSES", "RoutingReplay", "attach", "engine_routes", "route_dtype", "routers",
           "response_token_mask", "routing_replay_of"]

# The routers whose forward returns (router_logits (N, E), weights (N, k), indices (N, k)).
ROUTER_CLASSES = ("Qwen3MoeTopKRouter", "Qwen2MoeTopKRouter")

# A position with no recorded routing in ``routed_experts``: the replay keeps the router's own top-k there.
NO_EXPERT = -1

_ATTR = "_routing_replay"


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's top-k routers, in layer order (module registration order); FSDP2's ``fully_shard`` renames
    a module's class ``FSDP<name>``, so a router sharded on its own is still found."""
    return [m for m in model.modules() if type(m).__name__.removeprefix("FSDP") in ROUTER_CLASSES]


class RoutingReplay:
    """The routing state shared by the hooks on one model's routers.

    ``mode`` None: the hooks do nothing. ``record``: each router's indices are kept (``take``).
    ``replay``: ``tokens`` (N, L, k) replace them, layer ``l`` reading ``tokens[:, l]``.
    While replaying under ``torch.no_grad`` (a log-prob pass, not a training forward or its
    recomputation), the tokens flagged in ``counted`` are tallied per batch row: how many the router
    itself would have sent to another expert set in at least one layer, out of how many had a
    record (``row_stats``).
    """

    def __init__(self, model_routers: list[nn.Module]):
        self.routers = model_routers
        self.mode: str | None = None
        self.grid_indices: torch.Tensor | None = None  # a packed recorded forward's tokens in the (b·T) grid
        self.records: list[torch.Tensor | None] = [None] * len(model_routers)
        self.tokens: torch.Tensor | None = None
        self.counted: torch.Tensor | None = None
        self.token_rows: torch.Tensor | None = None  # (N,) the batch row of each replayed token
        self.num_rows = 0
        self._changed_now: torch.Tensor | None = None
        self._stats: dict[str, torch.Tensor] | None = None
        for layer, router in enumerate(model_routers):
            router.register_forward_hook(self._hook(layer))

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @property
    def top_k(self) -> int:
        return int(self.routers[0].top_k)

    # ---- modes -----------------------------------------------------------------------------

    def record(self) -> None:
        self.mode, self.records, self.grid_indices = "record", [None] * self.num_layers, None

    def replay(self, tokens: torch.Tensor, counted: torch.Tensor | None = None) -> None:
        """Replay ``tokens`` (N, L, k) (or (b, T, L, k), flattened in row order as the model flattens its
        hidden states) from the next forward on; ``counted`` (N,) or (b, T): tokens the stats count."""
        if tokens.shape[-2:] != (self.num_layers, self.top_k):
            raise ValueError(f"routed_experts has (layers, top_k) = {tuple(tokens.shape[-2:])}, but the model routes "
                             f"{self.num_layers} MoE layers with top-{self.top_k}: the batch was recorded on "
                             "another model (check actor_rollout_ref.model.path and the rollout's model)")
        self.mode, self._stats = "replay", None
        self.tokens = tokens.reshape(-1, self.num_layers, self.top_k)
        self.counted = None if counted is None else counted.reshape(-1).bool()
        self.num_rows = tokens.shape[0] if tokens.dim() == 4 else 1
        self.token_rows = torch.arange(self.num_rows, device=tokens.device).repeat_interleave(
            self.tokens.shape[0] // self.num_rows)

    def select_tokens(self, indices: torch.Tensor) -> None:
        """Keep the replayed tokens ``indices`` of the flat grid, in that order: a forward that packs
        real tokens (padding removal) gathers the routing exactly as it gathers ``input_ids``. When
        recording: the next forward's tokens are those of the grid (``recorded_grid``)."""
        if self.mode == "record":
            self.grid_indices = indices
        if self.mode == "replay":
            self.tokens, self.token_rows = self.tokens[indices], self.token_rows[indices]
            self.counted = None if self.counted is None else self.counted[indices]

    def off(self) -> None:
        self.mode, self.tokens, self.counted, self.token_rows = None, None, None, None
        self.records = [None] * self.num_layers

    def take(self) -> torch.Tensor:
        """The recorded indices of the last forward, (N, L, k), and a fresh record."""
        if any(r is None for r in self.records):
            raise RuntimeError("routing replay: no routing recorded for some MoE layer (was the forward run in "
                               "record mode?)")
        out = torch.stack(self.records, dim=1)
        self.records = [None] * self.num_layers
        return out

    def recorded_grid(self, shape: tuple[int, int]) -> torch.Tensor:
        """The last forward's record on its (b, T) grid: (b, T, L, k), NO_EXPERT where the forward ran no token."""
        taken = self.take()
        if self.grid_indices is None:
            return taken.view(*shape, self.num_layers, self.top_k)
        grid = taken.new_full((shape[0] * shape[1], self.num_layers, self.top_k), NO_EXPERT)
        grid[self.grid_indices] = taken
        self.grid_indices = None
        return grid.view(*shape, self.num_layers, self.top_k)

    def row_stats(self) -> dict[str, torch.Tensor]:
        """Of the last replayed forward under no_grad, per batch row (b,) fp32: ``routing_changed_tokens``
        (counted tokens the router would route to another expert set in at least one layer) and
        ``routing_counted_tokens`` (counted tokens with a record); {} when nothing was tallied."""
        out, self._stats = self._stats or {}, None
        return out

    # ---- the hook --------------------------------------------------------------------------

    def _hook(self, layer: int):
        def hook(module: nn.Module, _inputs, output):
            if self.mode == "record":
                self.records[layer] = output[2].detach()
                return None
            if self.mode == "replay":
                return self._replayed(module, layer, output)
            return None

        return hook

    def _replayed(self, router: nn.Module, layer: int, output: tuple) -> tuple:
        logits, _weights, own = output
        given = self.tokens[:, layer].to(device=own.device, dtype=own.dtype)
        if given.shape[0] != own.shape[0]:
            raise ValueError(f"routing replay: {given.shape[0]} tokens of routed_experts for a router call of "
                             f"{own.shape[0]} tokens (the forward laid its tokens out differently from the batch)")
        chosen = torch.where(given >= 0, given, own)
        # the router's own arithmetic (softmax in fp32, gather, renormalise, back to the logits' dtype)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        weights = probs.gather(-1, chosen)
        if getattr(router, "norm_topk_prob", False):
            weights = weights / weights.sum(dim=-1, keepdim=True)
        if not torch.is_grad_enabled() and self.counted is not None:
            self._tally(layer, own, given)
        return logits, weights.to(logits.dtype), chosen

    def _tally(self, layer: int, own: torch.Tensor, given: torch.Tensor) -> None:
        """Tokens whose own top-k *set* differs from the replayed one (order within top-k is not routing),
        summed per batch row after the last layer."""
        counted = self.counted.to(own.device) & (given >= 0).all(-1)
        differs = (own.sort(-1).values != given.sort(-1).values).any(-1) & counted
        self._changed_now = differs if layer == 0 else self._changed_now | differs
        if layer == self.num_layers - 1:
            rows = self.token_rows.to(own.device)
            per_row = own.new_zeros(self.num_rows, dtype=torch.float32)
            self._stats = {"routing_changed_tokens": per_row.index_add(0, rows, self._changed_now.float()),
                           "routing_counted_tokens": per_row.index_add(0, rows, counted.float())}


def routing_replay_of(model: nn.Module) -> RoutingReplay | None:
    """The replay state attached to ``model`` (None if never attached)."""
    return model.__dict__.get(_ATTR)


def attach(model: nn.Module) -> RoutingReplay:
    """The model's routing-replay state, its hooks installed on the first call."""
    state = routing_replay_of(model)
    found = routers(model)
    if state is not None and len(state.routers) == len(found) and all(a is b for a, b in zip(state.routers, found)):
        return state
    if not found:
        raise ValueError(f"routing replay: {type(model).__name__} has no MoE router of a supported kind "
                         f"({', '.join(ROUTER_CLASSES)}); set actor_rollout_ref.actor.router_replay.mode=disabled "
                         "and actor_rollout_ref.rollout.enable_rollout_routing_replay=false for a dense model")
    state = RoutingReplay(found)
    model.__dict__[_ATTR] = state
    return state


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[RoutingReplay]:
    """Record the routing of the forwards in the block (``take`` after each one)."""
    state = attach(model)
    state.record()
    try:
        yield state
    finally:
        state.off()


def response_token_mask(attention_mask: torch.Tensor, response_width: int) -> torch.Tensor:
    """(b, T) bool: the real tokens among the last ``response_width`` columns (the responses)."""
    counted = torch.zeros_like(attention_mask, dtype=torch.bool)
    counted[:, attention_mask.shape[1] - response_width:] = attention_mask[:, attention_mask.shape[1] - response_width:].bool()
    return counted


class RolloutRouting:
    """The routing of a rollout's prompts and sampled tokens, laid out as the batch it returns:
    ``routed_experts`` (N, Tp+Tr, L, k), ``NO_EXPERT`` wherever no token of the row was routed
    (padding, and a response's last token, which is sampled but never fed back).

    ``rows``: output rows; ``slots``: rows the buffer holds besides them (a static decode's padding
    slots write there and are dropped, so a step never reads which slot is real).
    """

    def __init__(self, model: nn.Module, rows: int, prompt_width: int, response_length: int,
                 device: torch.device, lead: int = 0, slots: int = 0):
        self.state = attach(model)
        self.rows, self.prompt_width, self.lead = rows, prompt_width, lead
        shape = (rows + slots, prompt_width + response_length, self.state.num_layers, self.state.top_k)
        self.routes = torch.full(shape, NO_EXPERT, dtype=route_dtype(int(self.state.routers[0].num_experts)),
                                 device=device)
        self.state.record()

    def prefill(self, mask: torch.Tensor, n: int) -> None:
        """After the prompts' forward: (B, Tp - lead) ``mask`` of the prompt columns it ran (those after
        the ``lead`` columns that are padding in every row); each prompt's routing goes to its ``n`` samples."""
        lead = self.lead
        b, t = mask.shape
        taken = self.state.take().view(b, t, self.state.num_layers, self.state.top_k)
        taken = taken.masked_fill(~mask.bool()[..., None, None], NO_EXPERT).repeat_interleave(n, dim=0)
        self.routes[: self.rows, lead: lead + t] = taken.to(self.routes.dtype)

    def step(self, rows: torch.Tensor, t: int) -> None:
        """After the forward of response token ``t`` (one per batch row; ``rows``: their output rows)."""
        self.routes[:, self.prompt_width + t].index_copy_(0, rows, self.state.take().to(self.routes.dtype))

    def finish(self, lengths: torch.Tensor) -> torch.Tensor:
        """(N, Tp+Tr, L, k) with the columns past each row's last fed token (length - 1) set to NO_EXPERT."""
        self.state.off()
        routes = self.routes[: self.rows]
        width = routes.shape[1] - self.prompt_width
        fed = torch.arange(width, device=routes.device)[None] < (lengths[:, None] - 1)
        routes[:, self.prompt_width:].masked_fill_(~fed[..., None, None], NO_EXPERT)
        return routes

    def abandon(self) -> None:
        self.state.off()


def route_dtype(num_experts: int) -> torch.dtype:
    """The batch's ``routed_experts`` dtype: int16 where every expert index fits (a quarter of long's bytes
    for a tensor of tokens × layers × k), else long."""
    return torch.int16 if num_experts < torch.iinfo(torch.int16).max else torch.long


def engine_routes(samples: list[torch.Tensor], prompt_mask: torch.Tensor, n: int, lengths: torch.Tensor,
                  response_length: int, num_experts: int) -> torch.Tensor:
    """A serving engine's per-sample routing laid out as ``RolloutRouting.finish`` lays out the HF engine's.

    ``samples[i]`` (T_i, L, k): the experts of sample i's fed tokens in order, its prompt's real tokens
    then each response token but the last (SGLang's ``routed_experts``: rows ``[0, seqlen - 1)``);
    ``prompt_mask`` (B, Tp): the left-padded prompts' attention mask, sample i coming from prompt i // n;
    ``lengths`` (B·n,) the response lengths. Returns (B·n, Tp + Tr, L, k), ``NO_EXPERT`` at padding and
    past each response's last fed token. A sample whose row count is not its prompt's tokens plus its
    length - 1 is an error: the tokens and their routing would be misaligned."""
    rows, (_, prompt_width) = len(samples), prompt_mask.shape
    layers, k = samples[0].shape[1:] if samples else (0, 0)
    routes = torch.full((rows, prompt_width + response_length, layers, k), NO_EXPERT, dtype=route_dtype(num_experts))
    for i, sample in enumerate(samples):
        prompt = prompt_mask[i // n].bool()
        real, fed = int(prompt.sum()), max(int(lengths[i]) - 1, 0)
        if sample.shape[0] != real + fed:
            raise RuntimeError(f"the engine returned the routing of {sample.shape[0]} tokens for sample {i}, whose "
                               f"prompt has {real} tokens and response {int(lengths[i])}: expected {real + fed}")
        routes[i, :prompt_width][prompt.cpu()] = sample[:real].to(routes.dtype)
        routes[i, prompt_width: prompt_width + fed] = sample[real:].to(routes.dtype)
    return routes
