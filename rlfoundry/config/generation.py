"""Typed configs of verl's offline entry points: ``generation.yaml`` (``trainer.main_generation``) and
``evaluation.yaml`` (``trainer.main_eval``), with verl's key layout and defaults.

Where a default differs from verl's, a trailing ``# verl: <value>`` says verl's; the reasons are the
trainer schema's (``config/schema.py``): ``rollout.name`` hf runs everywhere, ``trainer.device`` auto
picks cuda when there is one, and the paths have no default (verl's point at its authors' machines).
``rollout`` is the trainer's own ``RolloutConfig`` with generation.yaml's sampling defaults, so a key
means the same thing in both. Loading, checks and the translation to a worker's config live in the
entry modules (``trainer/main_generation.py``, ``trainer/main_eval.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from rlfoundry.config.schema import CustomRewardFunctionConfig, Node, RolloutConfig, _dict, _sub, one_of

__all__ = ["EvaluationConfig", "GenerationConfig", "generation_rollout_defaults"]


@dataclass
class GenerationTrainerConfig(Node):
    nnodes: int = 1
    n_gpus_per_node: int = 1  # verl: 8. Ranks on one machine (processes; CPU ranks too, as the trainer's)
    device: str = one_of(("auto", "cuda", "cpu"), "auto")  # verl: cuda


@dataclass
class GenerationDataConfig(Node):
    path: Optional[str] = None  # verl: ~/data/rlhf/math/test.parquet
    prompt_key: str = "prompt"
    n_samples: int = 5
    output_path: Optional[str] = None  # verl: /opt/tiger/math_Qwen2-7B-Instruct.parquet
    batch_size: int = 128
    trust_remote_code: bool = False  # verl reads it with data.get(); the tokenizer's (model.trust_remote_code too)
    apply_chat_template_kwargs: Dict[str, Any] = _dict()


@dataclass
class GenerationModelConfig(Node):
    path: Optional[str] = None  # verl: ~/models/Qwen2-7B-Instruct
    external_lib: Optional[str] = None
    trust_remote_code: bool = False  # verl's scripts add it: +model.trust_remote_code=True


def generation_rollout_defaults() -> RolloutConfig:
    """generation.yaml's ``rollout`` values where they differ from the trainer's defaults."""
    return RolloutConfig(temperature=1.0, top_k=50, top_p=0.7, prompt_length=1536, response_length=512, n=1,
                         load_format="auto", log_prob_micro_batch_size_per_gpu=8)


@dataclass
class GenerationConfig(Node):
    trainer: GenerationTrainerConfig = _sub(GenerationTrainerConfig)
    data: GenerationDataConfig = _sub(GenerationDataConfig)
    model: GenerationModelConfig = _sub(GenerationModelConfig)
    rollout: RolloutConfig = field(default_factory=generation_rollout_defaults)
    # verl builds its rollout worker from these; generation runs the rollout role alone here (no effect)
    actor: Dict[str, Any] = _dict(strategy="fsdp", ulysses_sequence_parallel_size=1)
    ray_kwargs: Dict[str, Any] = _dict(ray_init={"num_cpus": None}, timeline_json_file=None)  # no Ray here


@dataclass
class EvaluationDataConfig(Node):
    path: Optional[str] = None  # verl: /tmp/math_Qwen2-7B-Instruct.parquet
    prompt_key: str = "prompt"
    response_key: str = "responses"
    data_source_key: str = "data_source"
    reward_model_key: str = "reward_model"
    # rlfoundry: also write the printed metrics as JSON here (verl prints them only)
    output_path: Optional[str] = None


@dataclass
class EvaluationScoringConfig(Node):
    """rlfoundry: how main_eval scores (the trainer's rule-reward pool, rewards/pool.py): a response whose scorer
    raises, passes ``timeout_s`` or kills its process scores ``failure_score``, counted and named, and the
    evaluation goes on. ``num_workers`` null: min(4, CPUs) scorer processes; 0: in the driver, no time limit."""

    num_workers: Optional[int] = None
    timeout_s: float = 30.0
    failure_score: float = 0.0


@dataclass
class EvaluationConfig(Node):
    data: EvaluationDataConfig = _sub(EvaluationDataConfig)
    scoring: EvaluationScoringConfig = _sub(EvaluationScoringConfig)
    custom_reward_function: CustomRewardFunctionConfig = _sub(CustomRewardFunctionConfig)
    ray_kwargs: Dict[str, Any] = _dict(ray_init={"num_cpus": None}, timeline_json_file=None)  # no Ray here
