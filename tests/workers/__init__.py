"""Tests of rlfoundry.workers. Shared builders live here so every test file reads the same setup."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from rlfoundry.protocol import DataProto


def worker_config(model_dir: Path, overrides: list[str] | None = None) -> DictConfig:
    """A small ``actor_rollout_ref`` subtree with verl's keys; ``overrides`` are dotted ``key=value``."""
    base: dict[str, Any] = {
        # cpu_kernels=off: the plain HF/FSDP2 path (what GPUs run) is the reference the invariance tests use
        "model": {"path": str(model_dir), "use_remove_padding": False, "enable_gradient_checkpointing": False,
                  "use_shared_prompt": False, "cpu_kernels": "off"},
        "actor": {
            "ppo_mini_batch_size": 4, "ppo_micro_batch_size_per_gpu": 4, "use_dynamic_bsz": False,
            "ppo_max_token_len_per_gpu": 4096, "ppo_epochs": 1, "shuffle": False,
            "clip_ratio": 0.2, "clip_ratio_c": 3.0, "entropy_coeff": 0.0, "use_kl_loss": False,
            "kl_loss_coef": 0.1, "kl_loss_type": "low_var_kl", "loss_agg_mode": "token-mean", "grad_clip": 1.0,
            "policy_loss": {"loss_mode": "vanilla"},
            "optim": {"lr": 1e-3, "weight_decay": 0.0, "warmup_style": "constant", "total_training_steps": -1},
            "fsdp_config": {"param_offload": False, "optimizer_offload": False, "model_dtype": "fp32"},
        },
        "ref": {"log_prob_micro_batch_size_per_gpu": 4, "log_prob_use_dynamic_bsz": False,
                "log_prob_max_token_len_per_gpu": 4096, "fsdp_config": {"model_dtype": "fp32"}},
        "rollout": {
            "name": "hf", "n": 2, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "do_sample": True,
            "response_length": 12, "prompt_length": 24, "log_prob_micro_batch_size_per_gpu": 4,
            "log_prob_use_dynamic_bsz": False, "log_prob_max_token_len_per_gpu": 4096, "seed": 7,
            "calculate_log_probs": True,  # the rollout tests compare its log-probs with the actor's
            "gpu_memory_utilization": 0.5, "tensor_model_parallel_size": 1,  # vLLM-only: accepted, ignored
            "val_kwargs": {"n": 1, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "do_sample": False},
        },
    }
    return OmegaConf.merge(OmegaConf.create(base), OmegaConf.from_dotlist(overrides or []))


def make_prompts(tokenizer, texts: list[str], max_prompt_length: int = 24) -> DataProto:
    """One left-padded row per prompt, as the trainer sends them (width max_prompt_length)."""
    enc = tokenizer(texts, return_tensors="pt", padding="max_length", max_length=max_prompt_length)
    position_ids = (enc.attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict(
        tensors={"input_ids": enc.input_ids, "attention_mask": enc.attention_mask, "position_ids": position_ids},
        non_tensors={"uid": [f"p{i}" for i in range(len(texts))], "data_source": ["test"] * len(texts)},
    )


def scored_batch(model_dir: Path, tokenizer, texts: list[str], ref: bool = True) -> DataProto:
    """A batch as the trainer hands it to update_actor: sampled responses of varied lengths (n=2 per
    prompt), the actor's (and with ``ref`` the reference's) log-probs, seeded random advantages."""
    group = local_worker(worker_config(model_dir))
    prompts = make_prompts(tokenizer, texts)
    prompts.meta_info["eos_token_id"] = list(range(0, 260, 7))  # varied response lengths
    data = group.generate_sequences(prompts)
    data.meta_info = {"temperature": 1.0}
    data = data.union(group.compute_log_prob(data))
    data = data.union(group.compute_ref_log_prob(data)) if ref else data
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=torch.Generator().manual_seed(0)) * mask
    return data


def local_worker(config: DictConfig, role: str = "actor_rollout_ref"):
    """An initialised in-process worker group (one rank, real FSDP2 over gloo)."""
    from rlfoundry.single_controller import ClassWithInitArgs, LocalWorkerGroup
    from rlfoundry.workers.fsdp_workers import ActorRolloutRefWorker

    group = LocalWorkerGroup(ClassWithInitArgs(ActorRolloutRefWorker, config, role))
    group.init_model()
    return group


