"""Finding a ``--config-name`` and composing its Hydra ``defaults:`` list, as Hydra does, for the typed
loader (``trainer/config.py``: ``load_typed_config``).

    layers = compose(find_config("ppo_megatron_trainer.yaml", "config"))

**Lookup** (``find_config``). A name is looked up with or without ``.yaml``; ``--config-path`` is
relative to the caller's working directory (Hydra's rule for the command-line flag). The user's
directory is searched first, then rlfoundry's packaged configs (``rlfoundry/config``), which carry
verl's config names (``ppo_trainer``, ``ppo_megatron_trainer``, the async and example names). So a
verl script's ``--config-path config`` (verl's own directory, which does not exist here) finds the
packaged config of that name, and a user's directory holding the file wins. verl's own trainer config
directory (it holds ``_generated_ppo_trainer.yaml``) is never searched: its files describe verl's
defaults, which the typed schema and the packaged configs stand in for.

**Composition** (``compose``). A file's ``defaults:`` entries are composed in order, each looked up
in the user's directory, then the packaged configs; ``_self_`` is where the file's own keys go (at
the end when not listed, Hydra 1.1's rule). Entry shapes:

- ``- ppo_trainer`` / ``- name@pkg``: another config (``name`` may end in ``.yaml``), at ``pkg``;
- ``- group@pkg: option`` (``- actor@actor_rollout_ref.actor: dp_actor``): ``group/option.yaml``
  at ``pkg`` (default: the group's path). verl's own component configs, which are not files here,
  are the schema's defaults (``dp_*``, ``rollout``, ``hf_model`` ...) or the Megatron engine
  (``megatron_*``); ``${model_engine}`` in an option is the current ``model_engine`` choice;
- ``- model_engine: dp|megatron|veomni`` (verl's August engine group), also ``override model_engine: …``
  and ``model_engine=…`` on the command line: the engine's layers come first, under every file;
- ``- override group@pkg: option``: replaces that group's earlier choice in the same list;
  ``optional`` entries that do not resolve are skipped (Hydra's meaning of the word).

Anything else that does not resolve is a ``ConfigError`` naming the file, the entry and what
exists; nothing in a ``defaults:`` list is ignored. ``hydra:`` (search paths, run dirs) is not read:
the packaged configs stand in for verl's search path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlfoundry.config.typed import ConfigError

__all__ = ["ENGINES", "PACKAGED_DIR", "Layer", "compose", "engine_layers", "find_config", "search_roots"]

PACKAGED_DIR = Path(__file__).resolve().parent
VERL_TRAINER_DIR_MARKER = "_generated_ppo_trainer.yaml"  # only verl's own trainer config directory has it

# verl's model_engine group -> the packaged config holding that engine's settings (None: the schema's
# defaults, FSDP). torchtitan and automodel are engines rlfoundry does not have; veomni is the FSDP2
# engine with verl's veomni keys (its roles' strategy veomni, config/veomni.py).
ENGINES: dict[str, str | None] = {"dp": None, "fsdp": None, "megatron": "ppo_megatron_trainer", "veomni": None}
MISSING_ENGINES = ("torchtitan", "automodel")
_VEOMNI = {"strategy": "veomni"}

# verl's own component configs (verl/trainer/config/<group>/<option>.yaml): their keys are the typed
# schema's defaults, so they add nothing here, except each role's engine (so that `override actor@...:
# dp_actor` over a Megatron config takes effect, as in Hydra).
_MEGATRON, _FSDP = {"strategy": "megatron"}, {"strategy": "fsdp"}
BUILTIN_GROUPS: dict[str, dict[str, dict]] = {
    "actor": {"dp_actor": _FSDP, "megatron_actor": _MEGATRON},
    "ref": {"dp_ref": _FSDP, "megatron_ref": _MEGATRON},
    "critic": {"dp_critic": _FSDP, "megatron_critic": _MEGATRON},
    "data": {"legacy_data": {}},
    "rollout": {"rollout": {}},
    "model": {"hf_model": {}},
    "reward_model": {"dp_reward_model": {}, "dp_reward_loop": {}, "reward_model": {}},
    "reward": {"reward": {}},
    "algorithm": {"rollout_correction": {}},
    "reward_manager": {"reward_manager": {}},
    "legacy_reward_impl": {"legacy_reward_impl": {}},
    "distillation": {"distillation": {}},
    "transfer_queue": {"transfer_queue": {}},
    # verl's SFT engine layout (sft_trainer_engine.yaml); its megatron engine is refused by the SFT loader
    "engine": {"fsdp": {}, "dp": {}},
    "optim": {"fsdp": {}},
    "profiler": {"profiler": {}},
}


@dataclass(frozen=True)
class Layer:
    """One mapping to merge over the config, rooted at the config's top (its package applied)."""

    source: str  # for messages: "config file PATH" (or the entry that made it)
    values: dict


