"""verl's ``distillation.*`` group: its defaults, how teachers resolve (one default entry, or several
keyed entries with the default dropped), and the start-up errors for what verl refuses or we lack."""

from __future__ import annotations

import warnings

import pytest

from rlfoundry.config.distillation import resolve_teachers
from rlfoundry.config.typed import ConfigError
from rlfoundry.trainer.config import load_config, resolve_config

ON = ("distillation.enabled=true",)
ONE = (*ON, "distillation.teacher_models.teacher_model.model_path=/models/teacher")
TOPK = (*ONE, "distillation.distillation_loss.loss_mode=forward_kl_topk")


def _load(*overrides: str):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return resolve_config(load_config(list(overrides)), steps_per_epoch=10, cuda_available=False)


def _error(*overrides: str) -> str:
    with pytest.raises(ConfigError) as e:
        _load(*overrides)
    return str(e.value)


def test_defaults_are_verls_yaml():
    loss = _load().distillation.distillation_loss
    # verl's distillation.yaml (not its dataclass, whose defaults the YAML overrides)
    assert (loss.loss_mode, loss.topk, loss.use_task_rewards, loss.use_policy_gradient) == ("k3", 32, True, False)
    assert (loss.loss_max_clamp, loss.log_prob_min_clamp, loss.distillation_loss_coef) == (None, None, 1.0)


def test_one_teacher_scores_every_row_under_the_key_default():
    teachers = resolve_teachers(_load(*ONE).distillation)
    assert list(teachers) == ["default"] and teachers["default"].model_path == "/models/teacher"


def test_added_teachers_drop_the_default_entry_and_route_by_their_keys():
    cfg = _load(*ONE, "+distillation.teacher_models.a.key=src/a", "+distillation.teacher_models.a.model_path=/m/a",
                "+distillation.teacher_models.b.key=src/b", "+distillation.teacher_models.b.model_path=/m/b")
    teachers = resolve_teachers(cfg.distillation)
    assert {k: t.model_path for k, t in teachers.items()} == {"src/a": "/m/a", "src/b": "/m/b"}


@pytest.mark.parametrize("overrides,message", [
    ((*ONE, "distillation.distillation_loss.loss_mode=k1"), "the gradient of k1 = log p - log q does not depend"),
    # the top-k loss needs the logits of the response positions: not under the fused head or Megatron's CP
    ((*TOPK, "actor_rollout_ref.actor.strategy=megatron", "actor_rollout_ref.actor.megatron.context_parallel_size=2"),
     "top-k log-probs under context parallelism are not built"),
    ((*TOPK, "actor_rollout_ref.model.use_fused_kernels=true"), "set use_fused_kernels=false"),
    ((*TOPK, "distillation.distillation_loss.topk=0"), "needs distillation.distillation_loss.topk >= 1"),
    ((*ONE, "distillation.distillation_loss.policy_loss_mode=gspo"), "policy_loss_mode"),
    ((*ONE, "data.max_prompt_length=512", "distillation.teacher_models.teacher_model.inference.max_model_len=100"),
     "inference.max_model_len=100 is below prompt + response + 1"),
    ((*ONE, "distillation.teacher_models.teacher_model.inference.gpu_mem_util=0.5"), "gpu_memory_utilization"),
    ((*ON, "+distillation.teacher_models.a.key=x", "+distillation.teacher_models.a.model_path=/m",
      "+distillation.teacher_models.b.key=x", "+distillation.teacher_models.b.model_path=/m"), "two teachers have key='x'"),
    ((*ON, "+distillation.teacher_models.a.model_path=/m", "+distillation.teacher_models.b.key=y",
      "+distillation.teacher_models.b.model_path=/m"), "a teacher has no key"),
    # verl's pool check: 2 teachers x 1 replica x tensor parallel 2 = 4 GPUs, but the pool has 8 x 1
    ((*ON, "distillation.nnodes=1", "+distillation.teacher_models.a.key=x", "+distillation.teacher_models.a.model_path=/m",
      "+distillation.teacher_models.a.num_replicas=1", "+distillation.teacher_models.b.key=y",
      "+distillation.teacher_models.b.model_path=/m", "+distillation.teacher_models.b.num_replicas=1"), "add up to 4"),
])
def test_what_verl_refuses_or_is_not_built_is_a_start_up_error(overrides, message):
    assert message in _error(*overrides)


@pytest.mark.parametrize("engine", [(), ("model_engine=megatron",)], ids=["fsdp", "megatron"])
def test_the_top_k_loss_starts_on_either_engine(engine):
    cfg = _load(*engine, *TOPK, "distillation.distillation_loss.topk=64")
    assert (cfg.distillation.distillation_loss.loss_mode, cfg.distillation.distillation_loss.topk) == ("forward_kl_topk", 64)
    assert cfg.actor_rollout_ref.actor.strategy == ("megatron" if engine else "fsdp")


def test_the_top_k_loss_as_a_policy_gradient_is_warned_about_as_verl_does():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_config(load_config([*TOPK, "distillation.distillation_loss.use_policy_gradient=true"]),
                       steps_per_epoch=10, cuda_available=False)
    assert any("the teacher's top-k distribution is mostly unused" in str(w.message) for w in caught)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_config(load_config(list(TOPK)), steps_per_epoch=10, cuda_available=False)
    assert not any("mostly unused" in str(w.message) for w in caught)


def test_engine_sizing_keys_are_named_as_having_no_effect():
    from rlfoundry.config.verl_compat import NoEffectKeyWarning

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_config([*ONE, "distillation.teacher_models.teacher_model.inference.gpu_memory_utilization=0.4",
                     "distillation.teacher_models.teacher_model.inference.temperature=0.7",
                     "distillation.teacher_models.teacher_model.inference.max_model_len=4096"])
    (text,) = [str(w.message) for w in caught if issubclass(w.category, NoEffectKeyWarning)]
    assert "inference.gpu_memory_utilization" in text and "inference.temperature" in text
    assert "max_model_len" not in text  # checked, so it has an effect (a start-up error when too small)
