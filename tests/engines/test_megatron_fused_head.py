"""verl's ``model.use_fused_kernels`` on the Megatron engine (``engines/megatron/fused_head.py``), on
CPU processes over gloo: with the output layer computing log-probs in chunks over its vocabulary
slice (TP=2, with sequence parallelism: the slices' statistics summed over the group), the log-probs, entropies and sum p^2 of
the unfused vocab-parallel path, and one actor update (two optimiser steps) that moves the weights
as the unfused one does — for an untied head and for a tied embedding (its weight passed in by
megatron-core)."""

from __future__ import annotations

import pytest
import torch

from tests.engines.megatron_ranks import run_ranks

pytest.importorskip("megatron.core")
pytest.importorskip("mbridge")

pytestmark = [pytest.mark.slow, pytest.mark.numerics]


def _both_heads(rank: int, model_dirs: list[str], data: dict, tp: int):
    """Per model: the fused and the unfused engine's log-prob outputs and updated weights."""
    from rlfoundry.config.schema import MegatronConfig
    from rlfoundry.engines.megatron.engine import MegatronEngine, MegatronEngineConfig
    from rlfoundry.workers.actor import ActorBatchSizes, DataParallelPPOActor
    from tests.engines.test_megatron_engine import MICRO, MINI, _actor_config

    results = {}
    for model_dir in model_dirs:
        cfg = _actor_config(model_dir)
        for fused in (False, True):
            megatron = MegatronConfig(tensor_model_parallel_size=tp, dtype="float32")
            engine = MegatronEngine(MegatronEngineConfig(model_dir, megatron, cfg.optim, cfg.grad_clip,
                                                         use_fused_kernels=fused), "cpu")
            assert (engine._fused is not None) == fused
            actor = DataParallelPPOActor(cfg, engine, ActorBatchSizes(MINI, MICRO))
            out = actor.compute_log_prob_outputs(data[model_dir], calculate_entropy=True, calculate_sum_pi_squared=True)
            columns = _fused_columns(engine, data[model_dir]) if fused else None
            metrics = actor.update_policy(data[model_dir])
            results[(model_dir, fused)] = {**out, "metrics": metrics, "weights": dict(engine.iter_hf_weights()),
                                          "columns": columns}
    return results


def _fused_columns(engine, data) -> int:
    """The last dimension the model call returns under the fused head (2: log-prob and entropy, not
    the vocabulary slice)."""
    from rlfoundry.engines.megatron.forward import _model_inputs, next_tokens

    micro = {k: data.batch[k][:2] for k in ("input_ids", "attention_mask", "position_ids")}
    sp = engine.sequence_parallel  # TP=2: on (rows padded for it)
    with torch.no_grad(), engine._fused.labelled(next_tokens(micro["input_ids"], sp), 1.0, False):
        return int(engine.chunks[0](**_model_inputs(micro, sp)).shape[-1])


def test_the_fused_output_layer_gives_the_unfused_log_probs_and_update(tiny_model_dir, tmp_path):
    from rlfoundry.models.tiny import save_tiny_model
    from tests.engines.test_megatron_engine import _initial, _scored_batch

    tied = str(save_tiny_model(tmp_path / "tied", tie_word_embeddings=True))
    dirs = [str(tiny_model_dir), tied]
    data = {d: _scored_batch(d) for d in dirs}
    for r in run_ranks(_both_heads, 2, tmp_path, tp=2, args=(dirs, data, 2)):
        for d in dirs:
            plain, fused = r[(d, False)], r[(d, True)]
            assert fused["columns"] == 2
            # the same fp32 sums in another order (chunked rows, the slices' statistics all-reduced)
            for key in ("log_probs", "entropy", "sum_pi_squared"):
                torch.testing.assert_close(fused[key], plain[key], atol=1e-5, rtol=0, msg=lambda m, k=key: f"{d} {k}: {m}")
            moved = max((plain["weights"][k] - v).abs().max().item() for k, v in _initial(d).items())
            assert moved > 1e-3  # the update moved the weights: equality is not vacuous
            for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm"):
                assert fused["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-4, abs=1e-6), key
            # test_megatron_engine's bound (ACTOR's eps: two steps of ~1e-6 rounding each)
            for name, tensor in plain["weights"].items():
                torch.testing.assert_close(fused["weights"][name], tensor, atol=1e-5, rtol=0,
                                           msg=lambda m, n=name: f"{d} {n}: {m}")
