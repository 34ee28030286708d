"""PPO/GRPO training entry point: ``python -m rlfoundry.trainer.main_ppo [key=value ...]``.

Same command line as verl's ``verl.trainer.main_ppo`` (Hydra-style dotted overrides; optional
``--config-name NAME`` for a packaged or user YAML overlay, ``--config-path DIR``). With no
arguments it runs the demo: GRPO on the built-in arithmetic task with the shipped tiny policy.

Start-up order: config (typed, validated) → the memory plan (``trainer.plan_check``) → file checks → run directory → data (the synthetic
task's parquet is generated into ``<run_dir>/data`` when ``data.train_files`` is null) →
tokenizer → datasets and loaders → resolved config (total steps known) → reward functions →
worker groups (in-process or Ray) → ``PPOTrainer.fit()``.

A mistake in the config or the data ends the run with exit code 2 and one paragraph saying what
and how to fix it — no traceback (set ``RLFOUNDRY_DEBUG=1`` to get one).
"""

from __future__ import annotations

import os
import random
import sys
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from rlfoundry.trainer.config import (
    ConfigError,
    auto_choices,
    check_startup_paths,
    judge_world_size,
    load_config,
    need_reference_policy,
    pool_config,
    resolve_asset_path,
    resolve_config,
    rollout_world_size,
    schema_keys,
)

# Nothing heavy at module level: reward-pool processes (spawn/forkserver) re-import the main
# module, so a top-level `import torch` here cost every scorer process seconds of start-up.
if TYPE_CHECKING:
    from rlfoundry.single_controller.base import ClassWithInitArgs, WorkerGroup
    from rlfoundry.single_controller.base.worker import WorkerRuntime

USAGE = """usage: rlfoundry train [--config-name NAME] [--config-path DIR] [key=value ...]

Trains with verl's config keys, e.g.
  rlfoundry train                                     # the demo: GRPO on synthetic arithmetic, CPU
  rlfoundry train --config-name arithmetic_ppo        # the same task with PPO + critic (GAE)
  rlfoundry train data.train_files=~/data/gsm8k/train.parquet data.val_files=~/data/gsm8k/test.parquet \\
      actor_rollout_ref.model.path=/models/Qwen2.5-0.5B-Instruct trainer.device=cuda

Options:
  --config-name NAME   overlay YAML, with or without .yaml (packaged: {packaged}) on the defaults;
                       its Hydra defaults: list is composed
  --config-path DIR    directory to look up --config-name in first (relative to the working directory);
                       then the packaged configs
  model_engine=NAME    verl's engine group: dp/fsdp (the default) or megatron
  --cfg job            print the resolved config and exit
  --help-keys          list every config key with its type
"""


# ───────────────────────────────────── argument handling ─────────────────────────────────────


def _split_args(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Separate ``--option value`` / ``--option=value`` flags from ``key=value`` overrides."""
    flags, overrides, it = {}, [], iter(argv)
    for arg in it:
        if arg.startswith("--"):
            name, sep, value = arg[2:].partition("=")
            if name in ("help", "help-keys"):
                flags[name] = "1"
            elif name in ("config-name", "config-path", "cfg"):
                flags[name] = value if sep else next(it, "")
            else:
                raise ConfigError(f"Unknown option '{arg}'. Config keys are given without dashes: key=value.")
        elif arg == "-h":
            flags["help"] = "1"
        else:
            overrides.append(arg)
    return flags, overrides


def _usage() -> str:
    from rlfoundry.trainer.config import CONFIG_DIR

    names = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml") if p.stem != "ppo_trainer")
    return USAGE.format(packaged=", ".join(names))


def _keys_help() -> str:
    from rlfoundry.config.typed import type_name

    lines = [f"{k}  ({type_name(info.type)}{', open' if info.is_open else ''})"
             for k, info in schema_keys().items() if not isinstance(info.type, type) or not hasattr(info.type, "__dataclass_fields__")]
    return "\n".join(lines)


# ───────────────────────────────────── data and tokenizer ─────────────────────────────────────


def run_dir_of(cfg: DictConfig) -> Path:
    """Where metrics, plots and generated data go: ``trainer.run_dir`` or the checkpoint directory."""
    return Path(os.path.expanduser(cfg.trainer.run_dir or cfg.trainer.default_local_dir))


def _check_writable(path: Path) -> None:
    """Fail before training, not at the first checkpoint, when the run directory cannot be written."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write_test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"Cannot write to the run directory {path} ({e.strerror}); set trainer.default_local_dir "
                          "(and trainer.run_dir) to a writable directory.") from e


