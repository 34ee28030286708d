"""verl's ``actor.calculate_sum_pi_squared`` on the FSDP engine: the log-prob pass's ``sum_pi_squared``
(sum_v pi(v|s_t)^2 at the sampling temperature, the optimal token baselines' input) equals a direct
``softmax(logits / T)^2`` sum of the model's logits, on every causal-LM path (padded, packed, shared
prompt; each with the fused head) and packed under Ulysses SP=2 over two gloo ranks, and is 0 at padding.

The tiny model's head is scaled so its distributions are far from uniform (sum pi^2 from ~1/V to ~1):
otherwise every value is ~1/V and a wrong temperature would move them little.

Bounds. sum pi^2 = S(z) of the logits z / T has dS/dz_j = 2 pi_j (pi_j - S) / T, so
|dS| <= 2 max_j |dz_j| / T (sum_j pi_j |pi_j - S| <= 1). In float64 the paths' logits agree to ~1e-13,
so they must give S to 1e-9. In float32 the logits of any one forward are off from float64 by delta
(measured on HF's own fp32 forward); another path sums the same products in another order, so its error
is of the same size: within 4 delta, hence |dS| <= 8 delta / T, plus a few float32 roundings of S <= 1.
"""

from __future__ import annotations

import pytest
import torch

from rlfoundry.engines.base import LogProbs, MicroBatching
from tests.engines.test_fsdp_fused_kernels import PATHS, _batch, _engine
from tests.engines.test_fsdp_utils import process_group  # noqa: F401 - fixture

# every path's sum against a float64 softmax, within float32 bounds: a comparison across numerics (#51)
pytestmark = pytest.mark.numerics

T = 0.7
HEAD_SCALE = 15.0


@pytest.fixture(scope="module")
def peaked_model(tmp_path_factory):
    """The tiny model (untied head) with its head's weight x HEAD_SCALE: peaked next-token distributions."""
    from transformers import AutoModelForCausalLM

    from rlfoundry.models.tiny import save_tiny_model

    path = save_tiny_model(tmp_path_factory.mktemp("peaked"), tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(HEAD_SCALE)
    model.save_pretrained(path)
    return path


def _reference(model_dir, data, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits at the response predictors in ``dtype``, float64 sum softmax(logits_64 / T)^2) from HF's forward."""
    from transformers import AutoModelForCausalLM

    b, width = data.batch, data.batch["responses"].shape[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
    with torch.no_grad():
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                       position_ids=b["position_ids"]).logits[:, -width - 1:-1]
    return logits, torch.softmax(logits.double() / T, -1).square().sum(-1)


def _check(squares: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor, bound: float, where: str) -> None:
    err = (squares.double() - reference)[mask].abs().max()
    assert err <= bound, (where, float(err), bound)
    assert torch.all(squares[~mask] == 0), where


def test_reference_spans_peaked_and_flat_distributions(peaked_model):
    """The fixture does what the bounds assume: S ranges widely, and T = 1 would be far outside them."""
    data = _batch()
    logits, ref = _reference(peaked_model, data, torch.float64)
    valid = ref[data.batch["response_mask"].bool()]
    at_t1 = torch.softmax(logits, -1).square().sum(-1)[data.batch["response_mask"].bool()]
    assert valid.min() < 0.2 and valid.max() > 0.5, (float(valid.min()), float(valid.max()))
    assert (at_t1 - valid).abs().max() > 1e-2


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_head"])
@pytest.mark.parametrize("path", list(PATHS))
def test_sum_pi_squared_equals_the_softmax_of_the_logits(process_group, peaked_model, path, fused):
    data = _batch()
    mask = data.batch["response_mask"].bool()
    spec = LogProbs(temperature=T, entropy=True, sum_pi_squared=True)
    logits32, _ = _reference(peaked_model, data, torch.float32)
    logits64, ref = _reference(peaked_model, data, torch.float64)
    delta = float((logits32.double() - logits64)[mask].abs().max())
    for dtype, bound in ((torch.float64, 1e-9), (torch.float32, 8 * delta / T + 4 * 2**-24)):
        engine = _engine(peaked_model, path, fused, "auto")
        engine.module.to(dtype)
        out = engine.infer_batch(data, spec, MicroBatching(size=3))
        assert out["sum_pi_squared"].dtype == dtype and not out["sum_pi_squared"].requires_grad
        _check(out["sum_pi_squared"], ref, mask, bound, f"{path} fused={fused} {dtype}")
        # asked without the entropy (and cut into other micro-batches): within the same bound
        alone = engine.infer_batch(data, LogProbs(temperature=T, sum_pi_squared=True), MicroBatching(size=2))
        assert "entropy" not in alone
        _check(alone["sum_pi_squared"], ref, mask, bound, f"{path} fused={fused} {dtype} without entropy")


# ---- two ranks: Ulysses SP=2, each rank's head on its slice of the pack ------------------------------


def _rank_main(rank: int, store: str, result: str, model_dir, data) -> None:
    import os
    import sys

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mine = data.chunk(2)[rank]
    out = {}
    for fused in (False, True):
        engine = _engine(model_dir, "packed", fused, "auto", sp=2)
        rows, own = engine.model_parallel_rows(mine)
        inferred = engine.infer_batch(rows, LogProbs(temperature=T, entropy=True, sum_pi_squared=True),
                                      MicroBatching(size=3))
        out[fused] = inferred["sum_pi_squared"][own]
    torch.save(out, f"{result}.{rank}")
    dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)  # skip gloo's thread teardown (see tests/workers/test_critic.py)


def test_ulysses_sp2_gathers_sum_pi_squared_like_the_log_probs(process_group, peaked_model, tmp_path):
    from tests import rank_server

    data = _batch()
    mask = data.batch["response_mask"].bool()
    logits32, _ = _reference(peaked_model, data, torch.float32)
    logits64, ref = _reference(peaked_model, data, torch.float64)
    bound = 8 * float((logits32.double() - logits64)[mask].abs().max()) / T + 4 * 2**-24
    rank_server.run(_rank_main, args=(str(tmp_path / "store"), str(tmp_path / "out.pt"), peaked_model, data), nprocs=2)
    for rank, rows in enumerate((slice(0, 3), slice(3, 6))):
        out = torch.load(f"{tmp_path / 'out.pt'}.{rank}")
        for fused in (False, True):
            _check(out[fused], ref[rows], mask[rows], bound, f"ulysses rank {rank} fused={fused}")
