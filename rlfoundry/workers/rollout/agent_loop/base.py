"""The agent-loop interface (verl's names) and the registry of loops by name.

An agent loop turns one prompt into one trajectory: ``async run(sampling_params, **row)`` gets the row's
prompt token ids and non-tensor fields (``raw_prompt``, ``extra_info`` …) and returns an
:class:`AgentLoopOutput` — the exact token ids after the prompt, a mask that is 1 on the tokens the
policy sampled, their log-probs. It asks the engine for turns through ``self.server.generate`` and may
call tools, simulated users, anything; the manager runs all of a batch's trajectories at once.

A loop is chosen per row by its ``agent_name`` column, else ``rollout.agent.default_agent_loop``.
Custom loops register with ``@register("name")`` in an imported module, or are listed in the YAML at
``rollout.agent.agent_loop_config_path`` (verl's layout)::

    - name: my_agent
      _target_: my_package.agents.MyAgentLoop
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

__all__ = ["AgentLoopBase", "AgentLoopError", "AgentLoopOutput", "register", "resolve_agent_loops"]

_REGISTRY: dict[str, type] = {}
_BUILT_IN = {"single_turn_agent": "rlfoundry.workers.rollout.agent_loop.single_turn.SingleTurnAgentLoop",
             "tool_agent": "rlfoundry.workers.rollout.agent_loop.tool_agent.ToolAgentLoop",
             "openai_agent": "rlfoundry.workers.rollout.agent_loop.openai_agent.OpenAIAgentLoop",
             "spo_tool_agent": "rlfoundry.workers.rollout.agent_loop.spo_tool_agent.SPOToolAgentLoop"}
# verl recipes' loop classes that rlfoundry ports, as their agent_loop_config_path files name them (the
# originals import verl's agent-loop machinery, which is not here)
_VERL_TARGETS = {"recipe.spo.agent_loop.spo_tool_agent_loop.SPOToolAgentLoop": _BUILT_IN["spo_tool_agent"]}


class AgentLoopError(ValueError):
    """An agent-loop name or config that cannot be resolved; the message names the key and the fix."""


@dataclass
class AgentLoopOutput:
    """One trajectory. ``extra_fields`` become non-tensor columns of the batch (one value per row;
    every loop of a batch should give the same keys — missing ones are filled with None). A loop may
    return a list of them, one training row each (``openai_agent``'s segments); empty ``prompt_ids``
    mean the row's whole context is in ``response_ids`` (masked), its prompt part padding."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    num_turns: int = 2
    messages: list[dict] | None = None  # the chat, for the tokenisation sanity check (None: not checked)
    cut_by_length: bool = False  # the last turn was cut by the budget: the template cannot reproduce it
    extra_fields: dict[str, Any] = field(default_factory=dict)
    chat_template_kwargs: dict[str, Any] | None = None  # what the sanity check renders with (None: the loop's)


class AgentLoopBase:
    """Subclass and implement ``run``. A loop that sets ``takes_images = True`` gets image rows (else they
    are refused): their ``prompt_vision`` (``server.PromptVision``), to pass to every ``server.generate``
    whose context starts with the prompt's tokens. Attributes: ``server`` (``generate(key, token_ids, max_tokens)``),
    ``tokenizer``, ``config`` (the typed ``rollout.multi_turn``), ``tools`` (by name),
    ``interactions`` (by name), ``response_length`` (the whole trajectory's budget after the prompt),
    ``chat_template_kwargs`` (what the data set rendered the prompt with), ``key`` (this trajectory's
    index in the batch, to pass to ``server.generate``), ``agent`` (the typed ``rollout.agent``, or None)."""

    takes_images = False

    def __init__(self, *, server: Any, tokenizer: Any, config: Any, tools: dict, interactions: dict,
                 response_length: int, chat_template_kwargs: dict, key: int, agent: Any = None):
        self.server, self.tokenizer, self.config, self.agent = server, tokenizer, config, agent
        self.tools, self.interactions = tools, interactions
        self.response_length, self.chat_template_kwargs, self.key = int(response_length), chat_template_kwargs, key

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        raise NotImplementedError


def register(name: str):
    """Class decorator: ``@register("my_agent")`` makes the loop selectable by that name."""

    def decorate(cls: type) -> type:
        _REGISTRY[name] = cls
        return cls

    return decorate


def _import(target: str, where: str) -> type:
    module_name, _, attr = _VERL_TARGETS.get(target, target).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as e:
        raise AgentLoopError(f"{where}: {target!r} cannot be imported ({e}); give a dotted module.Class") from e
    if not (isinstance(cls, type) and issubclass(cls, AgentLoopBase)):
        raise AgentLoopError(f"{where}: {target!r} is not a subclass of "
                             "rlfoundry.workers.rollout.agent_loop.AgentLoopBase")
    return cls


def resolve_agent_loops(names: set[str], config_path: str | None) -> dict[str, type]:
    """The loop class of every name in ``names``: the config file's entries, then registered loops,
    then the built-in ones."""
    listed: dict[str, str] = {}
    if config_path:
        path = Path(config_path).expanduser()
        if not path.is_file():
            raise AgentLoopError(f"agent loop config {path} does not exist "
                                 "(actor_rollout_ref.rollout.agent.agent_loop_config_path)")
        entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
        if not isinstance(entries, list) or not all(isinstance(e, dict) and "name" in e and "_target_" in e
                                                     for e in entries):
            raise AgentLoopError(f"{path}: expected a list of {{name: ..., _target_: module.Class}} entries")
        listed = {e["name"]: e["_target_"] for e in entries}
    classes = {}
    for name in sorted(names):
        if name in listed:
            classes[name] = _import(listed[name], f"{config_path}: {name}")
        elif name in _REGISTRY:
            classes[name] = _REGISTRY[name]
        elif name in _BUILT_IN:
            classes[name] = _import(_BUILT_IN[name], name)
        else:
            known = sorted({*listed, *_REGISTRY, *_BUILT_IN})
            raise AgentLoopError(f"agent loop {name!r} (a row's agent_name or rollout.agent.default_agent_loop) is "
                                 f"not known; known: {known}. Register it with @register({name!r}) or list it "
                                 "in rollout.agent.agent_loop_config_path")
    return classes