def prepare_synthetic_data(cfg: DictConfig, run_dir: Path) -> tuple[str | None, str | None]:
    """With ``data.train_files`` null, write the synthetic task's train/test parquet (seeded) into ``run_dir/data``.

    The files are a pure function of ``data.synthetic.*``, so a resumed run regenerates identical
    files (or reuses them) and the loader state in the checkpoint still points at the same rows.
    """
    if cfg.data.train_files is not None:
        return None, None
    syn = cfg.data.synthetic
    if syn.task == "shape_colour":
        return _prepare_shape_colour(cfg, run_dir)
    if syn.task != "arithmetic":
        raise ConfigError(f"data.synthetic.task={syn.task!r}: the built-in tasks are 'arithmetic' and 'shape_colour'.")
    from rlfoundry.data.preprocess.arithmetic import ArithmeticSpec, generate_splits, make_row
    from rlfoundry.data.preprocess.common import PreprocessError, write_splits

    try:
        spec = ArithmeticSpec(syn.digits, syn.ops, syn.num_operands)
    except ValueError as e:
        raise ConfigError(f"data.synthetic: {e}") from e
    name = f"arithmetic_seed{syn.seed}_{syn.train_size}_{syn.val_size}"
    if spec != ArithmeticSpec():  # the default task keeps its directory name (existing runs resume)
        name += f"_d{syn.digits}_{''.join({'+': 'add', '-': 'sub', '*': 'mul'}[c] for c in syn.ops)}_k{syn.num_operands}"
    out = run_dir / "data" / name
    if not (out / "train.parquet").is_file() or not (out / "test.parquet").is_file():
        try:
            write_splits(generate_splits(syn.train_size, syn.val_size, seed=syn.seed, spec=spec), out, make_row)
        except PreprocessError as e:
            raise ConfigError(f"data.synthetic: {e}") from e
    val = str(out / "test.parquet") if cfg.data.val_files is None else None
    return str(out / "train.parquet"), val


def _prepare_shape_colour(cfg: DictConfig, run_dir: Path) -> tuple[str, str | None]:
    """The vision demo's task (``data/preprocess/shapes.py --question colour``): image rows for a
    vision-language policy, seeded by ``data.synthetic.seed`` (``digits``, ``ops`` do not apply)."""
    from rlfoundry.data.preprocess.common import write_splits
    from rlfoundry.data.preprocess.shapes import generate_splits, make_row

    syn = cfg.data.synthetic
    out = run_dir / "data" / f"shape_colour_seed{syn.seed}_{syn.train_size}_{syn.val_size}"
    if not (out / "train.parquet").is_file() or not (out / "test.parquet").is_file():
        write_splits(generate_splits(syn.train_size, syn.val_size, seed=syn.seed, task="colour"), out, make_row)
    val = str(out / "test.parquet") if cfg.data.val_files is None else None
    return str(out / "train.parquet"), val


def load_tokenizer(cfg: DictConfig) -> Any:
    """The policy's tokenizer (or ``data.tokenizer``); no pad token → EOS, with a warning (as verl)."""
    from transformers import AutoTokenizer

    path = resolve_asset_path(cfg.data.tokenizer or cfg.actor_rollout_ref.model.path)
    trust = bool(cfg.actor_rollout_ref.model.trust_remote_code)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust)
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"The tokenizer at {path} has neither a pad nor an EOS token; add one to tokenizer_config.json.")
        warnings.warn(f"The tokenizer at {path} has no pad token; using EOS ({tokenizer.eos_token!r}) for padding.",
                      stacklevel=2)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_processor(cfg: DictConfig) -> Any:
    """The actor model's processor when it is a vision-language model (verl's ``hf_processor``), else
    None: image rows are tokenised by it (its image tokens, the model's 3-D positions)."""
    from rlfoundry.models.vision import load_processor

    path = resolve_asset_path(cfg.actor_rollout_ref.model.path)
    return load_processor(path, trust_remote_code=bool(cfg.actor_rollout_ref.model.trust_remote_code))


