"""Benchmark runner: TRL's ``GRPOTrainer`` on the shared workload (``benchmarks.common.Workload``).

Settings are chosen so that one TRL step is the benchmark's GRPO step and nothing more:

- one step = P prompts × n samples: ``per_device_train_batch_size = P·n``,
  ``gradient_accumulation_steps = 1`` (so ``generation_batch_size = P·n``, one generation and one
  optimiser step per step), ``num_generations = n``, ``num_iterations = 1`` (one PPO epoch; TRL
  then reuses sg(log pi) as the old log-probs, as the floor does);
- the same loss: ``loss_type="dapo"`` normalises the token sum by the number of valid tokens in the
  whole step, i.e. rlfoundry's ``token-mean``; ``epsilon`` = clip ratio; ``scale_rewards="group"``;
- no KL (``beta=0``: no reference model), no entropy bonus;
- the same optimiser: AdamW (TRL's default implementation), betas (0.9, 0.999), weight decay,
  constant LR, grad-norm clip;
- fp32 on CPU (TRL defaults to bf16 and gradient checkpointing: both switched off, as in the other
  frameworks); with ``--device cuda`` the fp32 model on the GPU with ``bf16=True`` (autocast: fp32
  master weights computing in bf16, as rlfoundry's FSDP2 mixed precision), gradient checkpointing
  still off; prompts in file order (``shuffle_dataset=False``), no logging, no checkpoints.

Per-step stamps come from a ``TrainerCallback`` (on_step_begin / on_step_end); generated tokens and
rewards are counted inside the reward function, which TRL calls once per step with all P·n samples.

Mismatch column: TRL (without vLLM) keeps no sampler log-probs, so this runner records them: a logits
processor added to ``generate`` keeps log softmax(scores / T) of each sampled token (transformers runs
a caller's processors before its temperature warper, hence the division; top-k/top-p are off here),
and the trainer's first log-prob pass of the step (the loss's, before the optimiser step) is compared
row by row. TRL shuffles the batch between the two, so rows are matched by their tokens.
"""

from __future__ import annotations

import time
from collections.abc import Sequence


def build_config(w, output_dir: str):
    import dataclasses

    from trl import GRPOConfig

    # transformers >= 5.2x's TrainingArguments has activation_checkpointing (off too); older ones lack it
    extra = {"activation_checkpointing": False} if any(
        f.name == "activation_checkpointing" for f in dataclasses.fields(GRPOConfig)) else {}
    return GRPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=w.samples_per_step,
        gradient_accumulation_steps=1,
        num_generations=w.n,
        max_completion_length=w.max_response_length,
        temperature=w.temperature, top_p=1.0, top_k=0,
        learning_rate=w.lr, weight_decay=w.weight_decay, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=w.grad_clip,
        num_iterations=1, beta=0.0, epsilon=w.clip_ratio, loss_type="dapo", scale_rewards="group",
        max_steps=w.steps, num_train_epochs=1, shuffle_dataset=False, seed=w.seed, data_seed=w.seed,
        use_cpu=w.device == "cpu", bf16=w.device == "cuda", fp16=False, gradient_checkpointing=False,
        report_to="none", logging_strategy="no", save_strategy="no", disable_tqdm=True, log_completions=False,
        dataloader_num_workers=0, remove_unused_columns=False, **extra,
    )


class SamplerLogProbs:
    """What TRL's sampler drew each token from, recorded around ``model.generate``; matched later to the
    trainer's log-probs of the same rows (``diff``). Keys are a row's valid tokens (prompt + response)."""

    def __init__(self, temperature: float):
        self.temperature, self.rows, self._prev, self._steps = temperature, {}, None, []

    def __call__(self, input_ids, scores):  # a transformers LogitsProcessor
        import torch

        if self._prev is not None:  # the token sampled from the previous step's distribution
            self._steps.append(self._prev.gather(-1, input_ids[:, -1:]))
        self._prev = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def wrap(self, generate):
        """``model.generate`` that also records the rollout's log-probs of what it sampled."""
        import torch
        from transformers import LogitsProcessorList

        def recorded_generate(*args, **kwargs):
            self._prev, self._steps = None, []
            kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), self])
            sequences = generate(*args, **kwargs)
            self._steps.append(self._prev.gather(-1, sequences[:, -1:]))
            config = kwargs.get("generation_config")
            eos = getattr(config, "eos_token_id", None)
            self._store(kwargs["input_ids"], kwargs["attention_mask"], sequences, torch.cat(self._steps, dim=1),
                        [eos] if isinstance(eos, int) else list(eos or []))
            return sequences

        return recorded_generate

    def _store(self, input_ids, attention_mask, sequences, log_probs, eos_ids) -> None:
        self.rows = {}
        width = input_ids.shape[1]
        for i in range(sequences.shape[0]):
            response = sequences[i, width:].tolist()
            length = next((t + 1 for t, tok in enumerate(response) if tok in eos_ids), len(response))
            key = tuple(input_ids[i][attention_mask[i].bool()].tolist() + response[:length])
            self.rows[key] = log_probs[i, :length].float().cpu()

    def diff(self, input_ids, attention_mask, trainer_log_probs) -> dict[str, float] | None:
        """max and mean |log p_rollout − log p_trainer| over the valid response tokens of the matched rows."""
        diffs = []
        width = trainer_log_probs.shape[1]  # the response columns end input_ids
        for i in range(input_ids.shape[0]):
            key = tuple(input_ids[i][attention_mask[i].bool()].tolist())
            rollout = self.rows.get(key)
            if rollout is not None:
                valid = attention_mask[i, -width:].bool()
                diffs.append((trainer_log_probs[i][valid].detach().float().cpu() - rollout).abs())
        if not diffs:
            return None
        import torch

        every = torch.cat(diffs)
        return {"max": float(every.max()), "mean": float(every.mean())} if every.numel() else None


