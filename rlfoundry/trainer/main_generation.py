"""verl's ``verl.trainer.main_generation``: ``python -m rlfoundry.trainer.main_generation [key=value ...]``.

The keys are verl's ``generation.yaml`` (typed: ``config/generation.py``): ``data.path`` (a parquet whose
``data.prompt_key`` column holds chat messages), ``data.n_samples`` responses per prompt,
``data.batch_size`` prompts per engine call, ``data.output_path``, ``model.path``, ``rollout.*`` (the
trainer's rollout keys, generation.yaml's defaults), ``trainer.n_gpus_per_node`` ranks on this machine.
The output is the input parquet with a ``responses`` column: a list of ``n_samples`` strings per row.

``rollout.temperature=0`` means greedy decoding (as vLLM reads it) and, as in verl, needs
``data.n_samples=1``; ``rollout.do_sample=false`` is greedy at any ``n_samples``. ``--cfg job`` prints the
config the command line gives and exits; an unknown key names the nearest one. Mistakes end with exit
code 2 and a message, no traceback (``RLFOUNDRY_DEBUG=1`` for one).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rlfoundry.trainer.config import ConfigError

# generation.yaml is verl's name for these defaults; here they are the typed schema's, so the name loads nothing
CONFIG_NAME = "generation"


@dataclass(frozen=True)
class Flags:
    config_name: str | None
    config_path: str | None
    cfg: str | None
    help: bool


def split_flags(argv: Sequence[str], module: str) -> tuple[Flags, list[str]]:
    """verl's Hydra flags (``--config-name``, ``--config-path``, ``--cfg job``, ``-h``) and the overrides."""
    flags: dict[str, str] = {}
    rest, it = [], iter(argv)
    for arg in it:
        name, sep, value = arg[2:].partition("=")
        if arg in ("-h", "--help"):
            flags["help"] = "1"
        elif arg.startswith("--") and name in ("config-name", "config-path", "cfg"):
            flags[name] = value if sep else next(it, "")
        elif arg.startswith("-"):
            raise ConfigError(f"{module}: unknown option '{arg}'. Config keys are given without dashes: key=value "
                              "(--config-name, --config-path and --cfg job are the options).")
        else:
            rest.append(arg)
    return Flags(flags.get("config-name"), flags.get("config-path"), flags.get("cfg"), "help" in flags), rest


def load_overlay(schema: type, overrides: Sequence[str], flags: Flags, own_name: str) -> DictConfig:
    """Typed defaults ← a ``--config-name`` YAML (not this module's own name: its defaults are the schema)
    ← the overrides; resolved."""
    from rlfoundry.config.compose import find_config
    from rlfoundry.trainer.config import load_typed_config

    name = flags.config_name
    overlay = find_config(name, flags.config_path) if name and name.removesuffix(".yaml") != own_name else None
    cfg, _ = load_typed_config(schema, overrides, overlay, config_path=flags.config_path)
    OmegaConf.resolve(cfg)
    return cfg


def load_generation_config(overrides: Sequence[str] = (), flags: Flags | None = None) -> DictConfig:
    """generation.yaml's keys, checked: what the run needs is set, the numbers agree."""
    from rlfoundry.config.generation import GenerationConfig

    cfg = load_overlay(GenerationConfig, overrides, flags or Flags(None, None, None, False), CONFIG_NAME)
    if cfg.rollout.temperature == 0:  # greedy, as vLLM (verl's engine here) reads temperature 0
        cfg.rollout.do_sample = False
    problems = check_generation(cfg)
    if problems:
        raise ConfigError("main_generation: " + "\n  ".join(problems))
    return cfg


def check_generation(cfg: DictConfig) -> list[str]:
    from rlfoundry.config.schema import RolloutConfig, section_errors
    from rlfoundry.config.typed import to_typed

    data, problems = cfg.data, []
    for key in ("data.path", "data.output_path", "model.path"):
        if OmegaConf.select(cfg, key) is None:
            problems.append(f"{key} is not set: give {key}=...")
    if data.n_samples < 1:
        problems.append(f"data.n_samples={data.n_samples}: it must be at least 1.")
    if cfg.rollout.temperature == 0 and data.n_samples != 1:
        problems.append(f"rollout.temperature=0 (greedy) with data.n_samples={data.n_samples}: the samples would be "
                        "identical; give data.n_samples=1 (as verl requires), or rollout.do_sample=false to repeat them.")
    if data.batch_size < 1:
        problems.append(f"data.batch_size={data.batch_size}: it must be at least 1.")
    if cfg.rollout.n != 1:
        problems.append(f"rollout.n={cfg.rollout.n}: main_generation samples data.n_samples per prompt; "
                        "leave rollout.n at 1 and set data.n_samples.")
    problems += section_errors(to_typed(RolloutConfig, cfg.rollout, name="rollout"))
    return problems