def rollout_data_config(cfg: DictConfig) -> DictConfig:
    """``data`` as the rollout needs it: with ``rollout.multi_turn.enable`` the prompts offer the
    configured tools (``apply_chat_template_kwargs.tools``) and keep their messages (``return_raw_chat``),
    which a generative reward model also reads."""
    multi_turn = cfg.actor_rollout_ref.rollout.multi_turn
    spo = bool(OmegaConf.select(cfg, "trainer.spo.enable", default=False))  # SPO keys prompts by their messages
    if not multi_turn.enable and not cfg.reward.reward_model.enable and not spo:
        return cfg.data

    from rlfoundry.tools.registry import initialize_tools_from_config

    data = OmegaConf.create(OmegaConf.to_container(cfg.data, resolve=True))
    data.return_raw_chat = True  # the agent loop and the judge read the prompt's messages
    if multi_turn.enable and multi_turn.tool_config_path:
        tools = initialize_tools_from_config(resolve_asset_path(multi_turn.tool_config_path))
        data.apply_chat_template_kwargs.tools = [t.get_openai_tool_schema().model_dump() for t in tools]
    return data


def train_loader(dataset: Any, data: DictConfig, batch_size: int) -> Any:
    """The seeded (or ``data.sampler``'s), resumable, drop_last train loader; the order of prompts does
    not depend on ``batch_size`` (the fully-async rollouter draws ``data.gen_batch_size`` at a time from it)."""
    from rlfoundry.data import build_dataloader, create_rl_sampler

    return build_dataloader(dataset, batch_size=batch_size, num_workers=int(data.dataloader_num_workers),
                            drop_last=True, sampler=create_rl_sampler(data, dataset))


def build_dataloaders(cfg: DictConfig, tokenizer: Any, train_files: Any, val_files: Any,
                      processor: Any = None) -> tuple[Any, Any]:
    """Train loader (seeded, resumable, drop_last) and validation loader (whole set as one batch), over
    ``RLHFDataset`` or the user's ``data.custom_cls`` (verl's ``create_rl_dataset(..., processor)``)."""
    from rlfoundry.data import build_dataloader, create_rl_dataset

    data = rollout_data_config(cfg)
    train = train_loader(create_rl_dataset(train_files, data, tokenizer, processor, data.get("train_max_samples", -1)),
                         data, int(data.train_batch_size))
    if val_files is None:
        return train, None
    val_ds = create_rl_dataset(val_files, data, tokenizer, processor, data.get("val_max_samples", -1))
    val = build_dataloader(val_ds, batch_size=int(data.val_batch_size or len(val_ds)),
                           shuffle=bool(data.validation_shuffle), seed=int(data.seed), drop_last=False)
    return train, val


# ───────────────────────────────────── workers ─────────────────────────────────────


def worker_classes(cfg: DictConfig) -> dict[str, ClassWithInitArgs]:
    """Role name → worker class with init args. Every role shares one process per rank (colocated);
    with a rollout pool of its own, the trainer's policy role drops ``rollout`` (``actor`` or
    ``actor_ref``) and the class list gains ``rollout``, built in the rollout pool."""
    from rlfoundry.config.verl_compat import serves_reward_model
    from rlfoundry.single_controller.base import ClassWithInitArgs
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker

    apart = rollout_world_size(cfg) > 0
    role = ("actor_ref" if apart else "actor_rollout_ref") if need_reference_policy(cfg) else (
        "actor" if apart else "actor_rollout")
    distill = cfg.distillation.distillation_loss if cfg.distillation.enabled else None
    classes = {"actor_rollout": ClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role=role,
                                                  distillation_loss=distill)}
    if apart:
        classes["rollout"] = ClassWithInitArgs(ActorRolloutRefWorker, config=cfg.actor_rollout_ref, role="rollout")
    if cfg.critic.enable:
        from rlfoundry.workers.critic import CriticWorker

        classes["critic"] = ClassWithInitArgs(CriticWorker, config=cfg.critic, rollout_n=int(cfg.actor_rollout_ref.rollout.n))
    if serves_reward_model(cfg):  # verl's reward loop: the model on an engine, served to the custom function
        classes["genrm"] = ClassWithInitArgs(ActorRolloutRefWorker, config=reward_loop_worker_config(cfg), role="rollout")
    elif cfg.reward_model.enable:
        from rlfoundry.workers.reward_model import RewardModelWorker

        classes["rm"] = ClassWithInitArgs(RewardModelWorker, config=cfg.reward_model)
    if cfg.reward.reward_model.enable:  # the trainer gives it a pool of its own with enable_resource_pool
        classes["judge"] = ClassWithInitArgs(ActorRolloutRefWorker, config=judge_worker_config(cfg), role="rollout")
    return classes | teacher_classes(cfg)


