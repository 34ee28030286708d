"""A VLM critic built from a policy directory holds the policy's backbone, whatever the RNG state."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


def test_a_vlm_critic_from_a_policy_directory_holds_its_backbone(tiny_vlm_dir):
    from rlfoundry.models.hf import load_hf_model

    policy = dict(load_hf_model(tiny_vlm_dir).named_parameters())
    torch.manual_seed(123)  # a fresh initialisation would show as a difference from the policy
    critic = load_hf_model(tiny_vlm_dir, model_kind="token_classification")
    shared = [(n, p) for n, p in critic.named_parameters() if n in policy]
    assert [n for n, _ in critic.named_parameters() if n not in policy] == ["score.weight", "score.bias"]
    for name, p in shared:
        torch.testing.assert_close(p, policy[name], atol=0, rtol=0, msg=name)