def main(argv: Sequence[str] | None = None) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from benchmarks.common import StepClock, load_prompts, runner_args
    from rlfoundry.rewards.arithmetic import compute_score

    w, prepared, out, args = runner_args(argv, "TRL GRPOTrainer runner")
    rows = load_prompts(prepared.train_file)
    dataset = Dataset.from_dict({"prompt": [m for m, _ in rows], "ground_truth": [g for _, g in rows]})
    clock = StepClock("trl")
    step: dict = {}

    def arithmetic_reward(completions, ground_truth, completion_ids, **_):
        """The task's scorer; also counts this step's generated tokens (EOS included, as TRL keeps it)."""
        scores = [compute_score(c[0]["content"] if isinstance(c, list) else c, g)
                  for c, g in zip(completions, ground_truth)]
        step["tokens"] = step.get("tokens", 0) + sum(len(ids) for ids in completion_ids)
        step["samples"] = step.get("samples", 0) + len(scores)
        step["reward_sum"] = step.get("reward_sum", 0.0) + sum(scores)
        return scores

    sampler = SamplerLogProbs(w.temperature)

    class TimedGRPOTrainer(GRPOTrainer):
        """Times generation and generation+scoring (the rest of the step is the update); records the
        rollout-vs-trainer log-prob mismatch of the step (``SamplerLogProbs``)."""

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *a, **k):
            out = super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *a, **k)
            if model.training and "logprob_diff" not in step:  # the loss's pass, before the optimiser step
                diff = sampler.diff(input_ids, attention_mask, out[0])
                if diff is not None:
                    step["logprob_diff"] = diff
            return out

        def _generate_single_turn(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                step["gen"] = step.get("gen", 0.0) + time.perf_counter() - t0

        def _generate_and_score_completions(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return super()._generate_and_score_completions(*a, **k)
            finally:
                step["gen_and_score"] = step.get("gen_and_score", 0.0) + time.perf_counter() - t0

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            step.clear()
            step["t0"] = time.perf_counter()
            clock.step_begin()

        def on_step_end(self, *_, **__):
            total = time.perf_counter() - step["t0"]
            gen, scored = step.get("gen", 0.0), step.get("gen_and_score", 0.0)
            phases = {"gen": gen, "reward+adv": scored - gen, "update_actor": total - scored, "step": total}
            samples = step.get("samples", 0)
            clock.step_end(step.get("tokens", 0), samples, step.get("reward_sum", 0.0) / max(samples, 1), phases,
                           step.get("logprob_diff"))

    tokenizer = AutoTokenizer.from_pretrained(prepared.model_dir)
    model = AutoModelForCausalLM.from_pretrained(prepared.model_dir, dtype="float32")
    model.generate = sampler.wrap(model.generate)  # an instance attribute: TRL's unwrapped model is this one
    config = build_config(w, str(args.work_dir / "trl-out"))
    trainer = TimedGRPOTrainer(model=model, reward_funcs=arithmetic_reward, args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[StepTimer()])
    trainer.train()
    clock.info = {"optim": str(trainer.args.optim), "generation_batch_size": trainer.args.generation_batch_size,
                  "activation_checkpointing": bool(getattr(trainer.model, "is_activation_checkpointing", False)),
                  "dtype": str(next(trainer.model.parameters()).dtype), "bf16": bool(trainer.args.bf16),
                  "device": str(next(trainer.model.parameters()).device)}
    if w.device == "cuda":
        import torch

        clock.info["cuda_max_memory_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        clock.info["cuda_device_name"] = torch.cuda.get_device_name()
    clock.save(out)


if __name__ == "__main__":
    main()