def teacher_classes(cfg: Any) -> dict[str, ClassWithInitArgs]:
    """On-policy distillation: one reference-role worker per teacher, colocated (trainer/ppo/teachers.py)."""
    from rlfoundry.config.distillation import resolve_teachers
    from rlfoundry.single_controller.base import ClassWithInitArgs
    from rlfoundry.trainer.ppo.teachers import teacher_roles, teacher_worker_config
    from rlfoundry.workers.actor_rollout_ref import ActorRolloutRefWorker

    teachers = resolve_teachers(cfg.distillation) if cfg.distillation.enabled else {}
    return {role: ClassWithInitArgs(ActorRolloutRefWorker, role="ref",
                                    config=teacher_worker_config(cfg.actor_rollout_ref, teachers[key]))
            for key, role in teacher_roles(cfg.distillation).items()}


def judge_worker_config(cfg: DictConfig) -> dict[str, Any]:
    """``actor_rollout_ref`` for the generative reward model's worker: a rollout role (no optimiser, no
    weight syncs) on ``reward.reward_model.model_path`` with ``reward.reward_model.rollout``'s engine."""
    judge = cfg.reward.reward_model
    return _generator_config(cfg, judge.model_path, judge.trust_remote_code, judge.rollout)


def reward_loop_worker_config(cfg: DictConfig) -> dict[str, Any]:
    """``actor_rollout_ref`` for verl's reward loop's generative reward model: a rollout role on
    ``reward_model.model.path`` with ``reward_model.rollout``'s engine (served by rewards/reward_loop.py)."""
    rm = cfg.reward_model
    return _generator_config(cfg, rm.model.path, rm.model.get("trust_remote_code", False), rm.rollout)


def _generator_config(cfg: DictConfig, path: str, trust_remote_code: bool, rollout_cfg: Any) -> dict[str, Any]:
    """A rollout-only worker's config: weights from ``path``, never synced, generating as ``rollout_cfg`` says."""
    import dataclasses

    from rlfoundry.config.schema import RolloutConfig
    from rlfoundry.config.typed import plain

    known = {f.name for f in dataclasses.fields(RolloutConfig)}
    rollout = {k: v for k, v in plain(rollout_cfg).items() if k in known}
    model = {"path": path, "trust_remote_code": bool(trust_remote_code), "cpu_kernels": cfg.actor_rollout_ref.model.cpu_kernels}
    return {"model": model, "rollout": rollout}


def ray_init_args(cfg: DictConfig) -> dict[str, Any]:
    """``init_ray``'s arguments from ``ray_init`` (verl's ``ray_kwargs.ray_init``): the cluster address, a
    local instance's CPUs and GPUs, and the workers' ``runtime_env`` (``py_executable``, ``env_vars``, ...),
    whose unset (null) entries are left to Ray."""
    ray_init = cfg.ray_init
    runtime_env = {k: v for k, v in dict(ray_init.get("runtime_env") or {}).items() if v is not None}
    if runtime_env.get("env_vars"):  # Ray takes strings only (a command line's TRANSFER_QUEUE_ENABLE=1 is an int)
        runtime_env["env_vars"] = {str(k): str(v) for k, v in dict(runtime_env["env_vars"]).items()}
    if cfg.trainer.get("debug"):  # verl's SPO recipe: trainer.debug turns on Ray's legacy debugger
        runtime_env["env_vars"] = {**runtime_env.get("env_vars", {}), "RAY_DEBUG": "legacy"}
    return {"address": ray_init.get("address"), "num_cpus": ray_init.get("num_cpus"),
            "num_gpus": ray_init.get("num_gpus"), "runtime_env": runtime_env or None}


def _runtime(cfg: DictConfig) -> WorkerRuntime:
    """What every rank's process needs from ``trainer.*`` before its roles are built."""
    from rlfoundry.single_controller.base.worker import WorkerRuntime

    trainer = cfg.trainer
    return WorkerRuntime(device=trainer.device, dist_timeout_s=float(trainer.dist_timeout_s),
                         tune_malloc=bool(trainer.tune_malloc))


