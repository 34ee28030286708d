"""Run a turn's tool calls: concurrently, each under a timeout, every failure contained.

Each call runs in a thread of its own with its own event loop, so that a tool which blocks (a sync
``time.sleep`` in an async method, a hung library call) holds up only its own call: the caller stops
waiting at the timeout and the trajectory gets an error text. Python cannot kill a thread; an
abandoned call keeps its (daemon) thread until it returns, which is why tools that run code use the
process sandbox, whose limits do kill.

Threads start in a copy of the caller's context (as ``asyncio.to_thread`` does), so a call traced with
``@rollout_trace_op`` keeps the trajectory's ``rollout_trace_attr`` tags.

Whatever a tool does — raise, hang, return something that is not text — the result is a
:class:`ToolCallResult` whose ``text`` goes back to the model and whose ``error`` names the failure
(``unknown_tool``, ``exception``, ``timeout``, ``non_text``, ``image_answer``, ``too_many_calls``) for the metrics.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.parser import ParsedCall
from rlfoundry.tools.schemas import OpenAIFunctionCallSchema, ToolResponse

__all__ = ["ToolCall", "ToolCallResult", "run_in_thread", "run_tool_calls"]


@dataclass(frozen=True)
class ToolCall:
    """One call of one trajectory: its tool instance and the parsed call."""

    instance_id: str
    call: ParsedCall | OpenAIFunctionCallSchema  # .name, .arguments (a dict)


@dataclass
class ToolCallResult:
    tool: str
    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def run_in_thread(make: Callable[[], Awaitable[Any]], timeout_s: float) -> tuple[bool, Any]:
    """``(finished, value or exception)`` of ``make()`` awaited on a fresh event loop in a daemon thread."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(make())
        except BaseException as e:  # noqa: BLE001 - handed to the caller, whatever it is
            box["error"] = e

    context = contextvars.copy_context()
    thread = threading.Thread(target=context.run, args=(target,), daemon=True, name="rlfoundry-tool-call")
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return False, None
    return True, box.get("error", box.get("value"))


def run_tool_calls(tools: dict[str, BaseTool], calls: list[ToolCall], max_parallel: int,
                   timeout_s: float, **execute_kwargs: Any) -> list[ToolCallResult]:
    """Results in the order of ``calls``: the first ``max_parallel`` run at once, the rest are refused.
    ``execute_kwargs`` (the agent loop's ``agent_data``) go to every ``execute``."""
    results: list[ToolCallResult | None] = [None] * len(calls)
    threads = []
    for i, job in enumerate(calls):
        name = job.call.name
        if i >= max_parallel:
            results[i] = ToolCallResult(name, f"error: at most {max_parallel} tool calls per turn", error="too_many_calls")
        elif name not in tools:
            results[i] = ToolCallResult(name, f"error: no tool named {name!r}; available: {sorted(tools)}",
                                        error="unknown_tool")
        else:
            thread = threading.Thread(target=contextvars.copy_context().run, daemon=True,
                                      args=(_run_one, tools[name], job, timeout_s, results, i, execute_kwargs))
            thread.start()
            threads.append(thread)
    for thread in threads:
        thread.join()  # each returns by its own timeout
    return [r for r in results if r is not None]


def _run_one(tool: BaseTool, job: ToolCall, timeout_s: float, results: list, i: int, kwargs: dict) -> None:
    name = job.call.name
    finished, value = run_in_thread(lambda: tool.execute(job.instance_id, job.call.arguments, **kwargs), timeout_s)
    if not finished:
        results[i] = ToolCallResult(name, f"error: {name} timed out after {timeout_s:g} s", error="timeout")
    elif isinstance(value, BaseException):
        results[i] = ToolCallResult(name, f"error: {name} failed: {type(value).__name__}: {value}", error="exception")
    else:
        results[i] = _as_result(name, value)


def _as_result(name: str, value: Any) -> ToolCallResult:
    """verl's ``(ToolResponse | str, reward, metrics)`` (or a bare response) -> a result."""
    response, reward, metrics = value if isinstance(value, tuple) and len(value) == 3 else (value, 0.0, {})
    if isinstance(response, ToolResponse) and (response.image or response.video):
        return ToolCallResult(name, f"error: {name} answered with an image or video, which this agent loop cannot "
                              "show the model (text answers only)", error="image_answer")
    text = response.text if isinstance(response, ToolResponse) else response
    if not isinstance(text, str):
        return ToolCallResult(name, f"error: {name} returned {type(text).__name__}, not text", error="non_text")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        reward = 0.0
    return ToolCallResult(name, text, reward, dict(metrics) if isinstance(metrics, dict) else {})
