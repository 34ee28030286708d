"""``tool_agent``: one trajectory of assistant turns, tool calls and simulated-user turns, token in, token out.

From the prompt's token ids (rendered by the data set with the tools offered) the trajectory alternates:

1. the engine generates an assistant turn (``server.generate``, batched with other trajectories' turns)
   from the row's tokens so far — or, with ``use_inference_chat_template``, from the chat's messages
   rendered afresh by the template (verl's meaning; the row still gets the sampled tokens unchanged);
2. tool calls are parsed from the turn's text by the parser ``rollout.multi_turn.format`` names
   (``tools/parser.py``: hermes, qwen, gpt-oss, qwen3_coder); a malformed call becomes an error message;
3. the calls run (``tools/runner.py``: concurrently, each under ``tool_timeout_s``, failures contained)
   and their texts, cut to ``max_tool_response_length`` characters, are appended as the chat template
   renders tool messages after an assistant turn (gpt-oss: harmony's tool messages written out, as verl
   does, since its template renders a tool message only after the call it answers) — tokenised once, the
   turn's own tokens never re-tokenised; or, with no call and an interaction configured for the row
   (``extra_info.interaction_kwargs.name``), the simulated user answers as a user turn, or ends the
   trajectory (its last words are not appended: they would be masked tokens after the last sampled one);

until a turn has no call (and no interaction continues it), a turn limit is reached, or the response
budget (``data.max_response_length`` tokens over all turns) runs out. ``response_mask`` is 1 exactly on
the tokens the policy sampled, ``response_logprobs`` their log-probs (0 elsewhere).

Image rows (docs/vision.md): every turn's engine call gets the prompt's pixel inputs and 3-D rotary
positions (``server.PromptVision``; the turns after the first add text only), tools see the images as
``agent_data.image_data``, and the batch keeps the row's ``multi_modal_inputs`` for the trainer.

Extra columns per row: ``tool_calls``, ``tool_errors``, ``tool_reward`` (the tools' ``calc_reward`` plus
step rewards), ``turn_scores`` (the interaction's score per user turn), ``stop_reason`` (``no_call``,
``length``, ``max_assistant_turns``, ``max_user_turns``, ``interaction_done``), ``last_turn_start``
(rule rewards score the final assistant turn), ``turns`` (``[role, start, end]`` per appended turn, in
response-token positions: ``assistant`` spans sampled, ``tool`` / ``user`` spans not) and ``tool_results``
(``{tool, text, error}`` per call answered, the text as appended).

Tools see verl's calls: one instance per tool per trajectory, made with ``create(create_kwargs={...})``
and the same keys as keywords (verl's agent loop passes the first, its older SGLang rollout the
second; verl's own tools read one or the other), and ``execute(instance_id, parameters,
agent_data=AgentData(...))``. Unlike verl's agent loop, which makes and releases an instance per call
and never calls ``calc_reward``, an instance here lives for the trajectory (verl's SGLang life cycle),
so a tool's state carries from one call to the next.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import json
import logging
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from rlfoundry.tools.parser import FORMATS, ParsedTurn, parse_tool_calls
from rlfoundry.tools.runner import ToolCall, ToolCallResult, run_in_thread, run_tool_calls
from rlfoundry.tools.schemas import OpenAIFunctionParsedSchema
from rlfoundry.utils.rollout_trace import rollout_trace_op
from rlfoundry.workers.rollout.agent_loop.base import AgentLoopBase, AgentLoopError, AgentLoopOutput, register
from rlfoundry.workers.rollout.agent_loop.server import PromptVision

__all__ = ["AgentData", "ToolAgentLoop", "apply_template", "render_after_assistant", "truncate_text"]

logger = logging.getLogger(__name__)

_LIFECYCLE_TIMEOUT_S = 30.0  # create / calc_reward / release of one tool instance, one interaction call
# Threads that wait on tools (each tool call has a thread of its own inside): many trajectories wait at once
_WAITERS = ThreadPoolExecutor(max_workers=256, thread_name_prefix="rlfoundry-tool-wait")


def truncate_text(text: str, limit: int, side: str) -> str:
    """``text`` cut to ``limit`` characters, keeping the start (``left``), the end (``right``) or both
    ends (``middle``), with a marker where it was cut (verl's convention)."""
    if len(text) <= limit:
        return text
    if side == "left":
        return text[:limit] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-limit:]
    half = limit // 2
    return text[:half] + "...(truncated)..." + text[len(text) - (limit - half):]


