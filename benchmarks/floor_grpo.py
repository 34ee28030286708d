"""The floor: GRPO written by hand in one file, plain PyTorch around a Hugging Face causal LM.

No framework, no config system, no worker processes, no data containers: the least code that does
the benchmark's GRPO step, written to be fast, so that (rlfoundry step time) / (floor step time)
measures what the framework costs. One step:

  1. sample: prefill each prompt once, repeat its KV cache for its n samples, decode token by
     token from the cache (only the last position's logits), and drop a row from the batch as soon
     as it emits EOS;
  2. reward: decode each response and score it with the task's scorer;
  3. advantages: GRPO, (score − group mean) / (group std + ε) with the unbiased std;
  4. update: one forward over prompt + response with logits for the response positions only,
     log-probs of the sampled tokens, token-mean PPO-clip loss (dual clip for A < 0), backward,
     grad-norm clip, AdamW step.

Old log-probs: with one epoch over one mini-batch the policy that sampled is the policy being
trained, so pi_old = sg(pi) exactly and no separate no-grad pass is needed: the ratio is 1 in
value and the gradient is A * grad log pi (the clip can only bind from the second epoch on).

    python -m benchmarks.floor_grpo                 # the default workload, standalone
    python -m benchmarks.floor_grpo --spec S --out R  # as a benchmark runner (benchmarks.common)
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

# ───────────────────────────────────────── the math ─────────────────────────────────────────


def grpo_advantages(scores: torch.Tensor, n: int, eps: float = 1e-6) -> torch.Tensor:
    """(B·n,) outcome scores, rows of a prompt contiguous -> (B·n,) GRPO advantages.

    Shao et al. 2024 (DeepSeekMath, §4.1.2): A_i = (r_i − mean_g) / (std_g + eps), unbiased std.
    """
    groups = scores.view(-1, n)
    mean = groups.mean(dim=1, keepdim=True)
    std = groups.std(dim=1, keepdim=True)
    return ((groups - mean) / (std + eps)).view(-1)


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, clip_low: float, clip_high: float, clip_ratio_c: float = 3.0) -> torch.Tensor:
    """Token-mean PPO-clip loss over the valid tokens. All (B, T); returns a scalar.

    Per token max(−A r, −A clip(r, 1−eps_low, 1+eps_high)) (Schulman et al. 2017), capped at −A c
    for A < 0 (dual clip, Ye et al. 2020); log r is clamped to ±20 so exp cannot overflow.
    """
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    loss = torch.maximum(-advantages * ratio, -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = torch.where(advantages < 0, torch.minimum(loss, -advantages * clip_ratio_c), loss)
    mask = mask.to(loss.dtype)
    return (loss * mask).sum() / mask.sum().clamp(min=1.0)


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T) at ``tokens``. logits (B, T, V), tokens (B, T) -> (B, T) fp32."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


# ───────────────────────────────────────── sampling ─────────────────────────────────────────


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
        mask[i, width - len(s):] = 1
    return ids, mask


@torch.no_grad()
def sample(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, n: int, max_new_tokens: int,
           eos_id: int, pad_id: int, temperature: float,
           generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n samples per prompt. (B, Tp) left-padded prompts -> responses (B·n, max_new_tokens), lengths (B·n,).

    Responses are right-padded with ``pad_id``; a length counts the EOS token.
    """
    from transformers import DynamicCache

    total = input_ids.shape[0] * n
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions,
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    cache.batch_repeat_interleave(n)  # one prefill per prompt, shared by its n samples
    logits = logits.repeat_interleave(n, dim=0)
    mask = attention_mask.repeat_interleave(n, dim=0)
    next_pos = positions[:, -1].repeat_interleave(n, dim=0) + 1
    rows = torch.arange(total)  # output row of each row still in the cache
    responses = torch.full((total, max_new_tokens), pad_id, dtype=torch.long)
    lengths = torch.full((total,), max_new_tokens, dtype=torch.long)
    for t in range(max_new_tokens):
        probs = torch.softmax(logits / temperature if temperature != 1.0 else logits, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        responses[rows, t] = tokens
        if t == max_new_tokens - 1:
            break
        done = tokens == eos_id
        if bool(done.any()):
            lengths[rows[done]] = t + 1
            keep = (~done).nonzero().squeeze(1)
            if keep.numel() == 0:
                break
            cache.batch_select_indices(keep)
            rows, tokens, mask, next_pos = rows[keep], tokens[keep], mask[keep], next_pos[keep]
        mask = torch.cat([mask, mask.new_ones(len(rows), 1)], dim=1)
        logits = model(input_ids=tokens.unsqueeze(1), attention_mask=mask, position_ids=next_pos.unsqueeze(1),
                       past_key_values=cache, use_cache=True).logits[:, -1]
        next_pos = next_pos + 1
    return responses, lengths


# ───────────────────────────────────────── one step ─────────────────────────────────────────


def update(model, optimizer, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor,
           lengths: torch.Tensor, advantages: torch.Tensor, clip: float, grad_clip: float,
           temperature: float) -> float:
    """One PPO epoch = one optimiser step on the whole batch. Returns the loss."""
    width = int(lengths.max())
    responses = responses[:, :width]
    response_mask = (torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)).long()
    ids = torch.cat([prompt_ids, responses], dim=1)
    mask = torch.cat([prompt_mask, response_mask], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    # logits at positions Tp-1 .. Tp+width-2 predict the response tokens: keep width+1, drop the last
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions, logits_to_keep=width + 1).logits[:, :-1]
    log_prob = token_log_probs(logits, responses, temperature)
    loss = ppo_clip_loss(log_prob, log_prob.detach(), advantages.unsqueeze(1), response_mask, clip, clip)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss.detach())