def full_params(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded copies of every parameter (FSDP2 DTensors gathered)."""
    out = {}
    for name, p in module.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


# Comparing weights after an Adam step across code paths is fragile (#51): the first step moves each
# weight by lr * g / (|g| + eps), about lr * sign(g), so a gradient near zero whose last bits differ
# between the paths (another summation order, another CPU's vector width) moves its weight anywhere
# in [-lr, lr]. Tests of "the same update" compare the gradients the optimizer took instead, normwise
# per tensor, within float32 re-association over the longest reductions (reassociation_bound).
UNIT_ROUNDOFF = 2.0 ** -24  # float32


def reassociation_bound(vocab: int, tokens: int) -> float:
    """Normwise relative bound on a gradient summed in another order: u times the longest reductions,
    the vocabulary (log-softmax and the head's backward) plus the batch's tokens (each weight's
    gradient sums over them). For the tiny models (V=260, ~100-300 tokens) it is ~2-3e-5, while the
    smallest plausible bug (one token of the batch dropped or counted twice) moves a gradient by
    ~1/tokens, 1e-2 to 3e-3 normwise: two orders of magnitude above the bound."""
    return UNIT_ROUNDOFF * (vocab + tokens)


def vocab_rows(tensors: dict[str, torch.Tensor]) -> int:
    """The vocabulary size, read off the input embedding among ``tensors`` (parameters or gradients by name)."""
    return next(t.shape[0] for name, t in tensors.items() if name.endswith("embed_tokens.weight"))


def assert_same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], bound: float,
                          what: str = "") -> None:
    """``got`` equals ``want`` per tensor in the 2-norm, relative to ``want``, within ``bound``
    (a tensor whose gradient is exactly zero on both sides, e.g. LoRA's A at its first step, passes)."""
    assert set(got) == set(want), (what, set(got) ^ set(want))
    for name, grad in want.items():
        err = float((got[name] - grad).norm() / grad.norm().clamp_min(1e-30))
        assert err <= bound, f"{what} {name}: gradient {err:.2e} from the reference's (bound {bound:.1e})"


def step_gradients(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> list[dict[str, torch.Tensor]]:
    """From now on, the gradient each trainable parameter takes into every ``optimizer.step()``
    (after clipping), one dict per step: for updates of several steps, where Adam's first moment
    (first_step_gradients) no longer holds the first gradient alone. In-process engines only."""
    steps: list[dict[str, torch.Tensor]] = []

    def record(_optimizer, *_):
        steps.append({name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().clone()
                      for name, p in module.named_parameters() if p.grad is not None})

    optimizer.register_step_pre_hook(record)
    return steps


def first_step_gradients(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The gradient each trainable parameter took into an Adam/AdamW optimizer's first step (after clipping).

    The optimizer frees ``.grad`` after the step; its first moment after one step is exactly
    ``(1 - beta1) * grad``, so dividing by ``1 - beta1`` recovers the gradient without hooking the update.
    Frozen parameters (a LoRA model's base) have no optimizer state and are left out.
    """
    out = {}
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        state = optimizer.state[p]
        assert int(state["step"]) == 1, f"{name}: {int(state['step'])} optimizer steps, expected the first"
        (beta1, _), = {tuple(g["betas"]) for g in optimizer.param_groups if any(q is p for q in g["params"])}
        moment = state["exp_avg"]
        moment = moment.full_tensor() if hasattr(moment, "full_tensor") else moment
        out[name] = moment.detach() / (1.0 - beta1)
    return out


def _one_thread():
    """Run a test module's tiny-model math on one intra-op thread, restoring the setting after.

    These models are a few thousand FLOPs per token: thread start-up and synchronisation cost more
    than they save, and on a shared 2-core machine oversubscribed OpenMP threads slow every op 10×+.
    """
    import pytest

    @pytest.fixture(scope="module", autouse=True)
    def one_thread():
        before = torch.get_num_threads()
        # RLFOUNDRY_TEST_THREADS: scripts/test_cpu_variants.sh threads2 runs these with two threads
        torch.set_num_threads(int(os.environ.get("RLFOUNDRY_TEST_THREADS", "1")))
        yield
        torch.set_num_threads(before)

    return one_thread


one_thread = _one_thread()


def scripted_turn(batch: DataProto, token_ids: list[int]) -> DataProto:
    """An engine's answer to ``batch`` in which every row's turn is ``token_ids`` (log-prob -0.5 each):
    agent-loop tests script a turn, e.g. a tool call the tiny random policy would never make."""
    width, rows = int(batch.meta_info["response_length"]), len(batch)
    responses = torch.zeros((rows, width), dtype=torch.long)
    responses[:, :len(token_ids)] = torch.tensor(token_ids)
    mask = (torch.arange(width) < len(token_ids)).long().expand(rows, width)
    return DataProto.from_dict(tensors={"responses": responses, "response_mask": mask,
                                        "rollout_log_probs": -0.5 * mask.float()})