def apply_template(tokenizer: Any, chat_template_kwargs: dict, messages: list[dict], add_generation_prompt: bool) -> str:
    kwargs = {k: v for k, v in chat_template_kwargs.items() if k != "add_generation_prompt"}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs)


def render_after_assistant(tokenizer: Any, chat_template_kwargs: dict, messages: list[dict], end_token: int) -> list[int]:
    """The tokens the chat template puts after an assistant turn that ended with ``end_token``:
    what follows that token in the template's text, the new messages, the next generation prompt."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
    before = apply_template(tokenizer, chat_template_kwargs, base, False)
    full = apply_template(tokenizer, chat_template_kwargs, base + messages, True)
    end_text = tokenizer.convert_ids_to_tokens(end_token)
    cut = before.rfind(end_text) if isinstance(end_text, str) else -1
    trailing = before[cut + len(end_text):] if cut >= 0 else ""
    return tokenizer.encode(trailing + full[len(before):], add_special_tokens=False)


async def _waiting(fn, *args: Any) -> Any:
    """``fn(*args)`` on a waiter thread, in this task's context (run_in_executor alone would drop it)."""
    return await asyncio.get_running_loop().run_in_executor(_WAITERS, contextvars.copy_context().run, fn, *args)


async def _in_thread(make, timeout_s: float) -> Any:
    """``make()`` awaited on its own event loop and thread, bounded in time; raises what it raised."""
    finished, value = await _waiting(run_in_thread, make, timeout_s)
    if not finished:
        raise TimeoutError(f"no answer within {timeout_s:g} s")
    if isinstance(value, BaseException):
        raise value
    return value


@dataclass
class _State:
    prompt_ids: list[int]
    messages: list[dict]  # the chat so far (sanity check, interaction, use_inference_chat_template)
    tools_kwargs: dict[str, Any]
    response_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    instances: dict[str, str] = field(default_factory=dict)
    assistant_turns: int = 0
    user_turns: int = 0
    tool_calls: int = 0
    errors: Counter = field(default_factory=Counter)
    step_reward: float = 0.0
    turn_scores: list[float] = field(default_factory=list)
    stop: str | None = None
    last_turn_start: int = 0
    interaction: str | None = None  # the simulated user's instance id, if the row has one
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    extra_fields: dict[str, Any] = field(default_factory=dict)  # the tools' store, see AgentData
    vision: PromptVision | None = None  # an image prompt's pixel inputs and positions, for every turn
    images: list[Any] | None = None  # its images (the row's multi_modal_data), for the tools
    turns: list[tuple[str, int, int]] = field(default_factory=list)  # (role, start, end) in response_ids
    tool_results: list[dict[str, Any]] = field(default_factory=list)  # each call's answer, as appended

    def append(self, ids: list[int], role: str, log_probs: list[float] | None = None) -> None:
        """Appends a turn's tokens: sampled (mask 1) for the assistant's, never trained for the others."""
        self.turns.append((role, len(self.response_ids), len(self.response_ids) + len(ids)))
        self.response_ids += ids
        self.mask += [int(role == "assistant")] * len(ids)
        self.log_probs += log_probs if log_probs is not None else [0.0] * len(ids)


