"""``distillation.teacher_models`` resolved as verl resolves it, and the group's start-up checks.

The entries are an open dict in the schema (verl users add them by name with ``+``); here each becomes a
typed ``TeacherModelConfig`` (an unknown key names the nearest valid one) keyed by the routing value its
rows carry in ``distillation.teacher_key`` (docs/distillation.md).
"""

from __future__ import annotations

from rlfoundry.config.schema import (
    DISTILLATION_TOPK_MODES,
    DistillationConfig,
    PPOConfig,
    TeacherModelConfig,
)
from rlfoundry.config.typed import ConfigError, to_typed

__all__ = ["resolve_teachers", "distillation_errors", "DEFAULT_TEACHER"]

DEFAULT_TEACHER = "teacher_model"  # verl's single-teacher entry, dropped when other entries are added


def resolve_teachers(distillation: DistillationConfig) -> dict[str, TeacherModelConfig]:
    """Routing key -> teacher: the one ``teacher_model`` entry alone scores every row (key "default");
    with other entries it is dropped and each entry routes by its own ``key``."""
    entries = dict(distillation.teacher_models or {})
    if len(entries) > 1:
        entries.pop(DEFAULT_TEACHER, None)
    out: dict[str, TeacherModelConfig] = {}
    for name, entry in entries.items():
        teacher = to_typed(TeacherModelConfig, entry, name=f"distillation.teacher_models.{name}")
        key = "default" if len(entries) == 1 else teacher.key
        if key in out:
            raise ConfigError(f"distillation.teacher_models: two teachers have key={key!r}; give each its own key.")
        out[key] = teacher
    return out


def distillation_errors(cfg: PPOConfig) -> list[str]:
    """Every problem of an enabled ``distillation`` group (none when it is off: verl reads nothing then)."""
    distillation = cfg.distillation
    if not distillation.enabled:
        return []
    try:
        teachers = resolve_teachers(distillation)
    except ConfigError as e:
        return [str(e)]
    return (_loss_errors(distillation) + _topk_errors(cfg) + _teacher_errors(distillation, teachers)
            + _length_errors(cfg, teachers))


def _loss_errors(distillation: DistillationConfig) -> list[str]:
    loss, errors = distillation.distillation_loss, []
    if loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        errors.append(f"distillation.distillation_loss.loss_mode={loss.loss_mode} with use_policy_gradient=false: the "
                      "gradient of k1 = log p - log q does not depend on the teacher; set use_policy_gradient=true "
                      "or loss_mode=k3.")
    return errors


def _topk_errors(cfg: PPOConfig) -> list[str]:
    """What the top-k modes need: a k, and the actor's and the teachers' (the reference's) forwards holding the
    logits of the response positions: unfused, and without context parallelism on Megatron."""
    loss = cfg.distillation.distillation_loss
    if loss.loss_mode not in DISTILLATION_TOPK_MODES:
        return []
    where, arr = f"distillation.distillation_loss.loss_mode={loss.loss_mode}", cfg.actor_rollout_ref
    errors = []
    if loss.topk is None or loss.topk < 1:
        errors.append(f"{where} needs distillation.distillation_loss.topk >= 1 (got {loss.topk}); verl's default is 32.")
    for role in ("actor", "ref"):
        sub = getattr(arr, role)
        if sub.strategy == "megatron" and sub.megatron.context_parallel_size > 1:
            errors.append(f"{where} with actor_rollout_ref.{role}.megatron.context_parallel_size="
                          f"{sub.megatron.context_parallel_size}: top-k log-probs under context parallelism are not "
                          "built; set it to 1.")
    if arr.model.use_fused_kernels:
        errors.append(f"{where} with actor_rollout_ref.model.use_fused_kernels=true: the fused head never holds the "
                      "logits the top-k loss reads; set use_fused_kernels=false.")
    return errors


def _teacher_errors(distillation: DistillationConfig, teachers: dict[str, TeacherModelConfig]) -> list[str]:
    errors = []
    for key, t in teachers.items():
        where = "distillation.teacher_models" + ("" if key == "default" else f" (key={key})")
        if not t.model_path:
            errors.append(f"{where}: model_path is not set; set it to the teacher checkpoint.")
        if key is None:
            errors.append(f"{where}: a teacher has no key; with several teachers each needs key=<value of "
                          f"{distillation.teacher_key}> (the default entry teacher_model is dropped then).")
    return errors + _pool_errors(distillation, teachers)


def _pool_errors(distillation: DistillationConfig, teachers: dict[str, TeacherModelConfig]) -> list[str]:
    """verl's check of its teacher pool, kept so that a line verl refuses is refused here too."""
    pool = distillation.n_gpus_per_node * distillation.nnodes
    if len(teachers) == 1:
        per = next(iter(teachers.values())).inference.replica_size()
        if per and pool % per:
            return [f"distillation: the teacher's replica size {per} (inference tensor × data × pipeline parallel) "
                    f"must divide n_gpus_per_node × nnodes = {pool} (verl's check)."]
        return []
    size = sum(t.num_replicas * t.inference.replica_size() for t in teachers.values())
    if size != pool:
        return [f"distillation: the teachers' num_replicas × replica size add up to {size}, but "
                f"n_gpus_per_node × nnodes = {pool}; verl requires them equal."]
    return []


def _length_errors(cfg: PPOConfig, teachers: dict[str, TeacherModelConfig]) -> list[str]:
    """verl's check of ``inference.max_model_len``: it must hold the student's prompt, its whole response
    and one more token (verl asks its engine for one token after the sequence)."""
    errors = []
    for key, t in teachers.items():
        inf = t.inference
        need = (inf.prompt_length or cfg.data.max_prompt_length) + (inf.response_length or cfg.data.max_response_length) + 1
        if inf.max_model_len is not None and need > inf.max_model_len:
            errors.append(f"distillation teacher {key!r}: inference.max_model_len={inf.max_model_len} is below prompt + "
                          f"response + 1 = {need}; raise it or shorten data.max_prompt_length/max_response_length.")
    return errors
