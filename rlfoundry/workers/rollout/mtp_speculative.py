"""Speculative decoding with MiMo's MTP layers as the draft, for the HF rollout engine
(verl's ``actor_rollout_ref.model.mtp.enable_rollout``; docs/rollout.md#speculative-decoding-with-the-mtp-layers).

A round, per row, with x the last emitted token (sampled, not yet fed to the target) at position n:

1. draft: MTP layer 0 (``models/mimo.MtpLayer``) turns (target hidden h_{n-1}, x) into a distribution q_1
   over the token after x and samples d_1 from it; then, as SGLang's and vLLM's MTP drafting do with
   one layer, it runs again on its own output and d_1 for d_2, ... d_k (k = ``num_speculative_tokens``);
2. verify: one target forward over [x, d_1 … d_k] gives p_0 … p_k;
3. accept d_j with probability min(1, p_{j-1}(d_j) / q_j(d_j)) while they hold; at the first rejection
   sample from norm(max(0, p_{j-1} - q_j)), or when all k hold a bonus token from p_k (Leviathan et al.
   2023; Chen et al. 2023): every emitted token is distributed as the target's own sample would be.
   Temperature, top-k and top-p shape p and q alike (``filter_logits``); greedy accepts d_j iff it is
   p_{j-1}'s argmax and emits p_a's argmax, so it reproduces plain greedy decoding.

Reported log-probs are the target's, at each emitted token, under softmax(logits / T) before filtering
(as ``sample_tokens`` reports them).

Ragged acceptance: rows accept different counts. Each round appends k + 1 columns to the target's KV
cache for every row, and the columns of its rejected drafts stay in the cache as *holes*: masked out of
every later attention (the row's attention mask is 0 there, positions continue per row). Taking the batch's
minimum instead would throw away every other row's accepted tokens, and the minimum over many rows is
mostly 0. The cost: a cache of prompt + (k + 1) · response_length columns at worst. The draft's own cache
(one MTP layer) keeps, per position, the pair (target hidden h_s, token s+1): each round's first draft call
feeds the pairs of the tokens the previous round accepted (k + 1 columns, holes past the row's count),
and its later calls' columns (fed the draft's own hidden states) become holes after the round.

Finished rows leave both caches at the end of the round they finish in.
"""

from __future__ import annotations

import torch
from torch import nn

from rlfoundry.models.hf import kv_cache_kwargs
from rlfoundry.workers.rollout.sampling import filter_logits, response_mask_from_lengths, sample_from_cdf
from rlfoundry.workers.rollout.static_decode import draw_uniforms

__all__ = ["MtpSpeculator", "draws_per_token"]


def draws_per_token(k: int) -> int:
    """Uniforms a round takes per row: k draft samples, k acceptance tests, one last token."""
    return 2 * k + 1


class _Parts:
    """The target's pieces the draft shares: token embedding, rotary embedding, final norm, lm_head."""

    def __init__(self, module: nn.Module):
        base = module.get_base_model() if hasattr(module, "get_base_model") else module
        inner = base.model
        self.embed, self.rotary, self.norm, self.lm_head = inner.embed_tokens, inner.rotary_emb, inner.norm, base.lm_head