# ───────────────────────────────────── lookup ─────────────────────────────────────


def _is_verl_trainer_dir(path: Path) -> bool:
    return (path / VERL_TRAINER_DIR_MARKER).is_file()


def search_roots(config_path: str | None) -> list[Path]:
    """The user's ``--config-path`` (relative to the working directory) when it is a directory and not
    verl's own trainer configs, then the packaged configs."""
    roots = []
    if config_path:
        user = Path(config_path).expanduser()
        if user.is_dir() and not _is_verl_trainer_dir(user):
            roots.append(user.resolve())
    return roots + [PACKAGED_DIR]


def _in_roots(name: str, roots: Sequence[Path]) -> Path | None:
    stem = name[:-5] if name.endswith(".yaml") else name
    for root in roots:
        candidate = root / f"{stem}.yaml"
        if candidate.is_file():
            return candidate
    return None


def packaged_names() -> list[str]:
    return sorted(p.stem for p in PACKAGED_DIR.glob("*.yaml"))


def find_config(name: str, config_path: str | None = None) -> Path:
    """``--config-name NAME`` (with or without ``.yaml``; or a path to a YAML file) in the user's
    ``--config-path``, then among the packaged configs."""
    as_path = Path(name).expanduser()
    if as_path.suffix == ".yaml" and as_path.is_file() and (as_path.is_absolute() or not config_path):
        return as_path
    found = _in_roots(name, search_roots(config_path))
    if found is not None:
        return found
    where = f"--config-path {config_path} ({_path_state(config_path)}) nor " if config_path else ""
    raise ConfigError(f"Config '{name}' is in neither {where}rlfoundry's packaged configs: {packaged_names()}. "
                      "Give --config-path the directory holding it, or one of the packaged names.")


def _path_state(config_path: str) -> str:
    path = Path(config_path).expanduser()
    if not path.is_dir():
        return f"no such directory from {Path.cwd()}"
    if _is_verl_trainer_dir(path):
        return "verl's own trainer configs; the packaged ones stand in for them"
    return "no such file there"


# ───────────────────────────────────── composition ─────────────────────────────────────


def _at(package: str, values: dict) -> dict:
    for part in reversed([p for p in package.split(".") if p]):
        values = {part: values}
    return values


def _load(path: Path) -> dict:
    try:
        raw = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except (OmegaConfBaseException, OSError, ValueError) as e:
        raise ConfigError(f"Cannot read the config file {path}: {e}") from None
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise ConfigError(f"The config file {path} holds a {type(raw).__name__}, not a mapping of keys.")
    return _without_verl_targets(raw)


# verl recipes' config dataclasses whose fields the schema has: SPPO's actor (sppo_eta; recipe/sppo/config.py),
# GVPO's actor config module (actor.gvpo_beta)
RECIPE_TARGETS = ("recipe.sppo.config.SPPOActorConfig", "recipe.gvpo.gvpo_actor_config.")


def _without_verl_targets(node: Any) -> Any:
    """verl's config files name the dataclass each group instantiates into (``_target_:
    verl.trainer.config.FilterGroupsConfig``, or a recipe's in ``RECIPE_TARGETS``); the typed schema
    here is that class, so those entries go. A ``_target_`` naming anything else stays (and is refused
    as an unknown key where the schema has none)."""
    if not isinstance(node, dict):
        return node
    return {k: _without_verl_targets(v) for k, v in node.items()
            if not (k == "_target_" and isinstance(v, str) and v.startswith(("verl.", *RECIPE_TARGETS)))}


