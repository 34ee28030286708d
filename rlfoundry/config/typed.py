"""Typed config: how the schema's dataclasses become config objects, with the checks every loader shares.

The dataclasses in ``schema.py`` (and ``sft_schema.py``) hold every default once. A field may carry,
in its metadata, the values it accepts (``choices``) and the key its default follows (``follows``,
verl's ``${...}`` interpolations: ``critic.ppo_epochs`` follows ``actor_rollout_ref.actor.ppo_epochs``
unless set itself). Two ways in, same checks:

- the trainer's loader (``trainer/config.py``: ``load_config``) applies command-line overrides and
  overlay YAML files key by key with ``apply_setting``;
- a component takes its subtree once, in its constructor, with ``to_typed``::

      self.config = to_typed(RolloutConfig, config, name="actor_rollout_ref.rollout")

  ``config`` may be the resolved subtree the trainer hands over, a plain dict with a few keys (tests),
  a dataclass instance or None; what it leaves out gets the schema's default.

Either way an unknown key is a ``ConfigError`` naming the nearest valid key, a value of the wrong type
names the key and the expected type, and a value outside a field's ``choices`` lists them.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlfoundry.config.schema import REPLACED_KEYS

__all__ = [
    "ConfigError",
    "KeyInfo",
    "ReplacedKeyWarning",
    "apply_setting",
    "choice_errors",
    "closest_key",
    "pick",
    "plain",
    "schema_keys",
    "structured",
    "to_typed",
    "type_name",
]

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration mistake a person can fix; the message says which key and how."""


class ReplacedKeyWarning(UserWarning):
    """An old key that a newer one replaced, set to a value the new key's default already gives."""


# ───────────────────────────────────── schema walking ─────────────────────────────────────


@dataclass(frozen=True)
class KeyInfo:
    type: Any  # the annotation (int, Optional[int], Dict[str, Any] ...)
    is_open: bool  # a dict/Any node under which arbitrary sub-keys are allowed
    choices: tuple | None = None  # the values the field accepts (field metadata)
    follows: str | None = None  # the dotted key (from the schema's root) its default follows


def _is_subtree(hint: Any) -> bool:
    return isinstance(hint, type) and is_dataclass(hint)


def schema_keys(cls: type, prefix: str = "") -> dict[str, KeyInfo]:
    """Every dotted key of a schema dataclass (inner nodes too) → its annotation, openness, choices, link."""
    out: dict[str, KeyInfo] = {}
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        key, hint = f"{prefix}{f.name}", hints[f.name]
        if _is_subtree(hint):
            out[key] = KeyInfo(hint, False)
            out.update(schema_keys(hint, key + "."))
        else:
            is_open = hint is Any or typing.get_origin(hint) is dict
            out[key] = KeyInfo(hint, is_open, f.metadata.get("choices"), f.metadata.get("follows"))
    return out


@functools.lru_cache(maxsize=None)
def keys_of(cls: type, prefix: str = "") -> dict[str, KeyInfo]:
    """``schema_keys(cls, prefix)``, computed once per schema and prefix."""
    return schema_keys(cls, prefix)


def structured(cls: type, name: str | None = None) -> DictConfig:
    """``OmegaConf.structured(cls)`` in struct mode, each ``follows`` link inside it set as ``${key}``.

    Link keys are dotted from the PPOConfig root; ``name`` says where ``cls`` sits there
    (``"critic"``), so links inside the subtree apply too. A link whose key lies outside
    (``RolloutConfig.prompt_length`` follows ``data.max_prompt_length``) keeps the field's own default.
    """
    cfg = OmegaConf.structured(cls)
    OmegaConf.set_struct(cfg, True)
    keys, prefix = keys_of(cls), f"{name}." if name else ""
    for key, info in keys.items():
        target = info.follows
        if target is not None and prefix and target.startswith(prefix):
            target = target[len(prefix):]
        if target is not None and target in keys:
            OmegaConf.update(cfg, key, "${" + target + "}", merge=False)
    return cfg


