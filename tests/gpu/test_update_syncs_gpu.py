"""Host synchronisations of one actor update on CUDA, counted by CUDA itself (issue 34: at most 3 per
mini-batch). The CPU suite counts the reads with a wrapper of every tensor-to-Python method
(tests/workers/test_update_syncs.py); here ``torch.cuda.set_sync_debug_mode("warn")`` reports every
operation that makes the host wait for the GPU, blocking copies included, on the padded and the packed
(``model.use_remove_padding``) forwards."""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.workers import local_worker, one_thread, worker_config  # noqa: F401 (fixture)
from tests.workers.test_actor_update import batch  # noqa: F401 (fixture: a scored batch of 8 rows)

pytestmark = pytest.mark.gpu


def _synchronisations(fn) -> list[str]:
    """``fn()`` under CUDA's sync debug mode: where each synchronising call came from."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno} {str(w.message)[:80]}" for w in seen if "synchroniz" in str(w.message).lower()]


@pytest.mark.parametrize("overrides", [
    ["actor.ppo_micro_batch_size_per_gpu=2"],
    ["actor.ppo_micro_batch_size_per_gpu=2", "model.use_remove_padding=true"],
    ["actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=80", "model.use_remove_padding=true"],
], ids=["padded", "packed", "packed-token-budget"])
def test_an_update_on_cuda_waits_for_the_gpu_at_most_three_times(tiny_model_dir, batch, overrides):
    actor = local_worker(worker_config(tiny_model_dir, ["actor.ppo_mini_batch_size=4", *overrides]),
                         role="actor").worker.actor
    data = batch.to("cuda")  # as the worker hands it over: on the device
    actor.update_policy(data)  # first call: lazy initialisation (optimiser state, allocator) is not the loop's
    syncs = _synchronisations(lambda: actor.update_policy(data))
    print(f"gpu tier: {len(syncs)} synchronisations in one update ({overrides}):", *syncs, sep="\n  ")
    assert len(syncs) <= 3, syncs
