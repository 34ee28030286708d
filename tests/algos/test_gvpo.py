"""GVPO (verl's recipe/gvpo, arXiv:2504.19599): the loss against hand-derived numbers, its independence of
micro-batching (in the pure function and through the real FSDP actor), the trainer's group ordering, and
the start-up checks that refuse a config that would cut a group."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.algos import core_algos
from rlfoundry.algos.gvpo import GROUP_KEY, compute_policy_loss_gvpo, gvpo_sequence_losses, whole_group_problem
from rlfoundry.config.typed import ConfigError
from rlfoundry.protocol import DataProto
from rlfoundry.trainer.config import load_config
from rlfoundry.trainer.ppo.ray_trainer import order_groups

CFG = {"gvpo_beta": 0.5}

# Two groups of two rows, T = 2, beta = 0.5 (S = sum of masked log-probs, r = beta (S - S')):
#   row 0 (g0): S - S' = (-1 - 2) - (-1.5 - 2.5) = 1  -> r0 = 0.5;  a0 = mean(1, 1) = 1
#   row 1 (g0): token 1 masked; S - S' = -1 - (-1) = 0 -> r1 = 0;  a1 = -1
#   row 2 (g1): S - S' = -4 - (-2) = -2 -> r2 = -1;  a2 = 0.5
#   row 3 (g1): S - S' = 0 -> r3 = 0;  a3 = -0.5
# group means of r: g0 0.25, g1 -0.5. errors e = (r - mean) - a:
#   e0 = 0.25 - 1 = -0.75, e1 = -0.25 + 1 = 0.75, e2 = -0.5 - 0.5 = -1, e3 = 0.5 + 0.5 = 1
# l = e^2 / 2 / (k - 1), k = 2: [0.28125, 0.28125, 0.5, 0.5]; group sums 0.5625 and 1 -> loss = mean = 0.78125
LOG_PROB = torch.tensor([[-1.0, -2.0], [-1.0, 0.0], [-2.0, -2.0], [-1.0, -1.0]])
OLD = torch.tensor([[-1.5, -2.5], [-1.0, 0.0], [-1.0, -1.0], [-1.0, -1.0]])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]])
ADV = torch.tensor([[1.0, 1.0], [-1.0, 0.0], [0.5, 0.5], [-0.5, -0.5]])
INDEX = torch.tensor([0, 0, 1, 1])


def _loss(rows=slice(None), info=None, log_prob=None):
    log_prob = (LOG_PROB.clone() if log_prob is None else log_prob)[rows].requires_grad_()
    config = core_algos.with_global_batch_info(CFG, info) if info else CFG
    loss, metrics = compute_policy_loss_gvpo(OLD[rows], log_prob, ADV[rows], MASK[rows], config=config,
                                             index=INDEX[rows])
    loss.backward()
    return loss, log_prob.grad, metrics


def test_loss_and_gradient_match_the_hand_derivation():
    losses, size = gvpo_sequence_losses(LOG_PROB, OLD, ADV, MASK, INDEX, 0.5)
    torch.testing.assert_close(losses, torch.tensor([0.28125, 0.28125, 0.5, 0.5]))
    torch.testing.assert_close(size, torch.tensor([2.0, 2.0, 2.0, 2.0]))
    loss, grad, metrics = _loss()
    torch.testing.assert_close(loss, torch.tensor(0.78125))
    # the group mean carries no gradient: d loss / d log pi_it = (k / S) e_i beta m_it = (2/4) e_i 0.5 m_it
    torch.testing.assert_close(grad, torch.tensor([[-0.1875, -0.1875], [0.1875, 0.0], [-0.25, -0.25], [0.25, 0.25]]))
    # ppo_kl = mean over the 7 valid tokens of old - new: (-0.5 - 0.5 + 0 + 1 + 1 + 0 + 0) / 7
    assert float(metrics["actor/ppo_kl"]) == pytest.approx(1.0 / 7.0)
    assert metrics["actor/pg_clipfrac"] == 0.0


def test_a_group_of_three_divides_by_two_and_groups_come_from_the_ids_not_the_positions():
    # beta 1, T 1: r = [1, 2, 3] - 0, a = 0 -> mean 2, e = [-1, 0, 1], l = e^2 / 2 / 2 = [0.25, 0, 0.25];
    # one group: loss = its sum = 0.5. Rows interleaved with a second, on-policy group (r = 0, a = 0: l = 0)
    log_prob = torch.tensor([[1.0], [0.0], [2.0], [0.0], [3.0], [0.0]])
    index = torch.tensor([7, 3, 7, 3, 7, 3])
    zeros, ones = torch.zeros(6, 1), torch.ones(6, 1)
    losses, size = gvpo_sequence_losses(log_prob, zeros, zeros, ones, index, 1.0)
    torch.testing.assert_close(losses, torch.tensor([0.25, 0.0, 0.0, 0.0, 0.25, 0.0]))
    torch.testing.assert_close(size, torch.full((6,), 3.0))
    loss, _ = compute_policy_loss_gvpo(zeros, log_prob, zeros, ones, config={"gvpo_beta": 1.0}, index=index)
    torch.testing.assert_close(loss, torch.tensor(0.25))  # two groups: (0.5 + 0) / 2


def test_on_policy_the_loss_is_half_the_advantages_group_variance():
    # log pi = log pi' : r = 0, so l_i = a_i^2 / 2 / (k - 1): g0 (1 + 1) / 2 = 1, g1 (0.25 + 0.25) / 2 = 0.25
    loss, _, _ = _loss(log_prob=OLD.clone())
    torch.testing.assert_close(loss, torch.tensor((1.0 + 0.25) / 2))


def test_micro_batches_and_ranks_sum_to_the_whole_mini_batch():
    whole, whole_grad, _ = _loss()
    info = {"dp_size": 1, "global_batch_size": 4}
    parts = [_loss(rows, info) for rows in (slice(0, 2), slice(2, 4))]  # one group per micro-batch
    torch.testing.assert_close(sum(p[0] for p in parts), whole)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_grad)
    # the same groups on two ranks: each loss carries dp_size, the data-parallel mean undoes it
    ranks = [_loss(rows, {"dp_size": 2, "global_batch_size": 4}) for rows in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(sum(r[0] for r in ranks) / 2, whole)
    # verl's scale at micro-batch = k rows: sum of l per micro-batch / (micro-batches per mini-batch)
    verl = sum(gvpo_sequence_losses(LOG_PROB[r], OLD[r], ADV[r], MASK[r], INDEX[r], 0.5)[0].sum()
               for r in (slice(0, 2), slice(2, 4))) / 2
    torch.testing.assert_close(verl, whole)


def test_the_loss_is_registered_and_refuses_missing_group_ids_and_is_weights():
    assert core_algos.get_policy_loss_fn("gvpo") is compute_policy_loss_gvpo
    with pytest.raises(ValueError, match="group ids"):
        compute_policy_loss_gvpo(OLD, LOG_PROB, ADV, MASK, config=CFG)
    with pytest.raises(ValueError, match="rollout_is"):
        compute_policy_loss_gvpo(OLD, LOG_PROB, ADV, MASK, config=CFG, rollout_is_weights=MASK, index=INDEX)


def test_the_loss_is_registered_by_importing_verls_core_algos_path_alone():
    # what a worker of plain main_ppo imports: nothing names algos.gvpo, yet loss_mode=gvpo resolves
    import subprocess
    import sys

    from tests.trainer._e2e import subprocess_env

    code = ("import sys; from rlfoundry.trainer.ppo import core_algos as c; "
            "sys.exit(0 if c.get_policy_loss_fn('gvpo').__module__ == 'rlfoundry.algos.gvpo' else 1)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_whole_group_problem():
    assert whole_group_problem([0, 0, 1, 1, 2, 2], [6, 2]) is None
    assert "cut groups of 2" in whole_group_problem([0, 0, 1, 1, 2, 2], [6, 3])
    assert "not in consecutive rows" in whole_group_problem([0, 1, 0, 1], [4])
    assert "different sizes" in whole_group_problem([0, 0, 1], [3])


def test_order_groups_puts_groups_together_and_balances_them_over_ranks():
    # 4 groups of 2, interleaved; group tokens: a 2+2, b 9+9, c 1+1, d 8+8 -> two ranks of {a, b} / {c, d}-like
    uids = np.array(list("abcdabcd"), dtype=object)
    lengths = [2, 9, 1, 8, 2, 9, 1, 8]
    mask = torch.tensor([[1] * n + [0] * (9 - n) for n in lengths])
    data = DataProto.from_dict(tensors={"attention_mask": mask, "row": torch.arange(8)}, non_tensors={"uid": uids})
    out, stats = order_groups(data, world_size=2)
    got = list(out.non_tensor_batch["uid"])
    assert [got[i] for i in range(0, 8, 2)] == [got[i] for i in range(1, 8, 2)]  # pairs of one group
    assert out.batch[GROUP_KEY].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert all(uids[r] == u for r, u in zip(out.batch["row"].tolist(), got))  # every column moved with its row
    assert stats["training/seqlen_max_rank_tokens"] == stats["training/seqlen_min_rank_tokens"] == 20  # {b,c} / {a,d}
    plain, _ = order_groups(DataProto.from_dict(tensors={"attention_mask": mask}, non_tensors={"uid": uids.copy()}),
                            world_size=2, balance=False)
    assert list(plain.non_tensor_batch["uid"]) == list("aabbccdd")  # first-seen order without balancing


GVPO = ["actor_rollout_ref.actor.policy_loss.loss_mode=gvpo", "actor_rollout_ref.rollout.n=4",
        "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "trainer.n_gpus_per_node=2"]


# verl's recipe/gvpo/config/gvpo_trainer.yaml, as a user passes it with --config-path
VERL_FILE = """hydra:
  searchpath:
    - file://verl/trainer/config
