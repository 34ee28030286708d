"""Tools from a tool-config YAML in verl's layout (``actor_rollout_ref.rollout.multi_turn.tool_config_path``)::

    tools:
      - class_name: rlfoundry.tools.calculator.CalculatorTool   # or a verl class name we provide
        config: {type: native}                                   # + the tool's own settings
        tool_schema:
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, properties: ..., required: [...]}}

verl's built-in class names resolve to this package's equivalents, so a verl config loads unchanged:
the GSM8K and Geo3K answer tools, SandboxFusion code execution (``sandbox_fusion``: the server, or this
machine's sandbox) and Search-R1 retrieval (``search``). verl's image zoom-in and MCP tools are refused
with the reason (``_NOT_BUILT``); any other ``module.Class`` is imported as it is.
An entry may leave out ``tool_schema`` when its class supplies one (``get_openai_tool_schema()``), as
in verl. A class whose ``create`` or ``execute`` takes no ``**kwargs`` is refused here, not at its
first call: the agent loop passes ``create_kwargs=`` and ``agent_data=``, as verl's does.
"""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf
from pydantic import ValidationError

from rlfoundry.tools.base import BaseTool, ToolSchemaError
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema
from rlfoundry.utils.verl_imports import real_verl_hint

__all__ = ["ToolConfigError", "initialize_tools_from_config", "load_tool_class"]

_VERL_CLASSES = {
    "verl.tools.gsm8k_tool.Gsm8kTool": "rlfoundry.tools.gsm8k.Gsm8kTool",
    "verl.tools.geo3k_tool.Geo3kTool": "rlfoundry.tools.geo3k.Geo3kTool",
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": "rlfoundry.tools.sandbox_fusion.SandboxFusionTool",
    "verl.tools.search_tool.SearchTool": "rlfoundry.tools.search.SearchTool",
    "verl.tools.base_tool.BaseTool": "rlfoundry.tools.base.BaseTool",
}
_MCP = ("verl's MCP tools list and call tools of an MCP server through the mcp / fastmcp client, which "
        "rlfoundry does not ship; wrap the server's tools in a BaseTool subclass (docs/agents.md)")
_NOT_BUILT = {
    "verl.tools.image_zoom_in_tool.ImageZoomInTool": (
        "it answers with an image, and the tool agent loop appends tools' text only (an image answer would "
        "need its pixels added to the trajectory's vision inputs, not built)"),
    "verl.tools.mcp_search_tool.MCPSearchTool": _MCP,
    "verl.tools.mcp_base_tool.MCPBaseTool": _MCP,
}


class ToolConfigError(ValueError):
    """A tool config that cannot be loaded; the message names the file, the entry and the fix."""


def load_tool_class(class_name: str) -> type[BaseTool]:
    if class_name in _NOT_BUILT:
        raise ToolConfigError(f"{class_name} cannot run here: {_NOT_BUILT[class_name]}")
    if class_name.startswith("verl.") and class_name not in _VERL_CLASSES:
        raise ToolConfigError(f"class_name {class_name!r} is not one of verl's tools that rlfoundry provides "
                              f"({sorted(_VERL_CLASSES)}); copy the class into your project (its verl imports resolve here) and name it")
    module_name, _, attr = _VERL_CLASSES.get(class_name, class_name).rpartition(".")
    if not module_name:
        raise ToolConfigError(f"class_name {class_name!r} is not a dotted path module.Class")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ToolConfigError(f"class_name {class_name!r} cannot be imported: {e}{real_verl_hint()}") from e
    if not (isinstance(cls, type) and issubclass(cls, BaseTool)):
        raise ToolConfigError(f"class_name {class_name!r} is not a subclass of rlfoundry.tools.base.BaseTool"
                              f"{real_verl_hint()}")
    for method, call in (("create", "create(create_kwargs={...}, **create_kwargs)"),
                         ("execute", "execute(instance_id, parameters, agent_data=...)")):
        if not any(p.kind is p.VAR_KEYWORD for p in inspect.signature(getattr(cls, method)).parameters.values()):
            raise ToolConfigError(f"{class_name}.{method} must take **kwargs: the agent loop calls {call}")
    return cls


def initialize_tools_from_config(path: str | Path) -> list[BaseTool]:
    """One tool object per entry; names must be unique."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ToolConfigError(f"tool config {path} does not exist (actor_rollout_ref.rollout.multi_turn.tool_config_path)")
    entries = OmegaConf.to_container(OmegaConf.load(path), resolve=True).get("tools")
    if not isinstance(entries, list) or not entries:
        raise ToolConfigError(f"{path}: expected a non-empty 'tools:' list")
    tools = [_build(path, i, entry) for i, entry in enumerate(entries)]
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise ToolConfigError(f"{path}: tool names must be unique, got {names}")
    return tools


def _build(path: Path, index: int, entry: Any) -> BaseTool:
    where = f"{path}: tools[{index}]"
    if not isinstance(entry, dict) or "class_name" not in entry:
        raise ToolConfigError(f"{where} needs a class_name (and a tool_schema unless the class supplies one)")
    config = dict(entry.get("config") or {})
    kind = config.get("type", "native")
    if kind == "mcp":
        raise ToolConfigError(f"{where} ({entry['class_name']}): config.type=mcp cannot run here: {_MCP}")
    if kind != "native":
        raise ToolConfigError(f"{where}: config.type={kind!r} is not supported; only native (in-process) tools run here")
    try:
        schema = None if entry.get("tool_schema") is None else OpenAIFunctionToolSchema.model_validate(entry["tool_schema"])
    except ValidationError as e:
        raise ToolConfigError(f"{where}: tool_schema is not an OpenAI function schema: {e}") from e
    try:
        return load_tool_class(entry["class_name"])(config, schema)
    except (ToolConfigError, ToolSchemaError) as e:
        raise ToolConfigError(f"{where}: {e}") from e