def _preload(cfg: DictConfig) -> None:
    """Before the process back end forks its ranks: the policy model's code, imported once here."""
    from rlfoundry.models.hf import import_model_code

    model = cfg.actor_rollout_ref.model
    import_model_code(model.path, trust_remote_code=bool(model.get("trust_remote_code", False)))


def local_factory(cfg: DictConfig):
    """In-process back end: world size 1, the workers live in this process (breakpoints work)."""
    from rlfoundry.single_controller import LocalWorkerGroup, create_colocated_worker_cls

    def build(classes: dict[str, ClassWithInitArgs], pool: str = "global_pool") -> dict[str, WorkerGroup]:
        return LocalWorkerGroup(create_colocated_worker_cls(classes, _runtime(cfg)),
                                name_prefix=pool).spawn(classes.keys())

    return build


def process_factory(cfg: DictConfig):
    """One machine without Ray: rank 0 in this process, n_gpus_per_node - 1 child processes. A
    rollout pool of its own runs wholly in child processes (the driver hosts the trainer's rank 0)
    and the machine's cores are shared out over both pools' processes."""
    from rlfoundry.single_controller import create_colocated_worker_cls
    from rlfoundry.single_controller.process import ProcessWorkerGroup, threads_per_rank

    def build(classes: dict[str, ClassWithInitArgs], pool: str = "global_pool") -> dict[str, WorkerGroup]:
        ranks = int(pool_config(cfg, pool).n_gpus_per_node)
        total = int(cfg.trainer.n_gpus_per_node) + rollout_world_size(cfg) + judge_world_size(cfg)
        group = ProcessWorkerGroup(create_colocated_worker_cls(classes, _runtime(cfg)), ranks,
                                   name_prefix=pool, call_timeout_s=cfg.trainer.worker_call_timeout_s,
                                   start_method=cfg.trainer.process_start_method, preload=lambda: _preload(cfg),
                                   host_rank_zero=pool == "global_pool", threads=threads_per_rank(total))
        return group.spawn(classes.keys())

    return build


def ray_factory(cfg: DictConfig):
    """Ray back end: one pool of nnodes × n_gpus_per_node processes, every role colocated in each; with
    a rollout pool of its own (``rollout.*``), a second pool for it. Joins ``ray_init.address``, else
    ``RAY_ADDRESS``, else a ``ray start`` cluster on this machine, else starts a private instance; each
    of a pool's nnodes entries is a distinct Ray node, and the run prints where every rank landed."""
    from rlfoundry.single_controller import (
        RayClassWithInitArgs,
        RayWorkerGroup,
        ResourcePoolManager,
        Role,
        create_colocated_worker_cls,
        init_ray,
    )

    managers: list[ResourcePoolManager] = []

    def manager() -> ResourcePoolManager:
        if not managers:  # both pools at once: the resource check sees the whole demand
            trainer = cfg.trainer
            init_ray(**ray_init_args(cfg))
            spec, mapping = {"global_pool": [int(trainer.n_gpus_per_node)] * int(trainer.nnodes)}, {Role.ActorRollout: "global_pool"}
            for pool, role, ranks in (("rollout_pool", Role.Rollout, rollout_world_size(cfg)),
                                      ("reward_pool", Role.RewardModel, judge_world_size(cfg))):
                if ranks:
                    spec[pool] = [int(pool_config(cfg, pool).n_gpus_per_node)] * int(pool_config(cfg, pool).nnodes)
                    mapping[role] = pool
            managers.append(ResourcePoolManager(spec, mapping, use_gpu=trainer.device == "cuda"))
            try:
                managers[0].create_resource_pool()
            except RuntimeError as e:  # the cluster is smaller than the config asks for: the numbers, no traceback
                raise ConfigError(str(e)) from None
        return managers[0]

    def build(classes: dict[str, ClassWithInitArgs], pool: str = "global_pool") -> dict[str, WorkerGroup]:
        role = {"rollout_pool": Role.Rollout, "reward_pool": Role.RewardModel}.get(pool, Role.ActorRollout)
        ray_classes = {k: RayClassWithInitArgs(c.cls, *c.args, **c.kwargs) for k, c in classes.items()}
        group = RayWorkerGroup(manager().get_resource_pool(role), create_colocated_worker_cls(ray_classes, _runtime(cfg)),
                               name_prefix=pool, call_timeout_s=cfg.trainer.worker_call_timeout_s)
        print(f"rlfoundry: {group.placement_summary()}", flush=True)
        return group.spawn(classes.keys())

    return build


