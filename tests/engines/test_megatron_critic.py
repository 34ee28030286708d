"""The Megatron engine as the PPO critic (a value head on the last pipeline stage, the same role and
value loss as FSDP): on CPU processes over gloo, one critic update (two optimiser steps, value
clipping, weight decay on every parameter) at TP=2, at PP=2 and at DP=2 with the distributed
optimiser equals the 1-rank FSDP2 critic's, and so do the values after it; the exported HF
directory is a token classifier that transformers loads with the same values."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]  # every test compares Megatron with FSDP or HF (#51)

ROWS, MINI, MICRO = 8, 4, 2  # two optimiser steps of 4 rows, micro-batches of 2


def _value_batch():
    from rlfoundry.protocol import DataProto
    from tests.engines.test_megatron_model import _batch

    parts = [_batch(seed=s) for s in (0, 1)]
    batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    mask = batch["attention_mask"][:, -batch["responses"].shape[1]:]
    g = torch.Generator().manual_seed(5)
    # rollout-time values near zero (the fresh head's) and returns far enough to clip some predictions
    batch.update(response_mask=mask, values=0.3 * torch.randn(mask.shape, generator=g) * mask,
                 returns=torch.randn(mask.shape, generator=g) * mask)
    return DataProto.from_dict(tensors=batch)


def _critic_config():
    from rlfoundry.config.schema import CriticConfig
    from rlfoundry.config.typed import to_typed

    # eps=1e-4: see ACTOR in test_megatron_engine.py (Adam and near-zero gradients)
    return to_typed(CriticConfig, {"optim": {"lr": 1e-3, "weight_decay": 0.1, "eps": 1e-4, "warmup_style": "constant",
                                             "total_training_steps": -1},
                                   "cliprange_value": 0.2, "grad_clip": 0.5, "ppo_epochs": 1, "shuffle": False,
                                   "use_dynamic_bsz": False, "loss_agg_mode": "token-mean"}, name="critic")


def _fsdp_critic(rank: int, model_dir: str, data):
    from rlfoundry.config.schema import FSDPConfig
    from rlfoundry.engines.fsdp.engine import FSDPEngine, FSDPEngineConfig
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic, zero_init_new_value_head

    cfg = _critic_config()
    engine = FSDPEngine.build(
        FSDPEngineConfig(path=model_dir, fsdp=FSDPConfig(), optim=cfg.optim, grad_clip=cfg.grad_clip,
                         model_kind="token_classification", override_config={"classifier_dropout": 0.0},
                         cpu_kernels="off"),
        "cpu", role="critic", prepare=lambda m: zero_init_new_value_head(m, model_dir))
    critic = DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI, MICRO, MICRO))
    metrics = critic.update_critic(data)
    return critic.compute_values(data), metrics, dict(engine.iter_hf_weights())


def _megatron_critic(rank: int, model_dir: str, data, tp: int, pp: int, distributed_optimizer: bool, out: str,
                     megatron_fsdp: bool = False):
    from megatron.core import parallel_state as ps

    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.critic import CriticBatchSizes, DataParallelPPOCritic

    cfg = _critic_config()
    megatron = MegatronConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, dtype="float32",
                              use_distributed_optimizer=distributed_optimizer, use_megatron_fsdp=megatron_fsdp)
    engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                                 model_kind="token_classification"), "cpu", role="critic")
    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    mine = data.chunk(dp)[dp_rank]
    critic = DataParallelPPOCritic(cfg, engine, CriticBatchSizes(MINI // dp, MICRO, MICRO))
    before = critic.compute_values(mine)
    metrics = critic.update_critic(mine)
    engine.save_hf_model(out)
    return {"dp": dp, "dp_rank": dp_rank, "before": before, "values": critic.compute_values(mine),
            "metrics": metrics, "weights": dict(engine.iter_hf_weights())}


@pytest.mark.parametrize("tp, pp, world, distributed_optimizer, megatron_fsdp", [
    (2, 1, 2, False, False), (1, 2, 2, False, False), (1, 1, 2, True, False),
    (1, 1, 2, True, True),  # Megatron-FSDP (engines/megatron/megatron_fsdp.py): the value head sharded too
])
def test_critic_update_equals_fsdp(tiny_model_dir, tmp_path, tp, pp, world, distributed_optimizer, megatron_fsdp):
    _check_critic_equals_fsdp(str(tiny_model_dir), tmp_path, tp, pp, world, distributed_optimizer, megatron_fsdp)


def test_critic_from_a_tied_checkpoint_at_pp2_equals_fsdp(tmp_path):
    """A causal LM whose head is tied to its embedding (Qwen2.5-0.5B) as the critic's start at PP=2: the
    value head replaces the LM head, so the embedding stays on the first stage alone, untied."""
    from rlfoundry.models.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "tiny-qwen2-tied", tie_word_embeddings=True))
    _check_critic_equals_fsdp(model_dir, tmp_path, 1, 2, 2, False)


def _check_critic_equals_fsdp(model_dir: str, tmp_path, tp: int, pp: int, world: int,
                              distributed_optimizer: bool, megatron_fsdp: bool = False) -> None:
    data = _value_batch()
    dp = world // (tp * pp)
    order = torch.arange(ROWS).view(dp, ROWS // MINI, MINI // dp).transpose(0, 1).reshape(-1)
    [(ref_values, ref_metrics, ref_weights)] = run_ranks(_fsdp_critic, 1, tmp_path, args=(model_dir, data[order]))
    ref_values = ref_values[torch.argsort(order)]
    export = tmp_path / "hf"
    results = run_ranks(_megatron_critic, world, tmp_path, tp=tp, pp=pp,
                        args=(model_dir, data, tp, pp, distributed_optimizer, str(export), megatron_fsdp))
    assert results[0]["dp"] == dp
    assert ref_values.abs().max() > 1e-3  # the update moved the values: equality is not vacuous
    assert ref_metrics["critic/vf_clipfrac"][0] > 0  # the clipped branch is exercised
    for r in results:
        rows = ROWS // dp
        assert r["before"].abs().max() == 0  # a causal LM's directory: the new head starts at zero
        expected = ref_values[r["dp_rank"] * rows:(r["dp_rank"] + 1) * rows]
        # TP/PP re-associate the forward's sums: fp32 rounding of O(1) values
        torch.testing.assert_close(r["values"], expected, atol=1e-5, rtol=0)
        for key in ("critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm"):
            # TP/PP/DP re-associate the sums over tokens and hidden (u x a few hundred terms); abs for clip fractions ~0
            assert r["metrics"][key] == pytest.approx(ref_metrics[key], rel=1e-4, abs=1e-6), key
        assert set(r["weights"]) == set(ref_weights)
        # two Adam steps with eps=1e-4: each changes by <= lr/eps = 10x its gradient's rounding (see ACTOR
        # in test_megatron_engine.py), ~1e-6; a wrongly reduced value-head gradient moves it by ~lr
        for name, tensor in ref_weights.items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-5, rtol=0, msg=lambda m, n=name: f"{n}: {m}")
    _check_export(export, data, ref_values)


def _check_export(export, data, ref_values) -> None:
    """The Megatron critic's HF export is what the FSDP critic loads: the same values."""
    from transformers import AutoModelForTokenClassification

    model = AutoModelForTokenClassification.from_pretrained(export, dtype=torch.float32)
    batch = data.batch
    width = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits
    values = logits[:, -width - 1:-1, 0] * batch["response_mask"]
    # TP/PP re-associate the forward's sums: fp32 rounding of O(1) values
    torch.testing.assert_close(values, ref_values, atol=1e-5, rtol=0)