defaults:
  - ppo_trainer
  - _self_
actor_rollout_ref:
  actor:
    _target_: recipe.gvpo.gvpo_actor_config.FSDPActorConfig
    gvpo_beta: 0.1
trainer:
  project_name: gvpo
"""


def test_the_recipe_settings_load_and_configs_that_cut_a_group_are_refused_by_key(tmp_path):
    (tmp_path / "gvpo_trainer.yaml").write_text(VERL_FILE)
    cfg = load_config([*GVPO, "actor_rollout_ref.actor.gvpo_beta=0.2"], config_name="gvpo_trainer",
                      config_path=str(tmp_path))
    assert cfg.actor_rollout_ref.actor.gvpo_beta == 0.2 and cfg.trainer.project_name == "gvpo"
    assert load_config(GVPO, config_name="gvpo_trainer").actor_rollout_ref.actor.gvpo_beta == 0.1  # verl's default
    # one load reports every problem: each names its key
    for overrides, named in [
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6", "actor_rollout_ref.actor.shuffle=true",
          "actor_rollout_ref.actor.ppo_mini_batch_size=1", "actor_rollout_ref.actor.gvpo_beta=0",
          "algorithm.rollout_correction.rollout_is=token"],
         ["ppo_micro_batch_size_per_gpu=6 is not a multiple of actor_rollout_ref.rollout.n=4", "shuffle=True",
          "ppo_mini_batch_size=1 prompts do not divide", "gvpo_beta=0.0 must be > 0", "rollout_correction.rollout_is"]),
        (["actor_rollout_ref.actor.use_dynamic_bsz=true", "actor_rollout_ref.rollout.n=1"],
         ["use_dynamic_bsz=True", "rollout.n >= 2"]),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config([*GVPO, *overrides], config_name="gvpo_trainer")
        for text in named:
            assert text in str(err.value), text


def test_megatron_is_refused_at_start_up_naming_the_strategy():
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.actor\.strategy=megatron .*FSDP engine only"):
        load_config(GVPO, config_name="ppo_megatron_trainer")