# ───────────────────────────────────── the run ─────────────────────────────────────


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_trainer(cfg: DictConfig):
    """Everything up to a trainer with its workers started (tests call this too)."""
    import torch

    from rlfoundry.rewards import load_reward_manager

    from rlfoundry.trainer.plan_check import check_plan_fits

    check_plan_fits(cfg)  # from config.json alone, before the weights are looked for (trainer.plan_check)
    check_startup_paths(cfg)
    run_dir = run_dir_of(cfg)
    _check_writable(run_dir)
    _check_writable(Path(os.path.expanduser(cfg.trainer.default_local_dir)))
    syn_train, syn_val = prepare_synthetic_data(cfg, run_dir)
    tokenizer = load_tokenizer(cfg)
    train_files = cfg.data.train_files if cfg.data.train_files is not None else syn_train
    val_files = cfg.data.val_files if cfg.data.val_files is not None else syn_val
    train, val_loader = build_dataloaders(cfg, tokenizer, train_files, val_files, load_model_processor(cfg))
    if OmegaConf.select(cfg, "trainer.spo.enable", default=False) and cfg.data.gen_batch_size:
        # verl's SPO: the loader hands data.gen_batch_size prompts, of which a step draws train_batch_size
        train = train_loader(train.dataset, cfg.data, int(cfg.data.gen_batch_size))
    check_sandbox(cfg, [loader.dataset for loader in (train, val_loader) if loader is not None])
    resolved = resolve_config(cfg, steps_per_epoch=len(train), cuda_available=torch.cuda.is_available(),
                              train_files=syn_train, val_files=syn_val, run_dir=str(run_dir))
    for choice in auto_choices(cfg, resolved):
        print(f"rlfoundry: {choice}", flush=True)
    seed_everything(int(resolved.trainer.seed))
    _import_external_lib(resolved)
    reward_fn = load_reward_manager(resolved, tokenizer, num_examine=0)
    val_reward_fn = load_reward_manager(resolved, tokenizer, num_examine=1)
    factories = {"local": local_factory, "process": process_factory, "ray": ray_factory}
    factory = factories[resolved.trainer.worker_backend](resolved)
    gen = int(resolved.data.gen_batch_size)
    if resolved.async_training.mode == "fully_async" and gen != int(resolved.data.train_batch_size):
        train = train_loader(train.dataset, cfg.data, gen)  # the rollouter draws gen_batch_size at a time
    trainer = trainer_class(resolved)(resolved, tokenizer, factory, worker_classes(resolved), reward_fn, val_reward_fn,
                                      train, val_loader)
    trainer.init_workers()
    return trainer


def check_sandbox(cfg: DictConfig, datasets: Sequence[Any]) -> None:
    """A run that executes generated code (code rewards, a code tool) needs kernel isolation, or the
    user's ``sandbox.allow_unisolated=true``: say which at start-up, never fall back silently. The
    choice reaches reward pools and workers through the environment, which they inherit."""
    from rlfoundry.sandbox import ALLOW_UNISOLATED_ENV, SandboxUnavailable, caps_in_force, mode

    if cfg.sandbox.allow_unisolated:
        os.environ[ALLOW_UNISOLATED_ENV] = "1"
    runners = _code_runners(cfg, datasets)
    if not runners:
        return
    try:
        how = mode()
    except SandboxUnavailable as e:
        raise ConfigError(f"{' and '.join(runners)} run generated code, but {e}") from None
    print(f"rlfoundry: {' and '.join(runners)} run generated code in the {how} sandbox ({caps_in_force()})",
          flush=True)


def _code_runners(cfg: DictConfig, datasets: Sequence[Any]) -> list[str]:
    """What in this run executes generated code on this machine (a SandboxFusion URL sends it elsewhere)."""
    from omegaconf import OmegaConf

    from rlfoundry.rewards.code import CODE_DATA_SOURCES

    found = []
    key = cfg.data.get("reward_fn_key", "data_source")
    sources = {s for d in datasets for _, table in getattr(d, "tables", ())
               if key in table.column_names for s in table.column(key).unique().to_pylist()}
    local_rewards = not cfg.reward_model.get("sandbox_fusion", {}).get("url") and cfg.custom_reward_function.path is None
    if local_rewards and sources & set(CODE_DATA_SOURCES):
        found.append(f"the code rewards ({', '.join(sorted(sources & set(CODE_DATA_SOURCES)))})")
    tools_path = cfg.actor_rollout_ref.rollout.multi_turn.get("tool_config_path")
    tools_path = resolve_asset_path(tools_path) if tools_path else None  # rlfoundry://config/tools/... too
    if tools_path and Path(tools_path).expanduser().is_file():
        entries = OmegaConf.to_container(OmegaConf.load(Path(tools_path).expanduser())).get("tools") or []
        found += [f"the tool {e['class_name'].rsplit('.', 1)[-1]}" for e in entries if isinstance(e, dict)
                  and "CodeInterpreter" in str(e.get("class_name")) and not (e.get("config") or {}).get("sandbox_fusion_url")]
    return found


