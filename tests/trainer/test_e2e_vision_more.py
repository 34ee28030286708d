"""``rlfoundry train`` on image rows, continued: resume, LoRA and dynamic batch size with the tiny Qwen2-VL.

Each test runs the real builder (``main_ppo.build_trainer``) on the synthetic shapes rows, in process
(``trainer.worker_backend=local``) so that the actor's module can be read back.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.trainer import _e2e as E
from tests.trainer.test_e2e_vision import shapes_dir  # noqa: F401 - fixture
from tests.workers import reassociation_bound, vocab_rows

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


EPS = "actor_rollout_ref.actor.optim.eps=1e-3"


def _overrides(model, run_dir, data, reward, *extra):
    return E.tiny_overrides(
        model, run_dir, f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'test.parquet'}",
        "data.max_prompt_length=128", "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.optim.lr=1e-2",
        "actor_rollout_ref.rollout.temperature=1.0", "actor_rollout_ref.actor.use_kl_loss=true",
        f"custom_reward_function.path={reward}", "trainer.worker_backend=local", *extra)


def _actor_module(run):
    return next(iter(run.trainer.actor_rollout_wg.worker.workers.values())).actor.module


def _step_record(run_dir, step):
    return next(r for r in E.read_records(run_dir) if r["step"] == step and "actor/pg_loss" in r)


@pytest.mark.numerics
def test_a_resumed_run_on_image_rows_repeats_the_next_step(tiny_vlm_dir, shapes_dir, tmp_path):
    """Save at step 2, resume for step 3: the same rollout (sampled from the pixels), log-probs,
    advantages and metrics as the run that never stopped."""
    reward = E.write_reward_file(tmp_path)

    def overrides(run_dir, steps, *extra):
        return _overrides(tiny_vlm_dir, run_dir, shapes_dir, reward, f"trainer.total_training_steps={steps}", *extra)

    straight = E.train(overrides(tmp_path / "straight", 3))
    E.train(overrides(tmp_path / "split", 2, "trainer.save_freq=2"))
    resumed = E.train(overrides(tmp_path / "split", 3))
    assert len(resumed.batches) == 1  # steps 1-2 came from the checkpoint
    want, got = straight.batches[-1], resumed.batches[0]
    for key in ("input_ids", "position_ids", "responses", "old_log_probs", "ref_log_prob", "advantages"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=0, msg=key)
    for a, b in zip(got["multi_modal_inputs"], want["multi_modal_inputs"], strict=True):  # the same images
        assert torch.equal(a["pixel_values"], b["pixel_values"]) and torch.equal(a["image_grid_thw"], b["image_grid_thw"])
    assert (want["advantages"].abs().max() > 0) and not torch.equal(straight.batches[0]["responses"], want["responses"])
    step3 = [_step_record(tmp_path / d, 3) for d in ("straight", "split")]
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
        # resume repeats the straight run's arithmetic (bit for bit in practice); a resume bug (another batch or lost
        # optimiser state) moves these by >1e-2
        assert step3[1][key] == pytest.approx(step3[0][key], rel=1e-5, abs=1e-7), key


LORA = ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=all-linear"]


def _base_log_probs(model, batch) -> torch.Tensor:
    """A plain HF forward of the base VLM over a recorded batch with every row's pixels."""
    inputs = batch["multi_modal_inputs"]
    pixels = {k: torch.cat([r[k] for r in inputs]) for k in ("pixel_values", "image_grid_thw")}
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"].transpose(0, 1), **pixels).logits
    logits[..., [model.config.image_token_id, model.config.video_token_id]] = float("-inf")
    width = batch["responses"].shape[1]
    lp = logits[:, -width - 1:-1].log_softmax(-1)
    return lp.gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


# verl's VLM LoRA scripts exclude the tower by hand; freeze_vision_tower leaves it out as well (all-linear
# alone also adapts the tower's linear layers, as peft and verl do)
@pytest.mark.parametrize("tower", ["actor_rollout_ref.model.exclude_modules=.*visual.*",
                                   "actor_rollout_ref.model.freeze_vision_tower=true"],
                         ids=["exclude_modules", "freeze_vision_tower"])
@pytest.mark.numerics
def test_lora_on_image_rows_trains_the_language_models_adapter_only(tiny_vlm_dir, shapes_dir, tmp_path, tower):
    pytest.importorskip("peft")
    from rlfoundry.models.hf import load_hf_model

    reward = E.write_reward_file(tmp_path)
    run = E.train(_overrides(tiny_vlm_dir, tmp_path / "run", shapes_dir, reward, *LORA, tower), keep_trainer=True)
    for step in (1, 2):
        assert math.isfinite(run.step(step)["actor/pg_loss"]) and math.isfinite(run.step(step)["actor/kl_loss"])

    base = load_hf_model(tiny_vlm_dir).eval()
    mask = [b["response_mask"].bool() for b in run.batches]
    for b, m in zip(run.batches, mask):  # the reference is the base model on the pixels (adapter off)
        # the reference with the adapter off vs the base model loaded plainly: fp32 rounding only: the same forward in
        # another order (~u·sqrt(H + V)·|logit| ~ 1e-6 per log-prob)
        torch.testing.assert_close(b["ref_log_prob"][m], _base_log_probs(base, b)[m], atol=1e-5, rtol=0)
    first, second = run.batches
    # B = 0 at the start: before any update the adapted policy is the base one
    torch.testing.assert_close(first["old_log_probs"][mask[0]], first["ref_log_prob"][mask[0]], atol=1e-6, rtol=0)
    assert (second["old_log_probs"] - second["ref_log_prob"])[mask[1]].abs().max() > 1e-3  # the adapter moved

    module = _actor_module(run)
    original = dict(base.named_parameters())
    adapters = set()
    for name, p in module.named_parameters():
        if ".lora_A." in name or ".lora_B." in name:
            adapters.add(name)
            continue
        hf = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
        torch.testing.assert_close(p.detach(), original[hf], atol=0, rtol=0, msg=name)  # base weights untouched
        assert not p.requires_grad, name
    # the adapter is on the language model only: the vision tower (and its merger) keeps its function
    assert adapters and not any(".visual." in n for n in adapters), sorted(n for n in adapters if ".visual." in n)[:4]
    assert any(".language_model." in n for n in adapters)
    changed = {n for n in adapters if ".lora_B." in n and module.get_parameter(n).detach().abs().max() > 0}
    assert changed  # the update reached the adapter