class MtpSpeculator:
    """Draft with ``draft.layers[0]`` ``k`` tokens a round; verify with ``module`` (the target). ``new_cache(config,
    capacity)``: the engine's KV cache (``hf_rollout._new_kv_cache``), one for the target and one for the draft."""

    def __init__(self, module: nn.Module, draft: nn.Module, k: int, new_cache):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {k}")
        self.module, self.draft, self.k, self.new_cache = module, draft, int(k), new_cache

    # ---- the two models -------------------------------------------------------------------

    def _target(self, parts: _Parts, ids, mask, pos, cache, keep: int):
        """The target over ``ids`` (N, m): the last ``keep`` positions' fp32 logits and the hidden states
        after the final norm at all m, (N, m, H)."""
        seen = {}
        handle = parts.norm.register_forward_hook(lambda _m, _i, out: seen.__setitem__("h", out))
        try:
            out = self.module(input_ids=ids, attention_mask=mask, position_ids=pos, **kv_cache_kwargs(self.module, cache),
                              use_cache=True, logits_to_keep=keep)
        finally:
            handle.remove()
        return out.logits[:, -keep:].float(), seen["h"]

    def _draft_call(self, parts: _Parts, hidden, tokens, pos, valid) -> torch.Tensor:
        """MTP layer 0 over m new columns (N, m, ·): appended to the draft cache with their validity;
        each attends to the valid columns at or before it. Returns (N, m, H)."""
        layer = self.draft.layers[0]
        m, old = hidden.shape[1], self._dlen
        self._dvalid[:, old: old + m] = valid
        self._dlen = old + m
        keys = self._dvalid[:, : self._dlen]
        causal = torch.arange(self._dlen, device=keys.device) <= (old + torch.arange(m, device=keys.device)).unsqueeze(1)
        dtype = layer.input_proj.weight.dtype
        allowed = keys.unsqueeze(1) & causal.unsqueeze(0)  # (N, m, K)
        mask = torch.zeros(allowed.shape, dtype=dtype, device=keys.device).masked_fill_(~allowed, torch.finfo(dtype).min)
        hidden = hidden.to(dtype)
        embeds = parts.embed(tokens).to(dtype)
        rotary = parts.rotary(hidden, pos)
        return layer(hidden, embeds, mask.unsqueeze(1), rotary, self._dcache)

    # ---- sampling -------------------------------------------------------------------------

    @staticmethod
    def _probs(logits: torch.Tensor, params) -> torch.Tensor:
        """The sampling distribution (…, V) of fp32 logits: temperature, then top-k / top-p (``filter_logits``)."""
        shape = logits.shape
        flat = filter_logits(logits.reshape(-1, shape[-1]) / params.temperature, params.top_k, params.top_p)
        return torch.softmax(flat, dim=-1).reshape(shape)

    def _pick(self, probs: torch.Tensor, generator, total: int) -> torch.Tensor:
        return sample_from_cdf(probs.cumsum(dim=-1), None, draw_uniforms(generator, total, self._rows))

    def _propose(self, parts: _Parts, out: torch.Tensor, params, generator, total: int):
        """One draft token per row from MTP output (N, H): its token and (sampling mode) distribution q."""
        logits = parts.lm_head(out.to(parts.lm_head.weight.dtype)).float()
        if params.greedy:
            return logits.argmax(dim=-1), None
        q = self._probs(logits, params)
        return self._pick(q, generator, total), q

    def _accept(self, logits, drafts, qs, params, generator, total):
        """Rows' accepted counts a (N,) and the token after them: the correction or the bonus (N,)."""
        k, rows = self.k, torch.arange(drafts.shape[0], device=drafts.device)
        if params.greedy:
            best = logits.argmax(dim=-1)  # (N, k+1)
            a = (drafts == best[:, :k]).long().cumprod(dim=1).sum(dim=1)
            return a, best[rows, a]
        p = self._probs(logits, params)  # (N, k+1, V)
        q = torch.stack(qs, dim=1)  # (N, k, V)
        p_d = p[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        q_d = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
        u = torch.cat([draw_uniforms(generator, total, self._rows) for _ in range(k)], dim=1)
        a = (u * q_d < p_d).long().cumprod(dim=1).sum(dim=1)  # u < p/q, q > 0 where d was drawn
        p_a = p[rows, a]
        residual = torch.where((a < k).unsqueeze(1), (p_a - q[rows, a.clamp(max=k - 1)]).clamp_(min=0), p_a)
        # a rejection means p(d) < q(d), so the residual has mass; rounding alone could leave none
        residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_a)
        return a, self._pick(residual, generator, total)

    # ---- the loop -------------------------------------------------------------------------

    def decode(self, rollout, input_ids, attention_mask, position_ids, params, generator, pad_id: int, eos_ids,
               tops=None):
        """``HFRollout._decode``'s contract (responses, log-probs, lengths: (N, width), (N, width), (N,)) plus
        each output row's drafted and accepted token counts (N,) each. ``rollout``: the HFRollout (its
        ``_sample`` for the first token)."""
        if position_ids.dim() != 2:
            raise ValueError("MTP speculative decoding takes (B, T) position ids (no multimodal rope)")
        parts, k, n = _Parts(self.module), self.k, params.n
        total, width, device = input_ids.shape[0] * n, params.response_length, input_ids.device
        prompt = input_ids.shape[1]
        config = getattr(self.module, "config", None)
        cache = self.new_cache(config, prompt + width * (k + 1) + 1)
        self._dcache = self.new_cache(config, prompt + width * 2 * k + 2)
        logits0, hidden = self._target(parts, input_ids, attention_mask, position_ids, cache, keep=1)
        if n > 1:
            cache.batch_repeat_interleave(n)
        input_ids, attention_mask, position_ids, hidden, logits0 = (
            t.repeat_interleave(n, dim=0) for t in (input_ids, attention_mask, position_ids, hidden, logits0[:, -1]))
        eos = torch.tensor(eos_ids or [-1], device=device)
        responses = torch.full((total, width), pad_id, dtype=torch.long, device=device)
        log_probs = torch.zeros((total, width), dtype=torch.float32, device=device)
        lengths = torch.full((total,), width, dtype=torch.long, device=device)
        drafted = torch.zeros(total, dtype=torch.long, device=device)
        accepted = torch.zeros(total, dtype=torch.long, device=device)
        self._rows = torch.arange(total, device=device)
        # the first token: the engine's own sampling (FIRE's first-token temperature included)
        uniforms = None if params.greedy else draw_uniforms(generator, total, self._rows)
        token, token_lp = rollout._sample(logits0, params.for_token(0), generator, uniforms)
        responses[:, 0], log_probs[:, 0] = token, token_lp
        if tops is not None:
            first = logits0.float().unsqueeze(1) / params.for_token(0).logprob_temperature
            self._top(tops, first, torch.zeros(total, 1, dtype=torch.long, device=device),
                      torch.ones(total, 1, dtype=torch.bool, device=device))
        params = params.for_token(1)  # every later token's settings
        done = torch.isin(token, eos)
        lengths[done] = 1
        count = torch.ones(total, dtype=torch.long, device=device)
        tvalid = torch.cat([attention_mask.bool(), attention_mask.new_zeros(total, width * (k + 1) + 1).bool()], dim=1)
        tlen = prompt
        self._dvalid = torch.zeros(total, prompt + width * 2 * k + 2, dtype=torch.bool, device=device)
        self._dlen = 0
        next_pos = position_ids[:, -1] + 1  # the pending token's
        # the draft's first input: (h_s, token s+1) over the prompt
        feed = (hidden, torch.cat([input_ids[:, 1:], token.unsqueeze(1)], dim=1), position_ids, attention_mask.bool(),
                torch.full((total,), prompt - 1, dtype=torch.long, device=device))
        steps = torch.arange(k + 1, device=device)
        live = ~done & (width > 1)
        while bool(live.any()):
            if not bool(live.all()):  # finished rows leave the caches
                keep = live.nonzero().squeeze(1)
                cache.batch_select_indices(keep)
                self._dcache.batch_select_indices(keep)
                tvalid, self._dvalid, self._rows = tvalid[keep], self._dvalid[keep], self._rows[keep]
                token, next_pos, count = token[keep], next_pos[keep], count[keep]
                feed = tuple(t[keep] for t in feed)
            drafts, qs = self._draft_round(parts, feed, params, generator, total)  # 1. draft k tokens
            # 2. verify with one target forward
            fed = torch.cat([token.unsqueeze(1), drafts], dim=1)
            tvalid[:, tlen: tlen + k + 1] = True
            logits, hidden = self._target(parts, fed, tvalid[:, : tlen + k + 1].long(), next_pos.unsqueeze(1) + steps,
                                          cache, keep=k + 1)
            # 3. accept
            a, nxt = self._accept(logits, drafts, qs, params, generator, total)
            emitted = torch.cat([drafts, drafts[:, :1]], dim=1).scatter_(1, a.unsqueeze(1), nxt.unsqueeze(1))
            kept = steps <= a.unsqueeze(1)  # (N, k+1): d_1 … d_a and the last token
            tvalid[:, tlen: tlen + k + 1] = kept
            tlen += k + 1
            is_eos = torch.isin(emitted, eos) & kept
            write = self._emit((responses, log_probs, tops), logits, emitted, kept, is_eos, count, params)
            drafted[self._rows] += k
            accepted[self._rows] += a
            count = count + write.sum(dim=1)
            finished = (is_eos & write).any(dim=1) | (count >= width)
            lengths[self._rows[finished]] = count[finished]
            live = ~finished
            feed = (hidden, emitted, next_pos.unsqueeze(1) + steps, kept, a)
            token, next_pos = nxt, next_pos + a + 1
        self._dcache = self._dvalid = None
        valid = response_mask_from_lengths(lengths, width).bool()
        return responses.masked_fill_(~valid, pad_id), log_probs.masked_fill_(~valid, 0.0), lengths, drafted, accepted

    def _draft_round(self, parts, feed, params, generator, total: int):
        """A round's k drafts (N, k) and their distributions q (k × (N, V)): MTP layer 0 on ``feed``'s pairs, then
        on its own output and draft, as SGLang's and vLLM's single-layer MTP drafting do."""
        h, toks, pos, valid, last = feed
        rows = torch.arange(len(self._rows), device=h.device)
        out = self._draft_call(parts, h, toks, pos, valid)[rows, last]
        drafts, qs = [], []
        for j in range(self.k):
            d, q = self._propose(parts, out, params, generator, total)
            drafts.append(d)
            qs.append(q)
            if j < self.k - 1:
                out = self._draft_call(parts, out.unsqueeze(1), d.unsqueeze(1), (pos[rows, last] + 1 + j).unsqueeze(1),
                                       torch.ones(len(rows), 1, dtype=torch.bool, device=h.device))[:, 0]
        if self.k > 1:  # fed the draft's own hidden states: not the pairs later rounds attend to
            self._dvalid[:, self._dlen - (self.k - 1): self._dlen] = False
        return torch.stack(drafts, dim=1), qs

    def _emit(self, outputs, logits, emitted, kept, is_eos, count, params) -> torch.Tensor:
        """Write each row's kept tokens and their target log-probs into ``outputs`` (responses, log-probs, tops)
        from column ``count`` up to its first EOS or the response length; returns the (N, k+1) mask written."""
        responses, log_probs, tops = outputs
        scaled = logits / params.logprob_temperature
        lp = scaled.gather(-1, emitted.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(scaled, dim=-1)
        cols = count.unsqueeze(1) + torch.arange(emitted.shape[1], device=emitted.device)
        before_eos = (is_eos.long().cumsum(dim=1) - is_eos.long()) == 0
        write = kept & before_eos & (cols < responses.shape[1])
        out_rows = self._rows.unsqueeze(1).expand_as(cols)[write]
        responses[out_rows, cols[write]] = emitted[write]
        log_probs[out_rows, cols[write]] = lp[write]
        if tops is not None:
            self._top(tops, scaled, cols, write)
        return write

    def _top(self, tops, scaled, cols, write) -> None:
        """Each written token's k most likely tokens and log-probs (``top_logprobs``), scaled (N, m, V)."""
        values, ids = torch.log_softmax(scaled.float(), dim=-1).topk(tops[0].shape[-1], dim=-1)
        out_rows = self._rows.unsqueeze(1).expand_as(cols)[write]
        tops[0][out_rows, cols[write]], tops[1][out_rows, cols[write]] = ids[write], values[write]