@dataclass
class _Composer:
    roots: Sequence[Path]
    engine: str | None = None  # the model_engine choice met in a defaults list

    def file(self, path: Path, package: str = "", chain: tuple[Path, ...] = ()) -> list[Layer]:
        """``path``'s layers: its defaults in order, its own keys at ``_self_`` (or last)."""
        if path.resolve() in chain:
            cycle = " -> ".join(str(p) for p in (*chain, path.resolve()))
            raise ConfigError(f"The config defaults lists form a cycle: {cycle}.")
        raw = _load(path)
        defaults = raw.pop("defaults", [])
        raw.pop("hydra", None)  # Hydra's own settings (search path, run dir): the packaged configs stand in
        if not isinstance(defaults, list):
            raise ConfigError(f"{path}: 'defaults' must be a list (Hydra's defaults list), got {defaults!r}.")
        own = Layer(f"config file {path}", _at(package, raw))
        layers: list[Layer] = []
        chosen: dict[str, int] = {}  # group@package -> index in `entries` of its choice
        entries = self._entries(path, defaults, chosen)
        for entry in entries:
            if entry == "_self_":
                layers.append(own)
            else:
                layers += self.entry(path, entry, package, (*chain, path.resolve()))
        if "_self_" not in entries:
            layers.append(own)
        return layers

    def _entries(self, path: Path, defaults: list, chosen: dict[str, int]) -> list[Any]:
        """The defaults list with ``override`` entries folded into the choices they replace."""
        out: list[Any] = []
        for entry in defaults:
            if isinstance(entry, Mapping) and len(entry) == 1:
                (key, option), = entry.items()
                is_override = str(key).startswith("override ")
                key = str(key).removeprefix("override ").strip()
                if key.split("@")[0].removeprefix("optional ").strip() == "model_engine":
                    self.engine = str(option)  # global: its layers go under every file
                    continue
                if is_override and key in chosen:
                    out[chosen[key]] = {key: option}
                    continue
                chosen[key] = len(out)
                out.append({key: option})
            elif isinstance(entry, str):
                out.append(entry.strip())
            else:
                raise ConfigError(f"{path}: defaults entry {entry!r} is neither a config name nor 'group: option'.")
        return out

    def entry(self, path: Path, entry: Any, package: str, chain: tuple[Path, ...]) -> list[Layer]:
        if isinstance(entry, str):
            optional = entry.startswith("optional ")
            name, _, pkg = entry.removeprefix("optional ").strip().partition("@")
            return self._config(path, entry, name, None, _join(package, pkg), optional, chain)
        (key, option), = entry.items()
        optional = key.startswith("optional ")
        group, _, pkg = key.removeprefix("optional ").strip().partition("@")
        option = re.sub(r"\$\{model_engine\}", self.engine or "dp", str(option)) if option is not None else None
        return self._config(path, f"{key}: {option}", group, option, _join(package, pkg or group.replace("/", ".")),
                            optional, chain)

    def _config(self, path: Path, text: str, name: str, option: str | None, package: str, optional: bool,
                chain: tuple[Path, ...]) -> list[Layer]:
        rel = f"{name}/{option}" if option is not None else name
        found = _in_roots(rel, self.roots)
        if found is not None:
            return self.file(found, package, chain)
        group, choice = (name, option) if option is not None else (name.split("/")[0], name.split("/")[-1])
        builtin = BUILTIN_GROUPS.get(group, {})
        if choice in builtin:  # an empty one adds nothing (not even its package: profiler@profiler in SFT)
            values = dict(builtin[choice])
            return [Layer(f"{path}: defaults entry '{text}' (verl's {rel})", _at(package, values))] if values else []
        if optional:
            return []  # Hydra: an optional entry that does not exist adds nothing
        there = sorted({p.relative_to(r).with_suffix("").as_posix() for r in self.roots
                        for p in (r / group).glob("*.yaml")} if option is not None else packaged_names())
        known = sorted(builtin) or there
        raise ConfigError(f"{path}: defaults entry '{text}' names {rel}.yaml, which is in none of "
                          f"{[str(r) for r in self.roots]}; there are {known or there}.")


def _join(package: str, pkg: str) -> str:
    if pkg in ("_global_", "_global"):
        return ""
    return ".".join(p for p in (package, pkg.removeprefix("_here_").strip(".")) if p)


def compose(path: Path, config_path: str | None = None) -> tuple[list[Layer], str | None]:
    """``path``'s layers, its defaults composed, in merge order; and the ``model_engine`` its defaults
    chose (None: none did)."""
    composer = _Composer(search_roots(config_path))
    layers = composer.file(Path(path))
    return layers, composer.engine


def engine_layers(engine: str, source: str) -> list[Layer]:
    """The layers of verl's ``model_engine`` choice (the packaged engine config); an engine rlfoundry
    does not have is a ``ConfigError``."""
    if engine in MISSING_ENGINES:
        raise ConfigError(f"{source}: model_engine={engine} selects verl's {engine} engine, which rlfoundry does not "
                          f"have; the engines here are {sorted(ENGINES)} (dp and fsdp are the same FSDP2 engine).")
    if engine not in ENGINES:
        raise ConfigError(f"{source}: model_engine={engine} is not an engine; choose one of {sorted(ENGINES)}.")
    if engine == "veomni":  # verl's model_engine/veomni.yaml: every role's engine config is veomni's
        roles = {"actor_rollout_ref": {"actor": _VEOMNI, "ref": _VEOMNI}, "critic": _VEOMNI}
        return [Layer(f"{source}: model_engine=veomni", roles)]
    name = ENGINES[engine]
    return [] if name is None else _Composer([PACKAGED_DIR]).file(PACKAGED_DIR / f"{name}.yaml")
