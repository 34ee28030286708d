"""End-to-end: on-policy distillation (verl's ``distillation.*``) on the real trainer, tiny models, CPU.

The teacher is the student's own tiny model with its head's weight x 3: a sharper version of the
student, which the student can reach by sharpening (so a few steps show the direction clearly). Properties:
- the batch's ``teacher_logprobs`` are the teacher checkpoint's own log-probs of the sampled tokens
  (an independent HF forward of the teacher), not the student's;
- distilling with k3 (supervised) and with k1 as a policy gradient, task rewards off, moves the student
  toward the teacher on the first step's samples: the mean |log pi_student - log pi_teacher| there falls
  below 0.7 of its start (measured ~0.52 for both after 12 steps at lr 1e-3; an ignored loss leaves it
  where it was, since the task loss is off, and a sign-flipped one raises it);
- with two teachers keyed by ``data_source``, each row is scored by its own teacher's checkpoint;
- with ``forward_kl_topk`` the batch carries the teacher checkpoint's own top-k log-probs and ids
  (``teacher_logprobs``, ``teacher_ids``, (B, Tr, k)), and the student moves toward the teacher on the padded
  (shared-prompt) and on the packed forward alike: the first step's logged loss is the formula written out on
  the starting student's logits, and the trained student's loss on those samples is below 0.7 of it.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfoundry.protocol import DataProto
from tests.trainer import _e2e as E

pytestmark = pytest.mark.slow
INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def _sharpened_model(directory, seed: int, scale: float):
    from transformers import AutoModelForCausalLM

    from rlfoundry.models.tiny import save_tiny_model

    path = save_tiny_model(directory, seed=seed, tie_word_embeddings=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(scale)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
    return _sharpened_model(tmp_path_factory.mktemp("teacher"), seed=0, scale=3.0)


def _hf_log_probs(model_dir, batch) -> torch.Tensor:
    """log pi(response token) (B, Tr) at temperature 1 from a plain HF forward of ``model_dir``."""
    from transformers import AutoModelForCausalLM

    width = batch["responses"].shape[1]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -width - 1:-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)


def _distill(student, teacher, run_dir, *loss: str, steps: int = 12):
    overrides = E.tiny_overrides(
        student, run_dir, "distillation.enabled=true", f"distillation.teacher_models.teacher_model.model_path={teacher}",
        "distillation.teacher_models.teacher_model.inference.dtype=float32",
        "distillation.distillation_loss.use_task_rewards=false", *loss, "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.temperature=1.0", "data.max_response_length=8",
        f"trainer.total_training_steps={steps}")
    return E.train(overrides, keep_trainer=True)


def _gap(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> float:
    return float((student - teacher).abs()[mask].mean())


@pytest.mark.parametrize("loss", [("distillation.distillation_loss.loss_mode=k3",),
                                  ("distillation.distillation_loss.loss_mode=k1",
                                   "distillation.distillation_loss.use_policy_gradient=true")], ids=["k3", "k1_pg"])
def test_the_student_moves_toward_the_teacher(tiny_model_dir, teacher_dir, tmp_path, loss):
    run = _distill(tiny_model_dir, teacher_dir, tmp_path / "run", *loss)
    first = run.batches[0]
    mask = first["response_mask"].bool()
    # the teacher's log-probs are the teacher checkpoint's, not the student's (by an independent forward)
    teacher = _hf_log_probs(teacher_dir, first)
    torch.testing.assert_close(first["teacher_logprobs"][mask], teacher[mask], atol=1e-4, rtol=1e-4)
    assert _gap(first["old_log_probs"], teacher, mask) > 0.2  # the two models disagree before training
    data = DataProto.from_dict(tensors={k: first[k] for k in INPUTS}, meta_info={"temperature": 1.0})
    after = run.trainer.actor_rollout_wg.compute_log_prob(data).batch["old_log_probs"]
    before_gap, after_gap = _gap(first["old_log_probs"], teacher, mask), _gap(after, teacher, mask)
    assert after_gap < 0.7 * before_gap, (before_gap, after_gap)
    record = run.step(1)
    assert "distillation/loss" in record and "timing_s/teacher" in record


def _hf_logits(model, batch) -> torch.Tensor:
    """Logits (B, Tr, V) of the positions that predict the response tokens, plain HF forward."""
    width = batch["responses"].shape[1]
    with torch.no_grad():
        return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                     position_ids=batch["position_ids"]).logits[:, -width - 1:-1].float()


def _topk_kl(model, batch, mask) -> float:
    """Token-mean of verl's per-token forward KL over the batch's teacher top-k, the student ``model``'s
    log-probs written out here from its logits: sum_i e^q_i (q_i - s_i), floored at 0."""
    student = torch.log_softmax(_hf_logits(model, batch), -1).gather(-1, batch["teacher_ids"])
    q = batch["teacher_logprobs"]
    return float((q.exp() * (q - student)).sum(-1).clamp_min(0)[mask].mean())


@pytest.mark.parametrize("forward", [(), ("actor_rollout_ref.model.use_remove_padding=true",
                                          "actor_rollout_ref.model.use_shared_prompt=false")],
                         ids=["padded", "packed"])
def test_top_k_forward_kl_moves_the_student_toward_the_teacher(tiny_model_dir, teacher_dir, tmp_path, forward):
    from transformers import AutoModelForCausalLM

    run = _distill(tiny_model_dir, teacher_dir, tmp_path / "run", "distillation.distillation_loss.loss_mode=forward_kl_topk",
                   "distillation.distillation_loss.topk=16", *forward)
    first = run.batches[0]
    mask = first["response_mask"].bool()
    # the batch's top-k is the teacher checkpoint's, by an independent forward
    assert first["teacher_logprobs"].shape == (*first["responses"].shape, 16)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    top = torch.log_softmax(_hf_logits(teacher, first), -1).topk(16, -1)
    torch.testing.assert_close(first["teacher_logprobs"][mask], top.values[mask], atol=1e-4, rtol=1e-4)
    assert torch.equal(first["teacher_ids"][mask], top.indices[mask])
    # step 1's loss (one mini-batch, before any optimiser step) is the formula on the starting student
    start = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    before = _topk_kl(start, first, mask)
    assert run.step(1)["distillation/loss"] == pytest.approx(before, abs=1e-5)
    trained = run.trainer.actor_rollout_wg.worker.workers["actor_rollout"].actor.module
    after = _topk_kl(trained, first, mask)
    assert after < 0.7 * before, (before, after)
    assert 0 < run.step(1)["distillation/teacher_mass"] <= 1 and "distillation/overlap_ratio" in run.step(1)


def test_two_teachers_each_score_the_rows_of_their_data_source(tiny_model_dir, teacher_dir, tmp_path):
    from rlfoundry.config.schema import PPOConfig
    from rlfoundry.config.typed import to_typed
    from rlfoundry.trainer.main_ppo import local_factory, teacher_classes
    from rlfoundry.trainer.ppo.teachers import teacher_log_probs, teacher_roles

    other = _sharpened_model(tmp_path / "other", seed=11, scale=4.0)
    teachers = {name: {"key": f"src/{name}", "model_path": str(path), "inference": {"dtype": "float32"}}
                for name, path in (("a", teacher_dir), ("b", other))}
    cfg = to_typed(PPOConfig, {"distillation": {"enabled": True, "teacher_models": teachers},
                               "trainer": {"device": "cpu"}})
    groups = local_factory(cfg)(teacher_classes(cfg))
    by_key = {key: groups[role] for key, role in teacher_roles(cfg.distillation).items()}
    for wg in by_key.values():
        wg.init_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (4, 10), generator=g)
    batch = DataProto.from_dict(
        tensors={"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 6:],
                 "position_ids": torch.arange(10).expand(4, 10).clone()},
        non_tensors={"data_source": np.array(["src/b", "src/a", "src/a", "src/b"], dtype=object)})
    got = teacher_log_probs(batch, by_key, "data_source")["teacher_logprobs"]
    want_a, want_b = _hf_log_probs(teacher_dir, batch.batch), _hf_log_probs(other, batch.batch)
    torch.testing.assert_close(got[[1, 2]], want_a[[1, 2]], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[[0, 3]], want_b[[0, 3]], atol=1e-4, rtol=1e-4)
    # the two teachers are told apart on every row: far beyond the 1e-4 tolerance above
    assert float((want_a - want_b).abs().amax(-1).min()) > 0.1
    with pytest.raises(ValueError, match="src/c"):
        teacher_log_probs(DataProto.from_dict(tensors=dict(batch.batch.items()),
                                              non_tensors={"data_source": np.array(["src/c"] * 4, dtype=object)}),
                          by_key, "data_source")