def trainer_class(cfg: DictConfig) -> type:
    """The one trainer; ``async_training.mode`` picks its sample source (``trainer/ppo/sources.py``)."""
    from rlfoundry.trainer.ppo.ray_trainer import PPOTrainer

    return PPOTrainer

def _import_external_lib(cfg: DictConfig) -> None:
    """``model.external_lib``: a module to import first (it registers custom model classes with HF)."""
    lib = cfg.actor_rollout_ref.model.external_lib
    if lib:
        import importlib

        importlib.import_module(lib)


@dataclass(frozen=True)
class Entry:
    """What a verl entry module fixes (``rlfoundry/experimental``): its default ``--config-name``, the
    pipeline (``async_training.mode``), set under the user's overrides and over any config's, and
    ``spell``: the overrides rewritten as that module reads verl's keys (fully-async's validation period).
    ``rlfoundry plan --entry MODULE`` applies the same, so a plan reads a command line as its module does."""

    config_name: str | None = None
    mode: str | None = None
    spell: Callable[[Sequence[str]], list[str]] | None = None

    def overrides(self, overrides: Sequence[str]) -> list[str]:
        spelled = self.spell(overrides) if self.spell else list(overrides)
        return [*([f"async_training.mode={self.mode}"] if self.mode else []), *spelled]


def run(argv: Sequence[str], entry: Entry = Entry()) -> dict:
    """Parse, validate, build and train; returns the trainer's summary. Raises on errors."""
    flags, overrides = _split_args(argv)
    if "help" in flags:
        print(_usage())
        return {}
    if "help-keys" in flags:
        print(_keys_help())
        return {}
    overrides = entry.overrides(overrides)
    cfg = load_config(overrides, config_name=flags.get("config-name") or entry.config_name,
                      config_path=flags.get("config-path"))
    if flags.get("cfg"):
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg))
        return {}
    return build_trainer(cfg).fit()


# User mistakes: a message, not a traceback. Everything else is a bug and keeps its traceback.
def _user_error_types() -> tuple[type[BaseException], ...]:
    types: list[type[BaseException]] = [ConfigError]
    for module, name in (("rlfoundry.data", "DataError"), ("rlfoundry.rewards", "RewardFunctionError"),
                         ("rlfoundry.rewards", "UnknownDataSourceError")):
        try:
            types.append(getattr(__import__(module, fromlist=[name]), name))
        except (ImportError, AttributeError):
            pass
    return tuple(types)


def _run_error_types() -> tuple[type[BaseException], ...]:
    """Errors that end a started run with a message (exit 3): NaN streak, OOM, failed save, dead worker."""
    from rlfoundry.single_controller.base import WorkerGroupError
    from rlfoundry.utils.errors import RunAbortedError

    return RunAbortedError, WorkerGroupError


def main(argv: Sequence[str] | None = None, entry: Entry = Entry()) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.simplefilter("default")  # show each distinct warning once
    try:
        run(argv, entry)
    except _user_error_types() as e:
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        kind = type(e).__name__
        print(f"\nrlfoundry: {kind}: {e}\n(set RLFOUNDRY_DEBUG=1 for a traceback)", file=sys.stderr)
        return 2
    except _run_error_types() as e:  # the run stopped on purpose, or a worker died / hung: say why
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        print(f"\nrlfoundry: {type(e).__name__}: {e}\n(set RLFOUNDRY_DEBUG=1 for a traceback)", file=sys.stderr)
        from rlfoundry.utils.errors import EXIT_RUN_ABORTED

        return EXIT_RUN_ABORTED
    except KeyboardInterrupt:
        print("\nrlfoundry: interrupted; the last complete checkpoint is kept (resume with trainer.resume_mode=auto).",
              file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
