"""verl's SandboxFusion code tool (``verl.tools.sandbox_fusion_tools.SandboxFusionTool``): each call runs
the model's ``code`` on the SandboxFusion server at ``sandbox_fusion_url`` or, with no URL, in this
machine's sandbox (``rlfoundry.sandbox``: kernel namespaces, seccomp, limits), and answers verl's text:
what the program wrote, stdout then stderr, whatever its exit code; ``no stdout here`` when it ran out
of time. A server that cannot be reached is a counted tool error naming it, not an empty answer.

verl's config keys: ``default_timeout`` (30 s), ``memory_limit_mb`` (1024), ``default_language``
(python, the only language here), ``rate_limit`` with ``enable_global_rate_limit`` (else ``num_workers``):
this tool's programs running at once, per process (verl's limit is one Ray actor for the cluster). verl's
``execution_pool.execute.remote(self.execute_code, …)`` and ``execute_code`` are here, so a recipe's
subclass (retool's ``CustomSandboxFusionTool``) runs unchanged. A call
may set ``timeout`` and ``language`` among its arguments, as verl reads them; the timeout is capped at
``default_timeout`` (a model must not buy unbounded time). Step reward 0, ``calc_reward`` 0.0 (verl's
returns an empty list, which is not a reward).
"""

from __future__ import annotations

import asyncio
import math
import threading
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any

from rlfoundry.sandbox import SandboxLimits
from rlfoundry.tools.code_interpreter import CodeInterpreterTool
from rlfoundry.tools.registry import ToolConfigError
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.utils.rollout_trace import rollout_trace_op

__all__ = ["ExecutionPool", "SandboxFusionTool"]

_LANGUAGES = ("python", "python3")


class _Call:
    """``await pool.execute.remote(fn, *args)``: ``fn(*args)`` on a thread, at most ``slots`` at once."""

    def __init__(self, slots: int):
        self._slots = threading.BoundedSemaphore(max(1, slots))

    def remote(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return asyncio.to_thread(self._run, fn, *args, **kwargs)

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        with self._slots:
            return fn(*args, **kwargs)


class ExecutionPool:
    """verl's execution pool as its tool subclasses call it (``self.execution_pool.execute.remote(...)``,
    a Ray actor there; a thread per call here), so a recipe's subclass runs unchanged."""

    def __init__(self, slots: int):
        self.execute = _Call(slots)


class SandboxFusionTool(CodeInterpreterTool):
    """``code_interpreter(code)`` → stdout + stderr, as verl's tool answers."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        c = dict(config or {})
        c.setdefault("default_timeout", 30)
        super().__init__(c, tool_schema)
        self.default_timeout = self.limits.wall_time_s
        self.default_language = str(c.get("default_language", "python"))
        if self.default_language not in _LANGUAGES:
            raise ToolConfigError(f"SandboxFusionTool: default_language={self.default_language!r} cannot run here; "
                                  "only python programs run (set default_language: python)")
        at_once = c.get("rate_limit", 10) if c.get("enable_global_rate_limit", True) else c.get("num_workers", 10)
        self.execution_pool = ExecutionPool(int(at_once))

    @rollout_trace_op
    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        code = parameters.get("code", "")
        timeout = parameters.get("timeout", self.default_timeout)
        language = parameters.get("language", self.default_language)
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id, str(code), timeout, language)
        return result, 0.0, {}

    def execute_code(self, instance_id: str, code: str, timeout: Any = 30, language: str = "python") -> ToolResponse:
        """One program's answer (verl's method, which subclasses call)."""
        if str(language) not in _LANGUAGES:
            return ToolResponse(text=f"error: language {language!r} cannot run here; only python")
        result = self.run(code, self._limits(timeout))
        return ToolResponse(text="no stdout here" if result.status == "timeout" else result.stdout + result.stderr)

    def _limits(self, timeout: Any) -> SandboxLimits:
        """The configured limits, with a shorter wall time when the call asked for one."""
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < self.limits.wall_time_s:
            return self.limits
        return replace(self.limits, wall_time_s=float(timeout), cpu_time_s=max(1, math.ceil(timeout)))

    async def calc_reward(self, instance_id: str, **kwargs: Any) -> float:
        return 0.0