def test_freeze_vision_tower_adds_the_tower_to_the_users_exclusions():
    import re

    from rlfoundry.models.lora import LoraSpec

    names = ["model.visual.blocks.0.attn.qkv", "model.visual.merger.mlp.0", "model.language_model.layers.0.mlp.up_proj",
             "model.language_model.layers.0.self_attn.q_proj", "lm_head"]
    for user in (None, ["up_proj"], r".*\.up_proj"):
        excluded = LoraSpec(rank=8, exclude_modules=user, frozen_vision_tower=True)._excluded()
        assert [n for n in names if re.fullmatch(excluded, n)] == names[:3 if user else 2], (user, excluded)
    assert LoraSpec(rank=8, exclude_modules=["up_proj"])._excluded() == ["up_proj"]  # no tower: as given


@pytest.mark.numerics
def test_dynamic_batch_size_on_image_rows_gives_the_fixed_micro_batch_update(tiny_vlm_dir, shapes_dir, tmp_path,
                                                                            monkeypatch):
    """use_dynamic_bsz packs image rows by token count (here at most 2 rows a micro-batch, each taking
    its own rows' pixel inputs, against the fixed 4): the same log-probs, losses, gradient norms and
    weights as fixed micro-batches, within fp32 summation-order rounding."""
    from rlfoundry.engines.fsdp import forward

    plans: list[list[list[int]]] = []
    packer = forward.length_sorted_micro_batches
    monkeypatch.setattr(forward, "length_sorted_micro_batches", lambda *a, **k: plans.append(packer(*a, **k)) or plans[-1])
    reward = E.write_reward_file(tmp_path)
    # eps=1e-3: each Adam step changes by at most lr/eps = 10x a change in its gradient (with eps=1e-8 a
    # gradient ~0 whose last bits differ moves its weight anywhere in [-lr, lr]: #51); elements with
    # |g| >> 1e-3 still take Adam's normalised ~lr steps
    fixed = E.train(_overrides(tiny_vlm_dir, tmp_path / "fixed", shapes_dir, reward, EPS), keep_trainer=True)
    assert not plans
    width = fixed.batches[0]["attention_mask"].shape[1]  # a padded row's tokens (the image forward pads)
    dynamic = E.train(_overrides(tiny_vlm_dir, tmp_path / "dynamic", shapes_dir, reward, EPS,
                                 "actor_rollout_ref.actor.use_dynamic_bsz=true",
                                 f"actor_rollout_ref.actor.ppo_max_token_len_per_gpu={2 * width + width // 2}"),
                      keep_trainer=True)
    assert plans and all(max(len(m) for m in plan) <= 2 for plan in plans), plans
    assert len(dynamic.batches) == 2
    for a, b in zip(fixed.batches, dynamic.batches, strict=True):
        assert torch.equal(a["responses"], b["responses"])
        m = a["response_mask"].bool()
        for key in ("old_log_probs", "ref_log_prob"):
            # packed in other micro-batches: fp32 rounding only: the same forward in another order (~u·sqrt(H +
            # V)·|logit| ~ 1e-6 per log-prob)
            torch.testing.assert_close(b[key][m], a[key][m], atol=1e-5, rtol=0, msg=key)
    for step in (1, 2):  # fp32 summation order over the tokens (u x ~500 x a few terms ~ 1e-4 at most)
        f, d = fixed.step(step), dynamic.step(step)
        for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl"):
            assert d[key] == pytest.approx(f[key], rel=1e-4, abs=1e-6), (step, key)
    # The weights after two Adam steps at lr 1e-2. The gradients differ by fp32 summation order only,
    # normwise within reassociation_bound (tests/workers/__init__.py) times their norm (<= grad_clip,
    # 1.0); each step passes that on times lr/eps = 10, doubled for the second gradient being taken at
    # weights the first moved apart: 2 steps x 2 x 10 x bound per tensor's 2-norm (~1e-3). (With eps=1e-8
    # one element of the vision merger had moved 2.6e-5 apart, and may move up to 2 lr on another CPU.)
    # A row given another row's pixels changes its gradient by O(1): >= lr = 1e-2 on a 64-element tensor.
    params = [dict(_actor_module(r).named_parameters()) for r in (fixed, dynamic)]
    vocab = vocab_rows(params[0])
    bound = 2 * 2 * (1e-2 / 1e-3) * reassociation_bound(vocab, int(fixed.batches[0]["attention_mask"].numel())) * 1.0
    moved = 0.0
    base = dict(_load_base(tiny_vlm_dir).named_parameters())
    for name, p in params[0].items():
        err = float((params[1][name].detach() - p.detach()).norm())
        assert err <= bound, f"{name}: weights {err:.2e} apart in the 2-norm (bound {bound:.1e})"
        moved = max(moved, (p.detach() - base[name]).abs().max().item())
    assert moved > 1e-2  # the update did something, so equality is not vacuous


def _load_base(path):
    from rlfoundry.models.hf import load_hf_model

    return load_hf_model(path)