def main(argv: Sequence[str] | None = None) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from benchmarks.common import StepClock, load_prompts, runner_args
    from rlfoundry.rewards.arithmetic import compute_score

    w, prepared, out, _ = runner_args(argv, "hand-written GRPO floor")
    if w.device != "cpu":  # its sampler and update build their tensors on the CPU
        raise SystemExit(f"the floor runs on the CPU only (workload device {w.device!r}); "
                         "compare rlfoundry and TRL on a GPU (--frameworks rlfoundry trl)")
    torch.manual_seed(w.seed)
    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    model = AutoModelForCausalLM.from_pretrained(prepared.model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=w.lr, betas=(0.9, 0.999), eps=1e-8,
                                  weight_decay=w.weight_decay, foreach=True)
    rows = load_prompts(prepared.train_file)
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m, _ in rows]
    prompt_tokens = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    generator = torch.Generator().manual_seed(w.seed)
    pad_id, eos_id, P, n = tokenizer.pad_token_id, tokenizer.eos_token_id, w.prompts_per_step, w.n
    clock = StepClock("floor")

    for step in range(w.steps):
        clock.step_begin()
        t0 = time.perf_counter()
        batch = slice(step * P, (step + 1) * P)
        ids, mask = left_pad(prompt_tokens[batch], pad_id)
        model.eval()
        responses, lengths = sample(model, ids, mask, n, w.max_response_length, eos_id, pad_id, w.temperature,
                                    generator)
        t1 = time.perf_counter()
        texts = tokenizer.batch_decode([r[:k].tolist() for r, k in zip(responses, lengths.tolist())],
                                       skip_special_tokens=True)
        truths = [truth for _, truth in rows[batch] for _ in range(n)]
        scores = torch.tensor([compute_score(s, g) for s, g in zip(texts, truths)], dtype=torch.float32)
        t2 = time.perf_counter()
        advantages = grpo_advantages(scores, n)
        model.train()
        update(model, optimizer, ids.repeat_interleave(n, 0), mask.repeat_interleave(n, 0), responses, lengths,
               advantages, w.clip_ratio, w.grad_clip, w.temperature)
        t3 = time.perf_counter()
        clock.step_end(int(lengths.sum()), len(texts), float(scores.mean()),
                       phases={"gen": t1 - t0, "reward": t2 - t1, "update_actor": t3 - t2, "step": t3 - t0})
    clock.save(out)


if __name__ == "__main__":
    main()