@dataclass
class AgentData:
    """What every ``execute`` gets as ``agent_data``: the trajectory so far, under the names of verl's
    ``AgentData``. ``extra_fields`` is the tools' own store, the same dict for the whole trajectory; the
    rest is a copy taken before the turn's calls run. verl's ``metrics`` and interaction are not here."""

    request_id: str
    messages: list[dict]
    tools_kwargs: dict[str, Any]
    prompt_ids: list[int]  # the prompt and the response so far (verl's meaning)
    response_ids: list[int]  # the last assistant turn
    response_mask: list[int]
    response_logprobs: list[float]
    tool_calls: list[OpenAIFunctionParsedSchema]  # this turn's, arguments as JSON text (verl's FunctionCall)
    turn_scores: list[float]
    user_turns: int
    assistant_turns: int
    extra_fields: dict[str, Any]
    image_data: list[Any] | None = None
    video_data: list[Any] | None = None

    @classmethod
    def of(cls, state: _State, calls: list[ToolCall]) -> AgentData:
        parsed = [OpenAIFunctionParsedSchema(name=c.call.name, arguments=json.dumps(c.call.arguments)) for c in calls]
        return cls(state.request_id, [dict(m) for m in state.messages], state.tools_kwargs,
                   state.prompt_ids + state.response_ids, state.response_ids[state.last_turn_start:],
                   list(state.mask), list(state.log_probs), parsed, list(state.turn_scores), state.user_turns,
                   state.assistant_turns, state.extra_fields, state.images)


