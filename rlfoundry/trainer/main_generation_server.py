"""verl's ``verl.trainer.main_generation_server``: ``python -m rlfoundry.trainer.main_generation_server [key=value ...]``.

verl's August generation entry point reads the trainer's keys (``ppo_trainer``: every key of ``main_ppo``
is valid and checked the same way) plus ``+data.output_path``: the prompts of ``data.train_files`` (one or a
list, concatenated; chat messages in ``data.prompt_key``), ``actor_rollout_ref.rollout.n`` responses each, from
``actor_rollout_ref.model.path`` with ``actor_rollout_ref.rollout.*``'s engine and sampling, on
``trainer.n_gpus_per_node`` ranks. Output: the input parquet with a ``responses`` column (n strings a row).

What differs from verl: verl starts its OpenAI-compatible rollout servers and posts chat requests; here the
rollout engine takes the same rendered prompts directly, ``data.train_batch_size`` prompts per call. verl's
server request leaves ``rollout.top_k`` out; here it applies, as it does in training. ``rollout.temperature=0``
is greedy and needs ``rollout.n=1`` (verl's rule). ``--cfg job`` prints the config and exits.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from omegaconf import DictConfig, OmegaConf

from rlfoundry.config.compose import find_config
from rlfoundry.trainer.config import ConfigError
from rlfoundry.trainer.main_generation import Flags, entry_main, one_machine, worker_config

MODULE = "rlfoundry.trainer.main_generation_server"


def _output_path(overrides: Sequence[str]) -> tuple[str | None, list[str]]:
    """verl's ``+data.output_path=...`` (a key its ppo_trainer.yaml lacks): taken out before the trainer's
    config is loaded, since generation is all it is for."""
    out, rest = None, []
    for text in overrides:
        key, sep, value = text.partition("=")
        if sep and key.lstrip("+~") == "data.output_path":
            out = value
        else:
            rest.append(text)
    return out, rest


def _greedy(overrides: list[str]) -> list[str]:
    """``rollout.temperature=0`` is greedy (vLLM's reading): the trainer's config says so with do_sample=false."""
    from rlfoundry.trainer.config import parse_overrides

    for ov in parse_overrides(overrides):
        if ov.key == "actor_rollout_ref.rollout.temperature" and ov.value in (0, 0.0):
            return [*overrides, "actor_rollout_ref.rollout.do_sample=false"]
    return overrides


def load_server_config(overrides: Sequence[str] = (), flags: Flags | None = None) -> DictConfig:
    """The trainer's typed config (every key known and typed, as for ``main_ppo``) with ``data.output_path``
    beside it. Only what generation reads is checked: the training batch sizes a verl command line leaves at
    ppo_trainer's defaults are not its concern (verl checks them in the trainer, which does not run here)."""
    from rlfoundry.config.schema import PPOConfig, RolloutConfig, section_errors
    from rlfoundry.config.typed import to_typed
    from rlfoundry.trainer.config import _split_engine, load_typed_config

    flags = flags or Flags(None, None, None, False)
    output_path, overrides = _output_path(overrides)
    engine, overrides = _split_engine(_greedy(overrides))
    overlay = find_config(flags.config_name, flags.config_path) if flags.config_name else None
    cfg, _ = load_typed_config(PPOConfig, overrides, overlay, config_path=flags.config_path, engine=engine)
    OmegaConf.resolve(cfg)
    rollout = cfg.actor_rollout_ref.rollout
    problems = section_errors(to_typed(RolloutConfig, rollout, name="actor_rollout_ref.rollout"))
    if output_path is None:
        problems.append("+data.output_path is not set: give +data.output_path=FILE.parquet for the responses.")
    if cfg.data.train_files is None:
        problems.append("data.train_files is not set: give the parquet(s) of chat prompts to generate for.")
    if cfg.actor_rollout_ref.model.path is None:
        problems.append("actor_rollout_ref.model.path is not set: give the model to generate with.")
    if rollout.temperature == 0 and rollout.n != 1:
        problems.append(f"actor_rollout_ref.rollout.temperature=0 (greedy) with rollout.n={rollout.n}: the samples "
                        "would be identical; give actor_rollout_ref.rollout.n=1 (as verl requires).")
    if problems:
        raise ConfigError("main_generation_server: " + "\n  ".join(problems))
    plain = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))  # checked: now only read
    plain.data.output_path = output_path
    return plain


def run_server_generation(cfg: DictConfig) -> str:
    from rlfoundry.trainer.generation import encode_chats, generate_responses, read_prompts, resolve_device
    from rlfoundry.trainer.generation import start_rollout, write_responses
    from rlfoundry.trainer.main_generation import load_generation_tokenizer

    model, rollout, data = cfg.actor_rollout_ref.model, cfg.actor_rollout_ref.rollout, cfg.data
    one_machine(cfg.trainer)
    files = data.train_files if isinstance(data.train_files, str) else list(data.train_files)
    trust = bool(model.trust_remote_code)
    tokenizer = load_generation_tokenizer(model.path, trust, "actor_rollout_ref.model.path")
    prompts = read_prompts(files, data.prompt_key, "data.train_files", "data.prompt_key")
    ids = encode_chats(tokenizer, prompts.chats, int(rollout.prompt_length),
                       OmegaConf.to_container(data.apply_chat_template_kwargs), "actor_rollout_ref.rollout.prompt_length")
    device = resolve_device(cfg.trainer.device, "trainer.device")
    group = start_rollout(worker_config(model, rollout, trust), device, int(cfg.trainer.n_gpus_per_node),
                          "actor_rollout_ref.rollout.name")
    responses = generate_responses(group, tokenizer, ids, int(rollout.n), int(data.train_batch_size),
                                   bool(rollout.do_sample))
    return str(write_responses(prompts.table, responses, data.output_path, "+data.output_path"))


def main(argv: Sequence[str] | None = None) -> int:
    return entry_main(argv, MODULE, __doc__, load_server_config, run_server_generation)


if __name__ == "__main__":
    sys.exit(main())
