"""GRPO with LoRA end to end (``main_ppo``, two CPU processes): the actor on Megatron at TP=2 against
the actor on FSDP2 (peft), both from one peft adapter directory (random A and B). The same samples at
every step need the HF rollout's copy refreshed with the merged weights after each update; the same
KL loss needs the reference to be the base model (the adapters off)."""

from __future__ import annotations

import pytest

from tests.engines.test_megatron_lora import ALPHA, RANK, _adapter_dir
from tests.trainer._e2e import write_reward_file
from tests.trainer.test_e2e_megatron import LAYOUTS, _run

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def test_lora_grpo_on_megatron_tp2_matches_fsdp(tiny_model_dir, tmp_path):
    adapter = _adapter_dir(str(tiny_model_dir), tmp_path / "adapter")
    lora = [f"actor_rollout_ref.model.lora_adapter_path={adapter}", f"actor_rollout_ref.model.lora_rank={RANK}",
            f"actor_rollout_ref.model.lora_alpha={ALPHA}"]
    reward = write_reward_file(tmp_path)
    fsdp = _run(tmp_path, "fsdp", tiny_model_dir, reward, lora)
    sizes = [f"actor_rollout_ref.{role}.megatron.{LAYOUTS['tp2']}" for role in ("actor", "ref")]
    # verl's spelling of the rank on the Megatron side: the same setting
    verl = [k.replace("model.lora_rank", "model.lora.rank") for k in lora]
    megatron = _run(tmp_path, "megatron", tiny_model_dir, reward, verl + sizes, config_name="ppo_megatron_trainer")
    assert [r["step"] for r in megatron] == [1, 2, 3]
    for a, b in zip(fsdp, megatron):
        assert a["response_length/mean"] == b["response_length/mean"], a["step"]  # the rollout follows the adapter
        assert a["critic/score/mean"] == pytest.approx(b["critic/score/mean"], abs=1e-6), a["step"]
        # as test_e2e_megatron: weights ~1e-5 apart after a step (its eps), TP re-associating the sums
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (a["step"], key)
    assert megatron[0]["actor/kl_loss"] > 1e-4  # the adapter moves the policy off the reference from the start