@register("tool_agent")
class ToolAgentLoop(AgentLoopBase):
    """See the module docstring."""

    takes_images = True  # every turn's context starts with the prompt: each gets its pixels (server.py)

    @rollout_trace_op
    async def run(self, sampling_params: dict[str, Any], **row: Any) -> AgentLoopOutput:
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        if self.config.format not in FORMATS:  # format=spo: a row that names this loop in an SPO run
            raise AgentLoopError(f"rollout.multi_turn.format={self.config.format} is read by the spo_tool_agent loop "
                                 "only (code in <code> tags, no tool-call markup); this row's agent_name is tool_agent")
        if self.config.use_inference_chat_template and not row.get("raw_prompt"):
            raise AgentLoopError("rollout.multi_turn.use_inference_chat_template=true renders each turn from the "
                                 "chat's messages, but this row has no raw_prompt: set data.return_raw_chat=True")
        vision = row.get("prompt_vision")
        if FORMATS[self.config.format].render_answers is not None and self.config.use_inference_chat_template:
            raise AgentLoopError(f"rollout.multi_turn.use_inference_chat_template=true re-renders the chat with the "
                                 f"template, which cannot render format={self.config.format}'s tool answers "
                                 "without their calls: set it to false")
        if vision is not None and self.config.use_inference_chat_template:
            raise AgentLoopError("rollout.multi_turn.use_inference_chat_template=true re-renders each turn from the "
                                 "chat's text, which would part the image tokens from their pixels: image rows take "
                                 "the row's own tokens (set it to false)")
        state = _State(list(row["prompt_ids"]), list(row.get("raw_prompt") or []),
                       dict(extra.get("tools_kwargs") or {}), vision=vision,
                       images=list((row.get("multi_modal_data") or {}).get("image") or []) or None)
        interaction, interaction_kwargs = self._interaction_for(extra)
        await self._lifecycle(state, "create")
        instance = await self._start_interaction(state, interaction, interaction_kwargs)
        while state.stop is None:
            calls = await self._assistant_turn(state)
            if calls is not None:
                await self._tool_turn(state, *calls)
            elif state.stop is None:
                await self._interaction_turn(state, interaction, instance, interaction_kwargs)
        await self._lifecycle(state, "finish")
        if instance is not None:
            await self._interaction_call(state, interaction, "finalize_interaction", instance)
        # the template cannot re-render hand-written tool answers: no chat to check the tokens against
        has_chat = bool(row.get("raw_prompt")) and FORMATS[self.config.format].render_answers is None
        return self._output(state, has_chat=has_chat)

    # ---- turns --------------------------------------------------------------------------------

    async def _assistant_turn(self, state: _State) -> tuple[list[ToolCall], list[ToolCallResult]] | None:
        """Generates a turn; returns its calls to run and the answers already known (malformed calls,
        calls over the limit), or None when there is no call (``state.stop`` says if it ended)."""
        room = self.response_length - len(state.response_ids)
        turn = await self.server.generate(self.key, self._engine_prompt(state), room, state.vision)
        state.last_turn_start = len(state.response_ids)
        state.append(turn.token_ids, "assistant", turn.log_probs)
        state.assistant_turns += 1
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        state.messages.append({"role": "assistant", "content": text})
        parsed = self._parse(turn.token_ids)
        eos = self.server.eos_ids or {self.tokenizer.eos_token_id}
        if not (turn.token_ids and turn.token_ids[-1] in eos):
            state.stop = "length"
        elif not parsed.calls and not parsed.errors:
            state.stop = None if self._interaction_continues(state) else "no_call"
            return None
        elif self.config.max_assistant_turns is not None and state.assistant_turns >= self.config.max_assistant_turns:
            state.stop = "max_assistant_turns"
        if state.stop is not None:
            return None
        limit = self.config.max_parallel_calls
        calls = [ToolCall(state.instances.get(c.name, ""), c) for c in parsed.calls[:limit]]
        refused = [ToolCallResult(c.name, f"error: at most {limit} tool calls per turn", error="too_many_calls")
                   for c in parsed.calls[limit:]]
        return calls, [ToolCallResult(e.name, e.message, error="bad_call") for e in parsed.errors] + refused

    def _parse(self, token_ids: list[int]) -> ParsedTurn:
        """The turn's calls, read from its text with the special tokens (padding removed), as verl's parsers
        read it: a tokenizer may make the markup special (harmony's always, ``<tool_call>`` in some)."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=False)
        if self.tokenizer.pad_token:
            text = text.replace(self.tokenizer.pad_token, "")
        types = {name: {arg: p.type for arg, p in tool.tool_schema.function.parameters.properties.items()}
                 for name, tool in self.tools.items()}
        return parse_tool_calls(self.config.format, text, types)

    async def _tool_turn(self, state: _State, calls: list[ToolCall], early: list[ToolCallResult]) -> None:
        """The calls run in threads (this trajectory waits; the others go on generating)."""
        answers = await _waiting(functools.partial(run_tool_calls, agent_data=AgentData.of(state, calls)),
                                 self.tools, calls, max(1, len(calls)), self.config.tool_timeout_s)
        answers = list(answers) + early
        state.tool_calls += len(answers)
        for a in answers:
            state.step_reward += a.reward
            if a.error:
                state.errors[f"{'parse' if a.error == 'bad_call' else a.tool}/{a.error}"] += 1
        limit, side = self.config.max_tool_response_length, self.config.tool_response_truncate_side
        messages = [{"role": "tool", "content": truncate_text(a.text, limit, side)} for a in answers]
        state.tool_results += [{"tool": a.tool, "text": m["content"], "error": a.error or None}
                               for a, m in zip(answers, messages)]
        render = FORMATS[self.config.format].render_answers
        if render is None:
            self._user_turn(state, messages)
        else:
            text = render([a.tool for a in answers], [m["content"] for m in messages])
            self._append_turn(state, messages, self.tokenizer.encode(text, add_special_tokens=False))

    def _user_turn(self, state: _State, messages: list[dict]) -> None:
        self._append_turn(state, messages, self._render_after_assistant(messages, state.response_ids[-1]))

    def _append_turn(self, state: _State, messages: list[dict], ids: list[int]) -> None:
        """Appends tool or user messages (never sampled) as ``ids``, which end with the next generation prompt."""
        room = self.response_length - len(state.response_ids)
        state.append(ids[:room], messages[0]["role"])
        state.messages += messages
        state.user_turns += 1
        if len(ids) >= room:
            state.stop = "length"
        elif self.config.max_user_turns is not None and state.user_turns >= self.config.max_user_turns:
            state.stop = "max_user_turns"

    # ---- interactions (simulated users) ------------------------------------------------------------

    def _interaction_for(self, extra: dict) -> tuple[Any, dict]:
        kwargs = dict(extra.get("interaction_kwargs") or {})
        if not self.interactions:
            return None, kwargs
        name = kwargs.get("name") or (next(iter(self.interactions)) if len(self.interactions) == 1 else None)
        if name not in self.interactions:
            raise AgentLoopError(f"extra_info.interaction_kwargs.name={name!r} names no configured interaction; "
                                 f"configured: {sorted(self.interactions)} "
                                 "(actor_rollout_ref.rollout.multi_turn.interaction_config_path)")
        return self.interactions[name], kwargs

    def _interaction_continues(self, state: _State) -> bool:
        return state.interaction is not None and not (
            self.config.max_assistant_turns is not None and state.assistant_turns >= self.config.max_assistant_turns)

    async def _start_interaction(self, state: _State, interaction: Any, kwargs: dict) -> str | None:
        if interaction is None:
            return None
        state.interaction = await self._interaction_call(state, interaction, "start_interaction", None, **kwargs)
        return state.interaction

    async def _interaction_turn(self, state: _State, interaction: Any, instance: str, kwargs: dict) -> None:
        answer = await self._interaction_call(state, interaction, "generate_response", instance,
                                              messages=list(state.messages), **kwargs)
        if answer is None:  # the interaction failed: counted, the trajectory ends here
            state.stop = "interaction_error"
            return
        done, text, score, _ = answer
        if score is not None:
            state.turn_scores.append(float(score))
        if done:  # its closing words would only be masked tokens after the last sampled one
            state.stop = "interaction_done"
        else:
            self._user_turn(state, [{"role": "user", "content": str(text)}])

    async def _interaction_call(self, state: _State, interaction: Any, method: str, instance: str | None,
                                **kwargs: Any) -> Any:
        try:
            call = getattr(interaction, method)
            args = () if instance is None else (instance,)
            return await _in_thread(lambda: call(*args, **kwargs), _LIFECYCLE_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a failing simulated user costs this trajectory's turn
            state.errors[f"interaction/{method}_failed"] += 1
            logger.warning("multi-turn: interaction %s failed: %s: %s", method, type(e).__name__, e)
            return None

    # ---- tool instances -----------------------------------------------------------------------

    async def _lifecycle(self, state: _State, phase: str) -> None:
        """``create`` every tool's instance, or ``calc_reward`` + ``release`` them; a failure costs that
        instance only (counted as ``<tool>/<phase>_failed``)."""

        async def create(name, tool):
            kwargs = dict((state.tools_kwargs.get(name) or {}).get("create_kwargs") or {})
            created = await tool.create(create_kwargs=dict(kwargs), **kwargs)  # both spellings: see the docstring
            state.instances[name] = created[0] if isinstance(created, tuple) else created

        async def finish(name, tool):
            if name in state.instances:
                kwargs = dict((state.tools_kwargs.get(name) or {}).get("calc_reward_kwargs") or {})
                state.step_reward += float(await tool.calc_reward(state.instances[name], **kwargs))
                await tool.release(state.instances[name])

        step = create if phase == "create" else finish
        for name, tool in self.tools.items():
            try:
                await _in_thread(lambda: step(name, tool), _LIFECYCLE_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - contained, see the docstring
                state.errors[f"{name}/{phase}_failed"] += 1
                logger.warning("multi-turn: %s.%s failed: %s: %s", name, phase, type(e).__name__, e)

    # ---- the chat template ------------------------------------------------------------------

    def _engine_prompt(self, state: _State) -> list[int]:
        """The tokens the engine continues: the row's own (token in, token out), or with
        ``use_inference_chat_template`` the chat so far rendered afresh with the generation prompt, as
        verl's SGLang rollout does (a template such as Qwen3's then drops earlier turns' reasoning). The
        row keeps the sampled tokens either way; only the engine's context differs."""
        if not self.config.use_inference_chat_template:
            return state.prompt_ids + state.response_ids
        text = apply_template(self.tokenizer, self.chat_template_kwargs, state.messages, True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def _render_after_assistant(self, messages: list[dict], end_token: int) -> list[int]:
        return render_after_assistant(self.tokenizer, self.chat_template_kwargs, messages, end_token)

    def _output(self, state: _State, has_chat: bool) -> AgentLoopOutput:
        return AgentLoopOutput(
            prompt_ids=state.prompt_ids, response_ids=state.response_ids, response_mask=state.mask,
            response_logprobs=state.log_probs, num_turns=state.assistant_turns + state.user_turns,
            messages=state.messages if has_chat else None, cut_by_length=state.stop == "length",
            extra_fields={"tool_calls": state.tool_calls, "tool_errors": dict(state.errors),
                          "tool_reward": state.step_reward, "turn_scores": list(state.turn_scores),
                          "stop_reason": state.stop, "last_turn_start": state.last_turn_start,
                          "turns": [list(t) for t in state.turns], "tool_results": list(state.tool_results)})
