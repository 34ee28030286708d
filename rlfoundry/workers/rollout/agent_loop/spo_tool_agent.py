"""``spo_tool_agent``: verl's SPO recipe loop (``recipe/spo/agent_loop/spo_tool_agent_loop.py``), where the
model writes Python between ``<code>`` tags and reads the interpreter's output, no tool-call JSON.

Each assistant turn is sampled until the first ``</code>`` (verl adds ``stop="</code>"`` with the stop string
kept; here the turn is cut after the token that completes it, so its tokens are those vLLM would return).
The first ``<code>...</code>`` block of the turn (a markdown fence inside it removed) runs in the tool
named ``code_interpreter`` (verl's recipe: its ``CustomSandboxFusionTool``), called as verl calls it —
``create(create_kwargs={})``, ``execute(instance_id, code)`` with the code *as a string*, ``release`` — an
instance per call. Its text, cut to ``max_tool_response_length`` characters, is appended as
``<interpreter>\\n{text}\\n</interpreter>\\n\\n`` (no chat-template markup: the model goes on inside its
own turn), tokenised once, with ``response_mask`` 0 and log-prob 0. A call that raises or outlives
``tool_timeout_s`` answers ``Error when executing tool: {error}`` (verl's text, without the tags): that
sample reads the error, the batch goes on.

It stops (``stop_reason``) when a turn has no code block (``no_call``), the budget
(``data.max_response_length``) is reached by a turn or would be by the next interpreter text (``length``;
that text is then not appended, as in verl), or after ``max_assistant_turns`` turns / ``max_user_turns``
interpreter answers (checked after each turn, as verl does). ``multi_turn.format=spo`` names this loop.

Unlike verl, the turns continue the row's prompt tokens as the data set rendered them: verl's loop throws
the row's prompt away and renders its own instruction text around the question (see docs/agents.md).
"""

from __future__ import annotations

import logging
import re
from typing import Any

from rlfoundry.utils.rollout_trace import rollout_trace_op
from rlfoundry.workers.rollout.agent_loop.base import AgentLoopBase, AgentLoopError, AgentLoopOutput, register
from rlfoundry.workers.rollout.agent_loop.tool_agent import _in_thread, truncate_text

__all__ = ["CODE_STOP", "SPOToolAgentLoop", "code_blocks", "cut_at_stop"]

logger = logging.getLogger(__name__)

CODE_STOP = "</code>"
TOOL_NAME = "code_interpreter"  # the tool verl's loop looks up, whatever the tool config lists
_BLOCK = re.compile(r"<code>(.*?)</code>", re.DOTALL)
_FENCE_OPEN = re.compile(r"^```(?:python)?\s*\n?")
_FENCE_CLOSE = re.compile(r"\n?```\s*$")


def cut_at_stop(tokenizer: Any, token_ids: list[int], stop: str = CODE_STOP) -> int:
    """How many of ``token_ids`` a sampler with stop string ``stop`` (kept in the output) returns: up to
    the token whose text completes the first ``stop``, or all of them."""
    text = tokenizer.decode(token_ids, skip_special_tokens=False)
    if stop not in text:
        return len(token_ids)
    lo, hi = 1, len(token_ids)  # the decoded prefix grows with its length: the shortest one holding stop
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in tokenizer.decode(token_ids[:mid], skip_special_tokens=False):
            hi = mid
        else:
            lo = mid + 1
    return lo


def code_blocks(text: str) -> list[str]:
    """The programs between ``<code>`` tags, a markdown fence around one removed."""
    return [_FENCE_CLOSE.sub("", _FENCE_OPEN.sub("", m.strip())).strip() for m in _BLOCK.findall(text)]


@register("spo_tool_agent")
class SPOToolAgentLoop(AgentLoopBase):
    """See the module docstring."""

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        if TOOL_NAME not in self.tools:
            raise AgentLoopError(f"spo_tool_agent runs code with a tool named {TOOL_NAME!r}; the tool config "
                                 f"(actor_rollout_ref.rollout.multi_turn.tool_config_path) has {sorted(self.tools)}")
        ids, mask, log_probs, turns = [], [], [], []
        assistant = user = calls = errors = 0
        while True:
            room = self.response_length - len(ids)
            turn = await self.server.generate(self.key, list(row["prompt_ids"]) + ids, room)
            keep = cut_at_stop(self.tokenizer, turn.token_ids)
            turns.append(["assistant", len(ids), len(ids) + keep])
            ids, mask, log_probs = ids + turn.token_ids[:keep], mask + [1] * keep, log_probs + turn.log_probs[:keep]
            assistant += 1
            stop = self._limit(len(ids), assistant, user)
            if stop is not None:
                break
            programs = code_blocks(self.tokenizer.decode(turn.token_ids[:keep], skip_special_tokens=False))
            if not programs:
                stop = "no_call"
                break
            text, failed = await self._run_code(programs[0])  # verl appends the first block's answer only
            calls, errors = calls + 1, errors + failed
            answer = self.tokenizer.encode(text, add_special_tokens=False)
            if len(ids) + len(answer) >= self.response_length:
                stop = "length"
                break
            turns.append(["tool", len(ids), len(ids) + len(answer)])
            ids, mask, log_probs = ids + answer, mask + [0] * len(answer), log_probs + [0.0] * len(answer)
            user += 1
        return AgentLoopOutput(
            prompt_ids=list(row["prompt_ids"]), response_ids=ids, response_mask=mask, response_logprobs=log_probs,
            num_turns=assistant + user + 1, cut_by_length=stop == "length",
            extra_fields={"tool_calls": calls,
                          "tool_errors": {f"{TOOL_NAME}/error": errors} if errors else {},
                          "stop_reason": stop, "turns": turns,
                          # one assistant message: rule rewards read all of it, as verl's reward sees it
                          "last_turn_start": 0})

    def _limit(self, length: int, assistant: int, user: int) -> str | None:
        """Why the trajectory ends after an assistant turn, by verl's checks in verl's order."""
        if length >= self.response_length:
            return "length"
        if self.config.max_assistant_turns and assistant >= self.config.max_assistant_turns:
            return "max_assistant_turns"
        if self.config.max_user_turns and user >= self.config.max_user_turns:
            return "max_user_turns"
        return None

    async def _run_code(self, code: str) -> tuple[str, bool]:
        """The interpreter's text to append and whether the call failed (raised or timed out)."""
        tool = self.tools[TOOL_NAME]

        async def call() -> Any:
            instance = await tool.create(create_kwargs={})
            instance = instance[0] if isinstance(instance, tuple) else instance
            try:
                return await tool.execute(instance, code)
            finally:
                await tool.release(instance)

        try:
            result = await _in_thread(call, self.config.tool_timeout_s)
        except Exception as e:  # noqa: BLE001 - a failing program costs this sample only
            logger.warning("spo_tool_agent: the code interpreter failed: %s: %s", type(e).__name__, e)
            return f"Error when executing tool: {e}", True
        answer = result[0] if isinstance(result, tuple) else result
        text = answer if isinstance(answer, str) else (getattr(answer, "text", None) or "")
        limit, side = self.config.max_tool_response_length, self.config.tool_response_truncate_side
        return f"<interpreter>\n{truncate_text(text, limit, side)}\n</interpreter>\n\n", False