def open_ancestor(key: str, keys: Mapping[str, KeyInfo]) -> str | None:
    """The open-dict key that ``key`` lies under (``model.override_config.x`` → ``...override_config``)."""
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        info = keys.get(".".join(parts[:i]))
        if info is not None and info.is_open:
            return ".".join(parts[:i])
    return None


# ───────────────────────────────────── messages ─────────────────────────────────────


def closest_key(key: str, keys: Mapping[str, KeyInfo]) -> str | None:
    """The valid key nearest to a misspelt one: difflib over the full dotted names, then over leaf names."""
    leaves = [k for k in keys if not key.startswith(k + ".")]  # never suggest the key's own parent
    match = difflib.get_close_matches(key, leaves, n=1, cutoff=0.6)
    if match:
        return match[0]
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in leaves if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return difflib.get_close_matches(key, same_leaf, n=1, cutoff=0.0)[0]
    by_leaf = difflib.get_close_matches(leaf, [k.rsplit(".", 1)[-1] for k in leaves], n=1, cutoff=0.75)
    if by_leaf:
        return difflib.get_close_matches(key, [k for k in leaves if k.endswith("." + by_leaf[0])], n=1, cutoff=0.0)[0]
    return None


def unknown_key_error(key: str, source: str, keys: Mapping[str, KeyInfo]) -> ConfigError:
    hint = closest_key(key, keys)
    did_you_mean = f" Did you mean '{hint}'?" if hint else ""
    open_dicts = [k for k, i in keys.items() if typing.get_origin(i.type) is dict]
    examples = sorted(open_dicts, key=lambda k: not k.endswith("override_config"))[:2]  # the usual ones first
    under = f"such as {' or '.join(examples)}" if examples else "(this part of the config has none)"
    return ConfigError(
        f"Unknown config key '{key}' ({source}).{did_you_mean} "
        f"`--help-keys` lists the keys; `+key=value` adds keys only under open dicts {under}."
    )


def type_name(hint: Any) -> str:
    if typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return " or ".join(type_name(a) for a in args) + " or null"
    names = {int: "an integer", float: "a number", bool: "a boolean (true/false)", str: "a string"}
    if hint in names:
        return names[hint]
    origin = typing.get_origin(hint)
    if origin is list:
        return "a list, e.g. [a,b]"
    if origin is dict:
        return "a mapping, e.g. {a: 1}"
    return str(hint)


def type_error(key: str, value: Any, source: str, keys: Mapping[str, KeyInfo]) -> ConfigError:
    info = keys.get(key)
    expected = type_name(info.type) if info else "another type"
    return ConfigError(f"Config key '{key}' ({source}): value {value!r} is not valid; expected {expected}.")


def choice_errors(cfg: Any, keys: Mapping[str, KeyInfo], prefix: str = "") -> list[str]:
    """``key='value' is not one of [...]`` for every field of ``cfg`` whose value is outside its choices.

    ``keys`` are ``keys_of(schema, prefix)``: full dotted names, ``prefix`` + the key inside ``cfg``.
    """
    errors = []
    for key, info in keys.items():
        if info.choices is None:
            continue
        value = OmegaConf.select(cfg, key[len(prefix):], throw_on_resolution_failure=False)
        if value is not None and value not in info.choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in info.choices], n=1)
            extra = f" (did you mean '{hint[0]}'?)" if hint else ""
            errors.append(f"{key}={value!r} is not one of {list(info.choices)}{extra}.")
    return errors


# ───────────────────────────────────── setting keys ─────────────────────────────────────


def dtype_problems(key: str, value: Any) -> list[str]:
    """``key: unknown dtype …`` for a value that is none of verl's dtype spellings (schema.DTYPE_SPELLINGS)."""
    from rlfoundry.config.schema import DTYPE_SPELLINGS  # the schema imports this module

    if str(value).lower() in DTYPE_SPELLINGS:
        return []
    return [f"{key}: unknown dtype {value!r}; use one of {sorted(DTYPE_SPELLINGS)}"]


