"""A Python code interpreter tool: each call runs in :mod:`rlfoundry.sandbox` (kernel namespaces and
a seccomp filter; CPU / memory / wall-clock / output limits; no processes, network or host files),
or on a SandboxFusion server when its config names one.

Config (the ``config:`` block of its tool-config entry): ``wall_time_s``, ``cpu_time_s``,
``memory_mb``, ``max_output_bytes``, and verl's SandboxFusion tool keys ``sandbox_fusion_url``,
``default_timeout`` (= ``wall_time_s``), ``memory_limit_mb`` (= ``memory_mb``). The model sees stdout, then stderr's last lines on failure,
with the reason when a limit stopped the run. Nothing is kept between calls.
"""

from __future__ import annotations

import asyncio
from typing import Any

from rlfoundry.sandbox import SandboxLimits, SandboxResult
from rlfoundry.sandbox.fusion import executor
from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["CodeInterpreterTool"]

_LIMIT_REASONS = {"timeout": "time limit reached", "memory": "memory limit reached",
                  "output_limit": "output limit reached", "killed": "killed"}
_TAIL_LINES = 8  # of a traceback: the end says what went wrong


class CodeInterpreterTool(BaseTool):
    """``code_interpreter(code)`` → what the program printed."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        c = self.config
        wall = float(c.get("wall_time_s", c.get("default_timeout", 10.0)))
        memory_mb = int(c.get("memory_mb", c.get("memory_limit_mb", 1024)))
        self.limits = SandboxLimits(wall_time_s=wall, cpu_time_s=int(c.get("cpu_time_s", max(1, round(wall / 2)))),
                                    memory_bytes=memory_mb << 20, max_output_bytes=int(c.get("max_output_bytes", 16384)))
        self.run = executor(c.get("sandbox_fusion_url"), memory_mb, int(c.get("max_concurrent", 64)))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code")
        if not isinstance(code, str) or not code.strip():
            return ToolResponse(text="error: give the program as a string argument 'code'"), 0.0, {"error": 1}
        result = await asyncio.to_thread(self.run, code, self.limits)  # a process: the event loop stays free
        return ToolResponse(text=_render(result)), 0.0, {"status": result.status, "wall_s": result.wall_s}


def _render(result: SandboxResult) -> str:
    if result.ok:
        return result.stdout if result.stdout else "(no output)"
    tail = "\n".join(result.stderr.strip().splitlines()[-_TAIL_LINES:])
    reason = _LIMIT_REASONS.get(result.status)
    parts = [result.stdout.rstrip(), tail, f"[{reason}]" if reason else ""]
    return "\n".join(p for p in parts if p) or f"[exit code {result.exit_code}]"
