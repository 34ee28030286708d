"""A critic on a vision-language model (models/vision_value.py): the values take the rows' pixels and
3-D positions, and neither they nor the update depend on micro-batching."""

from __future__ import annotations

import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.engines.test_fsdp_vision import RESPONSE, image_batch, plain_logits  # noqa: F401 - fixture
from tests.workers import assert_same_gradients, first_step_gradients
from tests.workers.test_critic import _config, _critic, _gradient_bound

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def vlm_critic_dir(tiny_vlm_dir, tmp_path_factory):
    """The tiny VLM as a value model with a random (non-zero) head, saved and loaded back as the critic."""
    from rlfoundry.models.hf import load_hf_model

    model = load_hf_model(tiny_vlm_dir, model_kind="token_classification")
    assert type(model).__name__ == "Qwen2VLForTokenClassification" and not hasattr(model, "lm_head")
    with torch.no_grad():
        model.score.weight.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    out = tmp_path_factory.mktemp("vlm-critic")
    model.save_pretrained(out)
    return out


def _cfg(path, **overrides):
    return _config(path, **{"ppo_max_token_len_per_gpu": 256, "forward_max_token_len_per_gpu": 256, **overrides})


def _plain_values(module, data: DataProto) -> torch.Tensor:
    """The value head at positions Tp-1 .. Tp+Tr-2 of one plain forward with every row's pixels."""
    return plain_logits(module, data)[:, -RESPONSE - 1:-1, 0] * data.batch["response_mask"]


@pytest.mark.numerics
def test_values_take_the_pixels_and_ignore_micro_batching(vlm_critic_dir, image_batch):
    sizes = {"mb1": {"forward_micro_batch_size_per_gpu": 1}, "mb4": {},
             "dynamic": {"use_dynamic_bsz": True, "forward_max_token_len_per_gpu": 90}}  # 2 rows a micro-batch
    groups = {name: _critic(_cfg(vlm_critic_dir, **o)) for name, o in sizes.items()}
    values = {name: g.compute_values(image_batch).batch["values"] for name, g in groups.items()}
    mask = image_batch.batch["response_mask"].bool()
    assert values["mb4"][mask].abs().min() > 0  # the saved head was loaded, not zeroed
    for name in ("mb1", "dynamic"):
        # micro-batches of other shapes: fp32 rounding of O(1) values
        torch.testing.assert_close(values[name], values["mb4"], atol=1e-5, rtol=0, msg=name)
    torch.testing.assert_close(values["mb4"], _plain_values(groups["mb4"].worker.critic.module, image_batch),
                               atol=1e-5, rtol=0)
    # the pixels reach the critic: blanked images move the image rows' values, not the text row's (row 2)
    blank = image_batch.select(deepcopy=True)
    for r in blank.non_tensor_batch["multi_modal_inputs"]:
        if r:
            r["pixel_values"] = torch.zeros_like(r["pixel_values"])
    other = groups["mb4"].compute_values(blank).batch["values"]
    for row in (0, 1, 3):
        assert (other[row] - values["mb4"][row])[mask[row]].abs().max() > 1e-3, row
    # the text-only row alone vs in a batch with images: fp32 rounding
    torch.testing.assert_close(other[2], values["mb4"][2], atol=1e-6, rtol=0)


def _with_returns(data: DataProto, group) -> DataProto:
    data = data.union(group.compute_values(data))
    g = torch.Generator().manual_seed(1)
    data.batch["returns"] = torch.randn(data.batch["values"].shape, generator=g) * data.batch["response_mask"]
    return data


@pytest.mark.numerics
def test_update_on_image_rows_is_the_same_at_micro_batch_1_and_4_and_fits_the_returns(vlm_critic_dir, image_batch):
    """One mini-batch of 4 rows (2 prompts x rollout_n 2): micro-batch 1 and 4 give the same weights; repeated
    updates on the batch bring the values towards the returns (vf_loss falls)."""
    groups = {mb: _critic(_cfg(vlm_critic_dir, ppo_micro_batch_size_per_gpu=mb, cliprange_value=100.0))
              for mb in (1, 4)}
    data = _with_returns(image_batch, groups[4])
    metrics = {mb: g.update_critic(data).meta_info["metrics"] for mb, g in groups.items()}
    # losses/norms summed over the batch's tokens in another order: fp32 rounding, u x tokens x a few terms
    assert metrics[1]["critic/vf_loss"][0] == pytest.approx(metrics[4]["critic/vf_loss"][0], rel=1e-5)
    assert metrics[1]["critic/grad_norm"][0] == pytest.approx(metrics[4]["critic/grad_norm"][0], rel=1e-4)
    # the gradients of the one step, not the weights after it: Adam's m/sqrt(v) turns the rounding of
    # near-zero gradients into steps of up to ~lr (measured 1.0e-5 in one element of 8192 (up_proj), and
    # more on another CPU: #51). A micro-batch whose pixels go to another row is off by O(1).
    grads = {mb: first_step_gradients(g.worker.engine.optimizer, g.worker.critic.module) for mb, g in groups.items()}
    assert_same_gradients(grads[1], grads[4], _gradient_bound(groups[4], data), "micro-batch 1")
    losses = [metrics[4]["critic/vf_loss"][0]]
    for _ in range(4):
        losses.append(groups[4].update_critic(data).meta_info["metrics"]["critic/vf_loss"][0])
    # measured 32.9, 115.9, 24.7, 3.9, 4.6 (Adam at lr 1e-3, gradients clipped at 1: the first step overshoots
    # with the random unit-variance head); a critic that does not learn stays near or above the first
    assert losses[-1] < 0.5 * losses[0] and min(losses[2:]) < 0.2 * losses[0], losses