def _replaced(key: str, value: Any, text: str) -> None:
    """An old key a newer one replaced: a warning when the new default gives what it asked for, else an error."""
    old = REPLACED_KEYS[key]
    what = f"{key.rsplit('.', 1)[-1]} was replaced by {old.by} ({old.meaning})"
    if value in old.kept:
        warnings.warn(f"'{text}': {what}; {value!r} is what the default of {old.by} gives, so the setting "
                      f"is dropped. Remove it (or set {old.by}).", ReplacedKeyWarning, stacklevel=4)
        return
    raise ConfigError(f"'{text}': {what}. It switches them all together, so {key.rsplit('.', 1)[-1]}={value!r} "
                      f"cannot be kept as it was; {old.instead}.")


def _yaml_switch(value: Any, info: KeyInfo | None) -> Any:
    """YAML 1.1 reads ``off``/``on`` as booleans (``OmegaConf.from_dotlist(["x.cpu_kernels=off"])``);
    a field whose choices are those words gets the word back."""
    if isinstance(value, bool) and info is not None and info.choices and ("off" if not value else "on") in info.choices:
        return "on" if value else "off"
    return value


def _holds_list(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Union:
        return any(_holds_list(a) for a in typing.get_args(hint))
    return typing.get_origin(hint) is list


def quoted_list(value: Any) -> list | None:
    """The list a string such as ``'[0.9,0.95]'`` spells (an override's list whose quotes reached the
    config, a shell quoting slip), parsed as an unquoted override would be; None for anything else."""
    if not (isinstance(value, str) and value.startswith("[") and value.endswith("]")):
        return None
    try:
        parsed = OmegaConf.to_container(OmegaConf.from_dotlist([f"v={value}"]))["v"]
    except OmegaConfBaseException:
        return None
    return parsed if isinstance(parsed, list) else None


def _quoted_list(value: Any, info: KeyInfo | None, text: str) -> Any:
    """``key='[0.9,0.95]'`` on a list key (verl's Qwen3.5 SFT script): the list it spells, said."""
    parsed = quoted_list(value) if info is not None and _holds_list(info.type) else None
    if parsed is None:
        return value
    warnings.warn(f"'{text}': the value is one quoted string; read as the list {parsed} (unquoted it is one).",
                  stacklevel=5)
    return parsed


def _is_bool(hint: Any) -> bool:
    if typing.get_origin(hint) is typing.Union:
        return bool in typing.get_args(hint)
    return hint is bool


def _empty_bool(value: Any, info: KeyInfo | None, text: str) -> Any:
    """``key=`` on a boolean key (verl's multi-turn script leaves ``use_kl_loss=${use_kl_loss}`` unset):
    false, said. verl keeps the empty string and tests it for truth, so the run verl makes is the one
    with the switch off; any other non-boolean stays an error."""
    if value != "" or info is None or not _is_bool(info.type):
        return value
    warnings.warn(f"'{text}': an empty value on a true/false key; read as false, as verl reads it "
                  f"(it tests the empty string for truth). Write false, or the value you meant.", stacklevel=5)
    return False


def apply_setting(cfg: DictConfig, key: str, value: Any, *, text: str, keys: Mapping[str, KeyInfo],
                  prefix: str = "", kind: str = "set") -> None:
    """Set (or, ``kind="delete"``, remove) the dotted ``key`` of ``cfg`` with the shared checks.

    ``keys`` are ``keys_of(schema, prefix)``; messages name ``prefix + key`` and quote ``text`` (what
    the user wrote). ``kind`` is ``set``, ``add`` (``+key``), ``force_add`` (``++key``) or ``delete``.
    """
    full = prefix + key
    if full not in keys and full in REPLACED_KEYS:
        _replaced(full, value, text)
        return
    if full in keys:
        if kind == "delete" and open_ancestor(full, keys) is None:
            raise ConfigError(f"'{text}': '{full}' is part of the schema and cannot be deleted; set it to null instead.")
    elif open_ancestor(full, keys) is None:
        raise unknown_key_error(full, f"from '{text}'", keys)
    value = _quoted_list(_yaml_switch(value, keys.get(full)), keys.get(full), text)
    value = _empty_bool(value, keys.get(full), text)
    try:
        if kind == "delete":
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if parent is not None and leaf in parent:
                parent.pop(leaf)
            return
        OmegaConf.update(cfg, key, value, merge=False, force_add=True)
    except OmegaConfBaseException as e:
        raise type_error(full, value, f"from '{text}'", keys) from e


def leaves(node: Mapping, keys: Mapping[str, KeyInfo], prefix: str = "", path: str = "") -> dict[str, Any]:
    """Leaf values of a plain mapping by dotted key (relative to the mapping; open dicts walked too).

    An empty mapping where the schema has a subtree sets nothing (the subtree keeps its defaults);
    under an open dict it is a value like any other.
    """
    out: dict[str, Any] = {}
    for k, v in node.items():
        key = f"{path}{k}"
        info = keys.get(prefix + key)
        if isinstance(v, Mapping) and (v or (info is not None and _is_subtree(info.type))):
            out.update(leaves(v, keys, prefix, key + "."))
        else:
            out[key] = v
    return out


def pick(cfg: Any, key: str, default: Any = None) -> Any:
    """The value at dotted ``key`` of a typed config, a DictConfig or a mapping; ``default`` where a
    part of the path is missing or null (``OmegaConf.select`` for either kind of config)."""
    node = cfg
    for part in key.split("."):
        if node is None:
            return default
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
    return default if node is None else node


# ───────────────────────────────────── to_typed ─────────────────────────────────────


def _as_mapping(cfg: Any, where: str) -> Mapping:
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        try:
            return OmegaConf.to_container(cfg, resolve=True)  # interpolations resolve against cfg's root
        except OmegaConfBaseException as e:
            raise ConfigError(f"{where}: the config cannot be evaluated: {e}") from e
    if is_dataclass(cfg) and not isinstance(cfg, type):
        return dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        return cfg
    raise ConfigError(f"{where}: expected a mapping, a DictConfig, a dataclass instance or None, got {type(cfg).__name__}.")


def plain(cfg: Any) -> dict:
    """A typed config, a DictConfig (resolved) or a mapping as plain nested dicts and lists."""
    return dict(_as_mapping(cfg, type(cfg).__name__))


def to_typed(cls: type[T], cfg: Any = None, *, name: str | None = None) -> T:
    """``cfg`` merged over the schema defaults of ``cls``, checked, as a real ``cls`` instance.

    Args:
        cls: a schema dataclass (``RolloutConfig``, ``DataConfig``, ``PPOConfig`` ...).
        cfg: a dataclass instance, a plain dict (nested dicts or dotted keys), a DictConfig (its
            interpolations are resolved against its root first) or None (all defaults).
        name: where the subtree sits in the full config (``"actor_rollout_ref.rollout"``), so
            messages name full keys as a user types them and the links inside the subtree apply
            (``critic.forward_max_token_len_per_gpu`` follows ``critic.ppo_max_token_len_per_gpu``).

    Raises:
        ConfigError: an unknown key (naming the nearest valid one), a value of the wrong type
            (naming the key and the expected type) or a value outside a field's choices.
    """
    prefix = f"{name}." if name else ""
    where = name or cls.__name__
    keys = keys_of(cls, prefix)
    out = structured(cls, name)
    for key, value in leaves(_as_mapping(cfg, where), keys, prefix).items():
        apply_setting(out, key, value, text=f"{prefix or cls.__name__ + ': '}{key}={value}", keys=keys, prefix=prefix)
    errors = choice_errors(out, keys, prefix)
    if errors:
        raise ConfigError("; ".join(errors))
    try:
        return OmegaConf.to_object(out)
    except OmegaConfBaseException as e:  # e.g. an interpolation that points nowhere
        raise ConfigError(f"{where}: the config cannot be evaluated: {e}") from e