def one_machine(trainer: DictConfig) -> None:
    """Generation runs ``trainer.n_gpus_per_node`` ranks on this machine (a start-up check: ``--cfg job``
    shows a multi-node line's config)."""
    if trainer.nnodes != 1:
        raise ConfigError(f"trainer.nnodes={trainer.nnodes}: generation runs on one machine here "
                          "(trainer.n_gpus_per_node ranks); give trainer.nnodes=1.")


def worker_config(model: Any, rollout: DictConfig, trust_remote_code: bool) -> dict[str, Any]:
    """A rollout-only worker's ``actor_rollout_ref``: weights from ``model.path``, never synced."""
    return {"model": {"path": str(model.path), "trust_remote_code": trust_remote_code,
                      "external_lib": model.get("external_lib")},
            "rollout": OmegaConf.to_container(rollout, resolve=True)}


def run_generation(cfg: DictConfig) -> str:
    """Generate ``data.n_samples`` responses per prompt of ``data.path`` into ``data.output_path``."""
    from rlfoundry.trainer.generation import encode_chats, generate_responses, read_prompts, resolve_device
    from rlfoundry.trainer.generation import start_rollout, write_responses

    data = cfg.data
    one_machine(cfg.trainer)
    trust = bool(cfg.model.trust_remote_code or data.trust_remote_code)
    if cfg.model.external_lib:  # a module that registers the model's classes with transformers
        importlib.import_module(cfg.model.external_lib)
    tokenizer = load_generation_tokenizer(cfg.model.path, trust, "model.path")
    prompts = read_prompts(data.path, data.prompt_key, "data.path", "data.prompt_key")
    ids = encode_chats(tokenizer, prompts.chats, int(cfg.rollout.prompt_length),
                       OmegaConf.to_container(data.apply_chat_template_kwargs), "rollout.prompt_length")
    device = resolve_device(cfg.trainer.device, "trainer.device")
    group = start_rollout(worker_config(cfg.model, cfg.rollout, trust), device, int(cfg.trainer.n_gpus_per_node),
                          "rollout.name")
    responses = generate_responses(group, tokenizer, ids, int(data.n_samples), int(data.batch_size),
                                   bool(cfg.rollout.do_sample))
    return str(write_responses(prompts.table, responses, data.output_path, "data.output_path"))


def load_generation_tokenizer(path: str, trust_remote_code: bool, key: str) -> Any:
    """The model's tokenizer; a directory that is not a model is an error naming ``key``."""
    from transformers import AutoTokenizer

    from rlfoundry.trainer.config import is_hf_model_dir, resolve_asset_path

    local = resolve_asset_path(path)
    if not is_hf_model_dir(local):
        raise ConfigError(f"{key}={path}: not a Hugging Face model directory (no config.json); give the "
                          "directory of the model to generate with.")
    tokenizer = AutoTokenizer.from_pretrained(local, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def user_errors() -> tuple[type[BaseException], ...]:
    from rlfoundry.data import DataError
    from rlfoundry.rewards import RewardFunctionError, UnknownDataSourceError
    from rlfoundry.utils.errors import CheckpointCorruptError

    return ConfigError, DataError, RewardFunctionError, UnknownDataSourceError, CheckpointCorruptError


def entry_main(argv: Sequence[str] | None, module: str, schema_doc: str, load: Any, run: Any) -> int:
    """The offline entry points' shell: ``-h``, ``--cfg job``, else ``run(load(...))``; people's mistakes
    as one message and exit code 2."""
    import os

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        flags, overrides = split_flags(argv, module)
        if flags.help:
            print(schema_doc)
            return 0
        cfg = load(overrides, flags)
        if flags.cfg:  # verl's dry run: the config this command line gives, nothing run
            print(OmegaConf.to_yaml(cfg))
            return 0
        run(cfg)
    except user_errors() as e:
        if os.environ.get("RLFOUNDRY_DEBUG"):
            raise
        print(f"\n{module}: {type(e).__name__}: {e}\n(set RLFOUNDRY_DEBUG=1 for a traceback)", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return entry_main(argv, "rlfoundry.trainer.main_generation", __doc__, load_generation_config, run_generation)


if __name__ == "__main__":
    sys.exit(main())
