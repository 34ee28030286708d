"""verl's batch arithmetic in one place: the driver's check and the workers get the same numbers."""

from __future__ import annotations

import pytest

from rlfoundry.config.batch import BatchSizeError, RoleBatch, per_gpu, role_batch


def test_per_gpu_takes_the_per_rank_key_else_divides_the_deprecated_global_one():
    assert per_gpu(4, 64, 8) == 4  # the per-rank key wins
    assert per_gpu(None, 64, 8) == 8  # 64 over 8 ranks
    assert per_gpu(None, 4, 8) == 1  # never below one row
    assert per_gpu(None, None, 8) is None


def test_per_rank_sizes_are_prompts_times_n_over_the_ranks():
    # 4 prompts × 8 samples = 32 samples per mini-batch over 2 ranks = 16 each; micro 4 divides 16
    assert role_batch("actor", 4, 8, 2, 4, dynamic=False) == RoleBatch(16, 4)
    # token budgets (dynamic) cut micro-batches: a micro that does not divide is not checked
    assert role_batch("actor", 4, 8, 2, 5, dynamic=True) == RoleBatch(16, 5)
    assert role_batch("critic", 1, 2, 1, 32, dynamic=False, micro_divides=False) == RoleBatch(2, 32)


@pytest.mark.parametrize("args, message", [
    (("actor", 3, 1, 2, 1, False), "3 × rollout.n=1 = 3 samples per mini-batch cannot be split evenly over 2"),
    (("actor", 3, 2, 1, 4, False), "ppo_micro_batch_size_per_gpu=4 does not divide the 6 samples"),
    (("actor", 0, 2, 1, 1, False), "= 0 samples per mini-batch"),
])
def test_sizes_that_cannot_be_split_name_the_numbers(args, message):
    with pytest.raises(BatchSizeError, match=message.replace("×", ".")):
        role_batch(*args)


def test_a_mini_batch_the_ranks_cannot_share_says_verl_does_not_run_it_and_the_nearest_sizes_that_split():
    # verl's fully-async dapo_7b_math_fsdp2_4_12.sh: 32 prompts x 16 = 512 samples over 2 x 6 = 12 ranks. verl's
    # August engine worker asserts 512 % 12 == 0; January's floors 512 / 12 to 42 per rank. gcd(16, 12) = 4, so
    # the prompts must be a multiple of 12 / 4 = 3: 30 (480 = 12 x 40) or 33 (528 = 12 x 44); the divisors of
    # 512 nearest 12 are 8 and 16.
    with pytest.raises(BatchSizeError) as e:
        role_batch("actor_rollout_ref.actor", 32, 16, 12, None, dynamic=True)
    msg = str(e.value)
    assert "512 samples per mini-batch cannot be split evenly over 12 data-parallel ranks" in msg
    assert "verl does not run it as asked either (August's engine worker asserts 512 % 12 == 0" in msg
    assert "January's floors each rank's share to 42" in msg
    assert "ppo_mini_batch_size to a multiple of 3 (30 or 33)" in msg
    assert "data-parallel size that divides 512 (8 or 16)" in msg
    assert role_batch("actor_rollout_ref.actor", 33, 16, 12, None, dynamic=True).mini_batch_size == 44  # it splits
    assert role_batch("actor_rollout_ref.actor", 32, 16, 16, None, dynamic=True).mini_batch_size == 32
    # 3 samples over 4 ranks: January's floor is 0 (it asserts a positive share); 3's only divisor below 4 is 3
    # and none lies above 4 up to 3
    with pytest.raises(BatchSizeError) as e:
        role_batch("critic", 3, 1, 4, 1, dynamic=False)
    msg = str(e.value)
    assert "January's asserts each rank's share is at least one sample" in msg
    assert "multiple of 4 (4)" in msg and "divides 3 (3)." in msg


def test_a_worker_without_the_driver_must_be_told_a_micro_batch():
    assert role_batch("actor", 2, 2, 1, None, dynamic=False) == RoleBatch(4, None)  # the driver fills it in
    with pytest.raises(BatchSizeError, match="set actor.ppo_micro_batch_size_per_gpu"):
        role_batch("actor", 2, 2, 1, None, dynamic=False, require_micro=True)
