"""FlowRL's loss (``algos/flowrl.py``) against hand-derived numbers, and its start-up rules."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.flowrl import ProjZHead, compute_policy_loss_flowrl, flowrl_seq_losses, prompt_mean_hidden

LN2 = math.log(2.0)


def _batch():
    """Two rows, two response slots.
    row 0 (both tokens): mean log pi = (-1 - 3)/2 = -2, mean ref = -2, mean A = 0.1, log Z = 1
        delta = 1 - 2 - 15 * 0.1 + 2 = -0.5; log w = 0 (old = new): w = 1; w delta^2 = 0.25
    row 1 (first token only; the second holds junk that must not count): log pi = -0.5, ref = -1, A = -0.2,
        log Z = 0.5: delta = 0.5 - 0.5 + 3 + 1 = 4; old = -0.5 - ln 2: w = 2; w delta^2 = 32
    loss = (0.25 + 32) / 2 = 16.125"""
    return dict(
        log_prob=torch.tensor([[-1.0, -3.0], [-0.5, 9.0]], requires_grad=True),
        old_log_prob=torch.tensor([[-1.0, -3.0], [-0.5 - LN2, -7.0]]),
        ref_log_prob=torch.tensor([[-2.0, -2.0], [-1.0, 5.0]]),
        advantages=torch.tensor([[0.1, 0.1], [-0.2, 7.0]]),
        response_mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]),
        log_z=torch.tensor([1.0, 0.5], requires_grad=True),
    )


def _loss(b, config=None, rows=slice(None)):
    return compute_policy_loss_flowrl(b["old_log_prob"][rows], b["log_prob"][rows], b["advantages"][rows],
                                      b["response_mask"][rows], config=config, ref_log_prob=b["ref_log_prob"][rows],
                                      log_z=b["log_z"][rows])


def test_loss_weights_and_gradients_by_hand():
    b = _batch()
    loss, metrics = _loss(b)
    assert loss.item() == pytest.approx(16.125)
    assert metrics["actor/importance_weight"].item() == pytest.approx(1.5)  # (1 + 2) / 2
    assert metrics["actor/log_z"].item() == pytest.approx(0.75)
    loss.backward()
    # d/d log Z_i of mean_i w_i delta_i^2 = 2 w_i delta_i / 2: row 0: -0.5, row 1: 8
    torch.testing.assert_close(b["log_z"].grad, torch.tensor([-0.5, 8.0]))
    # through mean_t log pi (1/|y_i| per valid token); the weight is detached (no term from it); junk slot: 0
    torch.testing.assert_close(b["log_prob"].grad, torch.tensor([[-0.25, -0.25], [8.0, 0.0]]))


def test_weight_is_a_token_sum_ratio_clamped_above_at_10_only():
    b = _batch()
    # row 0: sum_t (log pi - old) = 2 ln 3 -> w = 9 (a token mean would give 3); row 1: ln 20 -> 20, clamped to 10
    old = torch.tensor([[-1.0 - math.log(3.0), -3.0 - math.log(3.0)], [-0.5 - math.log(20.0), 0.0]])
    small = torch.tensor([[-1.0 - 0.0, -3.0 - 0.0], [-0.5 + math.log(4.0), 0.0]])  # w = 1/4: no lower clip
    args = (b["log_z"], b["log_prob"], None, b["ref_log_prob"], b["advantages"], b["response_mask"])
    _, w = flowrl_seq_losses(args[0], args[1], old, *args[3:])
    torch.testing.assert_close(w, torch.tensor([9.0, 10.0]))
    _, w = flowrl_seq_losses(args[0], args[1], small, *args[3:])
    torch.testing.assert_close(w, torch.tensor([1.0, 0.25]))


def test_micro_batches_with_the_mini_batch_count_add_up_to_the_whole():
    """Each micro-batch divides by the mini-batch's sequences (x dp_size, the agg_loss contract): rows 0 and 1 as
    two micro-batches on one of 2 ranks that share 4 sequences give 0.25 * 2/4 + 32 * 2/4 = 16.125."""
    b = _batch()
    info = core_algos.with_global_batch_info({}, {"dp_size": 2, "batch_num_tokens": 6, "global_batch_size": 4})
    parts = [_loss(b, info, slice(i, i + 1))[0].item() for i in (0, 1)]
    assert parts == pytest.approx([0.125, 16.0])


def test_a_row_without_response_tokens_adds_nothing():
    b = _batch()
    b["response_mask"] = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    assert _loss(b)[0].item() == pytest.approx(0.25)  # row 0's alone, over one counted sequence


def test_prompt_mean_leaves_out_the_prompts_last_column_as_verl_slices():
    # 3 prompt columns + 1 response column; verl averages columns [: -Tr - 1] = 0..1: the real one (mask) is 2.0
    hidden = torch.tensor([[[1.0], [2.0], [3.0], [100.0]]])
    mask = torch.tensor([[0, 1, 1, 1]])
    assert prompt_mean_hidden(hidden, mask, response_length=1).item() == pytest.approx(2.0)


def test_head_layout_is_verls():
    block = ["Linear", "GELU", "LayerNorm", "Dropout"]
    assert [type(m).__name__ for m in ProjZHead(8, 3).net] == block * 2 + ["Linear"]
    assert [type(m).__name__ for m in ProjZHead(8, 1).net] == ["Linear"]
    assert core_algos.get_policy_loss_fn("flowrl") is compute_policy_loss_flowrl  # registered with rlfoundry.algos


# ───────────────────────────── start-up rules ─────────────────────────────


def test_packaged_config_and_its_start_up_errors_name_the_key():
    from rlfoundry.config.typed import ConfigError
    from rlfoundry.config.verl_compat import NoEffectKeyWarning
    from rlfoundry.trainer.config import load_config

    cfg = load_config([], config_name="flowrl_trainer")
    actor = cfg.actor_rollout_ref.actor
    got = (actor.policy_loss.loss_mode, actor.use_kl_loss, actor.kl_loss_coef, actor.proj_layer)
    assert got == ("flowrl", True, 0.0, 3)
    assert cfg.reward_model.reward_manager == "dapo" and cfg.trainer.project_name == "verl-flowrl"
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.use_kl_loss=true"):
        load_config(["actor_rollout_ref.actor.use_kl_loss=false"], config_name="flowrl_trainer")
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.strategy=megatron"):
        load_config(["model_engine=megatron"], config_name="flowrl_trainer")
    with pytest.raises(ConfigError, match=r"ulysses_sequence_parallel_size=2"):
        load_config(["actor_rollout_ref.actor.ulysses_sequence_parallel_size=2", "trainer.n_gpus_per_node=2"],
                    config_name="flowrl_trainer")
    with pytest.warns(NoEffectKeyWarning, match="kl_loss_coef=0.001 has no effect"):
        load_config(["actor_rollout_ref.actor.kl_loss_coef=0.001"], config_name="flowrl_trainer")
    with pytest.warns(NoEffectKeyWarning, match="proj_layer=2 has no effect"):
        load_config(["actor_rollout_ref.actor.proj_layer=2"])  # plain PPO: no head to shape
    with warnings.catch_warnings():
        warnings.simplefilter("error", NoEffectKeyWarning)
        load_config(["actor_rollout_ref.actor.policy_loss.loss_mode=flowrl", "actor_rollout_ref.actor.use_kl_loss=true",
                     "actor_rollout_ref.actor.kl_loss_coef=0.0"])  # plain main_ppo runs it too
