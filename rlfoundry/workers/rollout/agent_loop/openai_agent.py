"""``openai_agent``: an agent written against the OpenAI chat API, trained unchanged.

The loop calls a user function (``rollout.agent.openai.path`` / ``.name``; sync or async)::

    def run_agent(base_url: str, api_key: str, prompt: list[dict], extra_info: dict) -> str | dict | None

with the ``base_url`` and ``api_key`` of this trajectory's session on the local endpoint
(``openai_server.py``), the row's chat (``raw_prompt``) and ``extra_info``. It may use any client; its
requests are served by the rollout engine, batched with every other trajectory's turns. It returns the
final answer (a string), a dict of reward inputs (merged into the row's ``extra_info``; ``answer`` there
too), or None; the reward function scores the row's last assistant turn as for every agent loop.

Token in, token out under a text API. Each request's reply is recorded as tokens: the context it was
sampled in, the sampled ids and their log-probs. A request whose messages extend a recorded
conversation (the same tools; its earlier messages as sent, then each assistant reply exactly as the
endpoint returned it, then only tool or user messages) continues it: the sampled ids are reused, never
re-tokenised, and only the new messages are rendered — as the tool agent loop renders them — so
``response_mask`` is 1 exactly on sampled tokens. A request that extends nothing (the agent edited or
summarised its history, branched from an earlier turn, or changed its tools) starts a new *segment*,
its whole chat rendered afresh. Each segment is one training row: the ``rollout.agent.openai.max_segments``
most recent of a trajectory (older ones are dropped and counted), padded with empty rows that no loss
sees, so that the batch keeps a fixed number of rows per trajectory.

Sampling: the policy samples at the rollout's temperature and top-p (the values the PPO ratio corrects
for); a request's own ``temperature`` / ``top_p`` are accepted and not applied. ``max_tokens`` is capped by
the row's remaining budget (``data.max_response_length`` after the data set's prompt); a request that
leaves no room gets a 400 ``context_length_exceeded``. ``stop`` strings cut the sampled ids after the token
that completes the string (the reply's text stops before it). A request's ``seed`` keys its draws (engines
that key them: HF, vLLM; else a 400); ``logprobs`` are the recorded rollout log-probs, ``top_logprobs`` the
engine's alternatives at the same step (the HF engine; else a 400).

Text completions (``/v1/completions``) are recorded the same way: a prompt that starts with a text segment's
context and everything sampled in it (those tokens' text, special tokens included; or its ids, for a prompt
of ids) continues it, only the added text tokenised (masked); any other prompt starts a segment.

A user function that raises, runs past ``timeout_s`` or never calls the endpoint loses its sample: its
rows are empty (``response_mask`` 0), get a ``uid`` of their own so group estimators leave them out of
their prompt's group, and are counted in ``multi_turn/stop/agent_raised`` / ``agent_timeout`` /
``agent_no_requests`` (the share of trajectories). Its session is closed at once: a hung agent's later
requests are refused.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from rlfoundry.tools.parser import FORMATS, parse_tool_calls
from rlfoundry.workers.rollout.agent_loop.base import AgentLoopBase, AgentLoopError, AgentLoopOutput, register
from rlfoundry.workers.rollout.agent_loop.openai_server import (
    ChatRequest,
    CompletionRequest,
    OpenAIEndpoint,
    RequestError,
)
from rlfoundry.workers.rollout.agent_loop.server import Generated
from rlfoundry.workers.rollout.agent_loop.tool_agent import _in_thread, apply_template, render_after_assistant

__all__ = ["OpenAIAgentLoop", "check_prompt_tools", "endpoint", "load_agent_function"]

logger = logging.getLogger(__name__)

_ENDPOINTS: dict[tuple[str, int], OpenAIEndpoint] = {}
_ENDPOINTS_LOCK = threading.Lock()
_SENTINEL = "\x00rlfoundry-assistant\x00"  # stands for an assistant turn's text when finding what follows it
# why a conversation may not continue the data set's prompt, and the keys that fix it (400s and start-up)
PROMPT_NOT_CONTINUED = (
    "; this conversation does not start with the data set's prompt, so all of its context counts against the "
    "response budget. An agent that offers tools needs the data set's prompts rendered with the same tools: set "
    "actor_rollout_ref.rollout.multi_turn.tool_config_path to a tool config of them")


def endpoint(host: str = "127.0.0.1", port: int = 0, advertise: str | None = None) -> OpenAIEndpoint:
    """The process's endpoint on ``host:port``, started on first use (one secret per run); agents are
    given ``advertise`` as its host (see ``advertised_host``)."""
    with _ENDPOINTS_LOCK:
        if (host, int(port)) not in _ENDPOINTS:
            _ENDPOINTS[(host, int(port))] = OpenAIEndpoint(host, port, advertised_host(host, advertise))
        return _ENDPOINTS[(host, int(port))]


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The name an agent reaches the endpoint by: ``advertise`` if given; for a wildcard bind (``0.0.0.0``,
    ``::``), which is no address to connect to, this node's address as Ray reports it (the one other nodes
    reach it by), else the address of the interface that routes outwards; otherwise ``host`` itself."""
    if advertise:
        return advertise
    if host not in ("0.0.0.0", "::", ""):
        return host
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:  # no packet is sent: only a route lookup
        try:
            probe.connect(("10.255.255.255", 1))
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


@functools.lru_cache(maxsize=None)
def load_agent_function(path: str | None, name: str) -> Callable:
    """``name`` from a ``.py`` file or a dotted module; AgentLoopError naming the key otherwise."""
    where = "actor_rollout_ref.rollout.agent.openai"
    if not path:
        raise AgentLoopError(f"agent_name openai_agent needs {where}.path (a .py file or a dotted module that "
                             f"defines {name}(base_url, api_key, prompt, extra_info))")
    try:
        if path.endswith(".py"):
            file = Path(path).expanduser()
            spec = importlib.util.spec_from_file_location(f"rlfoundry_user_agent_{file.stem}", file)
            if spec is None or not file.is_file():
                raise FileNotFoundError(f"no file {file}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(path)
    except Exception as e:  # noqa: BLE001 - any failure to import the user's code is a config error
        raise AgentLoopError(f"{where}.path={path!r} cannot be loaded ({type(e).__name__}: {e})") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise AgentLoopError(f"{where}.name={name!r}: {path} defines no function of that name")
    return fn


def check_prompt_tools(fn: Callable, tokenizer: Any, chat_template_kwargs: dict, where: str) -> None:
    """Start-up check: an agent whose module declares the tools it offers (``TOOLS``, OpenAI's list) must find
    the data set's prompts rendered with them (``chat_template_kwargs["tools"]``, from
    ``multi_turn.tool_config_path``); else its first request renders a prompt the row's does not start,
    and the whole prompt is charged to the response budget (400 ``context_length_exceeded``)."""
    offered = fn.__globals__.get("TOOLS")
    if not isinstance(offered, list):
        return  # the agent does not say: the endpoint's 400 names the keys if it happens
    chat = [{"role": "user", "content": "?"}]
    kwargs = {k: v for k, v in chat_template_kwargs.items() if k != "tools"}
    rendered = apply_template(tokenizer, {**kwargs, "tools": offered or None}, chat, True)
    if rendered != apply_template(tokenizer, {**kwargs, "tools": chat_template_kwargs.get("tools") or None}, chat, True):
        names = sorted(str((t.get("function") or {}).get("name")) for t in offered if isinstance(t, dict))
        given = sorted(str(t["function"]["name"]) for t in chat_template_kwargs.get("tools") or ())
        raise AgentLoopError(
            f"{where}: the agent offers the tools {names} (its TOOLS), but the data set's prompts are rendered with "
            f"{given or 'no tools'}: its first request would not continue the data set's prompt, the whole prompt "
            "would count against data.max_response_length and requests fail with 400 context_length_exceeded. Set "
            "actor_rollout_ref.rollout.multi_turn.tool_config_path to a tool config of the same tools (the same "
            "names, descriptions and parameters; e.g. rlfoundry://config/tools/calculator.yaml for the calculator)")


# ---- recording: conversations as tokens --------------------------------------------------------


def _canon(message: dict) -> tuple:
    """What decides whether two messages are the same turn: role, text, tool calls (ids ignored)."""
    calls = tuple((c["function"]["name"], _json(c["function"]["arguments"])) for c in message.get("tool_calls") or ())
    return message["role"], message.get("content") or "", calls


def _json(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True)
    except (TypeError, json.JSONDecodeError):
        return text


def _renderable(messages: list[dict]) -> list[dict]:
    return [{**m, "content": m.get("content") or ""} for m in messages]


@dataclass
class _Segment:
    ids: list[int]  # the context and every turn since: prompt, sampled and rendered tokens
    mask: list[int]  # aligned with ids: 1 on sampled tokens
    log_probs: list[float]
    tools: list | None
    history: list[tuple] = field(default_factory=list)  # canonical messages the next request must start with
    chat: list[dict] = field(default_factory=list)  # the chat with sampled texts (for the sanity check)
    ended: bool = True  # the last turn ended with an end-of-turn token
    last_turn_start: int = 0  # index in ids
    turns: int = 0  # assistant replies
    user_turns: int = 0  # extensions: the tool or user messages appended between two replies
    busy: bool = False  # a request is generating on it
    touched: int = 0  # order of the last update
    text: str | None = None  # a text completion's context as the agent knows it (None: a chat segment)
    spans: list[tuple[str, int, int]] = field(default_factory=list)  # (role, start, end) of each turn in ids
    tool_results: list[dict[str, Any]] = field(default_factory=list)  # the tool messages appended

    def fork(self) -> _Segment:
        return _Segment(list(self.ids), list(self.mask), list(self.log_probs), self.tools, list(self.history),
                        list(self.chat), self.ended, self.last_turn_start, self.turns, self.user_turns, text=self.text,
                        spans=list(self.spans), tool_results=list(self.tool_results))

    def extend(self, ids: list[int]) -> None:
        """Tokens the policy did not sample (rendered messages, the agent's text): context, masked."""
        self.ids += ids
        self.mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.user_turns += 1


class _Recorder:
    """One trajectory's session: answers its requests through the engine and keeps its segments."""

    def __init__(self, loop: OpenAIAgentLoop, prompt_ids: list[int]):
        self.loop, self.tok, self.prompt_ids = loop, loop.tokenizer, prompt_ids
        self.segments: list[_Segment] = []
        self.clock = 0
        eos = loop.server.eos_ids or {self.tok.eos_token_id}
        self.eos = set(eos)

    async def complete(self, request: ChatRequest | CompletionRequest) -> dict[str, Any]:
        self._check_sampling(request)
        text_api = isinstance(request, CompletionRequest)
        bases = self._text_bases(request) if text_api else self._bases(request)
        rooms = [self._room(s) for s in bases]
        for s in bases:
            s.busy = True
        seeds = [None if request.seed is None else (request.seed % 2**64, j) for j in range(len(bases))]
        try:  # shielded: a request cut off at its deadline must not cancel the engine's batch entry
            turns = await asyncio.gather(*(asyncio.shield(self.loop.server.generate(
                self.loop.key, s.ids, min(room, request.max_tokens or room), seed=seed,
                top_logprobs=request.top_logprobs)) for s, room, seed in zip(bases, rooms, seeds)))
        finally:
            for s in bases:
                s.busy = False
        prompt_tokens = len(bases[0].ids)
        choices = [self._record(s, request, t, i) for i, (s, t) in enumerate(zip(bases, turns))]
        completion = sum(c.pop("_count") for c in choices)
        return {"id": f"{'cmpl' if text_api else 'chatcmpl'}-{uuid.uuid4().hex}",
                "object": "text_completion" if text_api else "chat.completion", "created": int(time.time()),
                "model": request.model, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
                          "total_tokens": prompt_tokens + completion}}

    def _check_sampling(self, request: ChatRequest | CompletionRequest) -> None:
        """A seed or top log-probs the engine cannot give: a 400 naming the parameter, not a silent default."""
        server, engine = self.loop.server, type(self.loop.server.engine).__name__
        if request.seed is not None and not server.seeds_requests:
            raise RequestError(400, f"seed is not supported on this rollout engine ({engine}): it draws per engine "
                               "call, so a request cannot have a stream of its own (the HF and vLLM engines can)",
                               "seed", "unsupported_value")
        if request.top_logprobs and not server.serves_top_logprobs:
            raise RequestError(400, f"{'top_logprobs' if isinstance(request, ChatRequest) else 'logprobs'} > 0 is not "
                               f"supported on this rollout engine ({engine}), which returns the sampled tokens' "
                               "log-probs only: ask for logprobs without alternatives (the HF engine gives them)",
                               "top_logprobs" if isinstance(request, ChatRequest) else "logprobs", "unsupported_value")

    # ---- matching ----------------------------------------------------------------------------

    def _bases(self, request: ChatRequest) -> list[_Segment]:
        """One segment per choice, its ids the context to sample from: the extended segment for the
        first choice when the request extends one, copies (forks) or fresh renders for the rest."""
        canon = [_canon(m) for m in request.messages]
        extended = self._extends(request, canon)
        if extended is not None:
            delta = request.messages[len(extended.history):]
            ids = self._after_turn(extended, request, delta)
            self._check_room(extended, len(ids))  # before the segment changes: a refused request leaves it as it was
            extended.spans.append((delta[0]["role"], len(extended.ids), len(extended.ids) + len(ids)))
            extended.tool_results += _tool_results(request.messages[:len(extended.history)], delta)
            extended.extend(ids)
            extended.history, extended.chat = canon, extended.chat + delta
            first = extended
        else:
            first = self._fresh(request, canon)
        return self._forked(first, request.n)

    def _forked(self, first: _Segment, n: int) -> list[_Segment]:
        forks = [first.fork() for _ in range(n - 1)]
        self.segments += forks
        return [first, *forks]

    def _text_bases(self, request: CompletionRequest) -> list[_Segment]:
        """A text completion's segments: the most recent one whose context the prompt starts with (its text
        with every sampled token's text, special tokens included, or its ids for a prompt of ids) continues, the
        rest of the prompt tokenised on its own; else a new segment from the prompt's own tokens."""
        prompt = request.prompt
        for s in sorted(self.segments, key=lambda s: -s.touched):
            if s.text is None or s.busy or not s.turns:
                continue
            if isinstance(prompt, list) and prompt[:len(s.ids)] == s.ids:
                ids = prompt[len(s.ids):]
                rest = self.tok.decode(ids)
            elif isinstance(prompt, str) and prompt.startswith(s.text):
                rest = prompt[len(s.text):]
                ids = self.tok.encode(rest, add_special_tokens=False) if rest else []
            else:
                continue
            self._check_room(s, len(ids), "prompt")
            if ids:
                s.extend(ids)
            s.text += rest
            return self._forked(s, request.n)
        ids = list(prompt) if isinstance(prompt, list) else self.tok.encode(prompt)  # BOS as vLLM adds it
        text = self.tok.decode(ids) if isinstance(prompt, list) else prompt
        segment = _Segment(ids, [0] * len(ids), [0.0] * len(ids), None, [], [], text=text)
        self._check_room(segment, 0, "prompt")
        self.segments.append(segment)
        return self._forked(segment, request.n)

    def _extends(self, request: ChatRequest, canon: list[tuple]) -> _Segment | None:
        for s in sorted(self.segments, key=lambda s: -s.touched):  # the most recent conversation first
            n = len(s.history)
            if (s.text is None and not s.busy and s.turns and s.tools == request.tools and len(canon) > n
                    and canon[:n] == s.history
                    and all(m["role"] in ("tool", "user") for m in request.messages[n:])):
                return s
        return None

    def _fresh(self, request: ChatRequest, canon: list[tuple]) -> _Segment:
        text = apply_template(self.tok, self._template_kwargs(request), _renderable(request.messages), True)
        ids = self.tok.encode(text, add_special_tokens=False)
        segment = _Segment(ids, [0] * len(ids), [0.0] * len(ids), request.tools, canon, list(request.messages),
                           spans=[("context", 0, len(ids))])
        self._check_room(segment, 0)
        self.segments.append(segment)
        return segment

    def _after_turn(self, s: _Segment, request: ChatRequest, delta: list[dict]) -> list[int]:
        """The tokens after a segment's last turn: the template's end of that turn where the policy did
        not sample it (a cut or a stop string), the new messages, the next generation prompt."""
        kwargs = self._template_kwargs(request)
        if s.ended:  # the tool agent loop's rendering, token for token
            return render_after_assistant(self.tok, kwargs, _renderable(delta), s.ids[-1])
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _SENTINEL}]
        before = apply_template(self.tok, kwargs, base, False)
        full = apply_template(self.tok, kwargs, base + _renderable(delta), True)
        return self.tok.encode(before[before.rfind(_SENTINEL) + len(_SENTINEL):] + full[len(before):],
                               add_special_tokens=False)

    def _template_kwargs(self, request: ChatRequest) -> dict:
        kwargs = {k: v for k, v in self.loop.chat_template_kwargs.items() if k != "tools"}
        return {**kwargs, "tools": request.tools} if request.tools else kwargs

    def _split(self, s: _Segment) -> int:
        """Where a segment's row starts its response: after the data set's prompt when it starts with it."""
        n = len(self.prompt_ids)
        return n if n and s.ids[:n] == self.prompt_ids else 0

    def _room(self, s: _Segment) -> int:
        return self.loop.response_length - (len(s.ids) - self._split(s))

    def _check_room(self, s: _Segment, more: int, param: str = "messages") -> None:
        """A request whose context (``more`` tokens added to ``s``) leaves nothing to sample within the
        trajectory's budget is OpenAI's ``context_length_exceeded``; the recorded segments stay within it."""
        if self._room(s) - more <= 0:
            raise RequestError(400, f"the conversation leaves no room in this trajectory's budget of "
                               f"{self.loop.response_length} tokens (data.max_response_length)"
                               + (PROMPT_NOT_CONTINUED if self.prompt_ids and not self._split(s) else ""),
                               param, "context_length_exceeded")

    # ---- recording a reply ----------------------------------------------------------------------------

    def _record(self, s: _Segment, request: ChatRequest | CompletionRequest, turn: Generated, index: int) -> dict:
        ids, log_probs, top, stopped = self._cut_at_stop(turn.token_ids, turn.log_probs, turn.top, request.stop)
        ended = bool(ids) and ids[-1] in self.eos
        full = self.tok.decode(ids, skip_special_tokens=True)
        text = full if stopped is None else full[:stopped]
        s.last_turn_start = len(s.ids)
        s.spans.append(("assistant", len(s.ids), len(s.ids) + len(ids)))
        s.ids, s.mask, s.log_probs = s.ids + ids, s.mask + [1] * len(ids), s.log_probs + list(log_probs)
        s.ended, s.turns = ended, s.turns + 1
        self.clock += 1
        s.touched = self.clock
        finish = "stop" if ended or stopped is not None else "length"
        pieces = self._pieces(ids, text) if request.stream or (request.logprobs and s.text is not None) else None
        if s.text is not None:  # a text completion: a prompt continues it by starting with every sampled token's
            s.text += self.tok.decode(ids)  # text, special ones (an end of turn) included
            logprobs = self._text_logprobs(ids, log_probs, top, pieces, request) if request.logprobs else None
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "_count": len(ids),
                    "_pieces": pieces}
        message, parsed = self._message(text, None if request.tool_choice == "none" else request.tools)
        s.history = s.history + [_canon(message)]
        s.chat = s.chat + [{"role": "assistant", "content": text}]
        logprobs = {"content": [self._entry(i, lp, top and top[k], request) for k, (i, lp) in
                                enumerate(zip(ids, log_probs))]} if request.logprobs else None
        return {"index": index, "message": message, "finish_reason": parsed if finish == "stop" else finish,
                "logprobs": logprobs, "_count": len(ids), "_pieces": pieces}

    # ---- what the client sees of the tokens -----------------------------------------------------------

    def _token(self, token_id: int, request: ChatRequest | CompletionRequest) -> tuple[str, list[int]]:
        """A token as the API names it (``token_id:<id>`` with vLLM's ``return_tokens_as_token_ids``) and its bytes."""
        text = self.tok.decode([token_id])
        return (f"token_id:{token_id}" if request.tokens_as_ids else text), list(text.encode())

    def _entry(self, token_id: int, log_prob: float, top: list | None, request: ChatRequest) -> dict:
        """A chat token's log-prob entry: the trained log-prob; its alternatives from the same engine step
        (the sampled token among them carries the trained value)."""
        token, raw = self._token(token_id, request)
        alternatives = []
        for other, value in top or []:
            name, other_raw = self._token(other, request)
            alternatives.append({"token": name, "logprob": log_prob if other == token_id else value,
                                 "bytes": other_raw})
        return {"token": token, "logprob": log_prob, "bytes": raw, "top_logprobs": alternatives}

    def _text_logprobs(self, ids: list[int], log_probs: list[float], top: list | None, pieces: list[str],
                       request: CompletionRequest) -> dict:
        offsets, at = [], 0
        for piece in pieces:
            offsets.append(at)
            at += len(piece)
        tops = None
        if request.top_logprobs:
            tops = [{self._token(o, request)[0]: (lp if o == i else v) for o, v in (top[k] if top else [])}
                    for k, (i, lp) in enumerate(zip(ids, log_probs))]
        return {"tokens": [self._token(i, request)[0] for i in ids], "token_logprobs": list(log_probs),
                "top_logprobs": tops, "text_offset": offsets}

    def _pieces(self, ids: list[int], text: str) -> list[str]:
        """``text`` split by sampled token (what a stream sends with each): each token's new characters,
        decoded incrementally as a streaming server does (a character split over tokens comes with its
        last one), cut where ``text`` ends (a stop string); if the pieces do not add up to ``text`` (a
        tokenizer whose decoding is not incremental), the whole text comes with the first token."""
        pieces, prefix, read = [], 0, 0
        for k in range(1, len(ids) + 1):
            before = self.tok.decode(ids[prefix:read], skip_special_tokens=True)
            now = self.tok.decode(ids[prefix:k], skip_special_tokens=True)
            if len(now) > len(before) and not now.endswith("\ufffd") and now.startswith(before):
                pieces.append(now[len(before):])
                prefix, read = read, k
            else:
                pieces.append("")
        shown, cut = 0, []
        for piece in pieces:
            cut.append(piece[:max(0, len(text) - shown)])
            shown += len(cut[-1])
        if "".join(cut) != text:
            return [text] + [""] * (len(ids) - 1) if ids else []
        return cut

    def _message(self, text: str, tools: list[dict] | None) -> tuple[dict, str]:
        # tools None: none offered, or tool_choice "none" (the text is not read for calls)
        """OpenAI's assistant message: the calls (in ``multi_turn.format``) as ``tool_calls`` when tools were
        offered and every call parses (else the text as content, as vLLM's tool parsers do)."""
        types = {t["function"]["name"]: _argument_types(t["function"]) for t in tools or []}
        parsed = parse_tool_calls(self.loop.config.format, text, types) if tools else None
        if not parsed or not parsed.calls or parsed.errors:
            return {"role": "assistant", "content": text}, "stop"
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
        return {"role": "assistant", "content": parsed.content or None, "tool_calls": calls}, "tool_calls"

    def _cut_at_stop(self, ids: list[int], log_probs: list[float], top: list | None,
                     stop: list[str]) -> tuple[list, list, list | None, int | None]:
        """The ids (log-probs, alternatives) up to the token that completes the first stop string, and where
        the text stops."""
        if not stop:
            return ids, log_probs, top, None
        for k in range(1, len(ids) + 1):
            text = self.tok.decode(ids[:k], skip_special_tokens=True)
            found = [i for i in (text.find(s) for s in stop) if i >= 0]
            if found:
                return ids[:k], log_probs[:k], top and top[:k], min(found)
        return ids, log_probs, top, None

    # ---- the trajectory's rows ------------------------------------------------------------------------

    def outputs(self, stop_reason: str, max_segments: int) -> list[AgentLoopOutput]:
        """``max_segments`` rows: the most recent segments, then empty ones (see the module docstring)."""
        kept = sorted((s for s in self.segments if s.turns), key=lambda s: s.touched)[-max_segments:] \
            if stop_reason == "agent_done" else []
        dropped = sum(1 for s in self.segments if s.turns) - len(kept)
        rows = [self._row(s, stop_reason, dropped) for s in kept]
        while len(rows) < max_segments:
            rows.append(AgentLoopOutput(list(self.prompt_ids), [], [], [], num_turns=0, extra_fields={
                "stop_reason": stop_reason if not rows else "segment_padding", "excluded": True,
                "last_turn_start": 0, "segment": len(rows), "segments_dropped": dropped, "turns": [],
                "tool_results": []}))
        return rows

    def _row(self, s: _Segment, stop_reason: str, dropped: int) -> AgentLoopOutput:
        split = self._split(s)
        kwargs = self._template_kwargs(ChatRequest(messages=[], tools=s.tools))
        return AgentLoopOutput(
            prompt_ids=s.ids[:split], response_ids=s.ids[split:], response_mask=s.mask[split:],
            response_logprobs=s.log_probs[split:], num_turns=s.turns + s.user_turns, messages=_renderable(s.chat),
            cut_by_length=not s.ended, chat_template_kwargs=kwargs,
            extra_fields={"stop_reason": stop_reason, "excluded": False, "last_turn_start": s.last_turn_start - split,
                          "segment": None, "segments_dropped": dropped, "tool_results": list(s.tool_results),
                          "turns": [[role, max(0, a - split), b - split] for role, a, b in s.spans if b > split]})


@register("openai_agent")
class OpenAIAgentLoop(AgentLoopBase):
    """See the module docstring."""

    async def run(self, sampling_params: dict[str, Any], **row: Any) -> list[AgentLoopOutput]:
        if FORMATS[self.config.format].special_tokens:
            raise AgentLoopError(f"rollout.multi_turn.format={self.config.format} writes its calls in special "
                                 "tokens, which the OpenAI endpoint does not read (it answers from the text): "
                                 "use the tool_agent loop for it")
        settings = self.agent.openai
        fn = load_agent_function(settings.path, settings.name)
        recorder = _Recorder(self, list(row["prompt_ids"]))
        server = endpoint(settings.host, settings.port, settings.advertise_host)
        sid, base_url = server.open(recorder.complete, asyncio.get_running_loop(), settings.timeout_s)
        extra = row.get("extra_info") if isinstance(row.get("extra_info"), dict) else {}
        kwargs = {"base_url": base_url, "api_key": server.api_key, "prompt": list(row.get("raw_prompt") or []),
                  "extra_info": dict(extra)}
        answer, stop_reason = None, "agent_done"
        try:
            answer = await _in_thread(functools.partial(_call, fn, kwargs), settings.timeout_s)
        except TimeoutError:
            stop_reason = "agent_timeout"
        except Exception as e:  # noqa: BLE001 - the user's agent failing costs its sample, not the run
            stop_reason = "agent_raised"
            logger.warning("openai_agent: %s.%s raised %s: %s", settings.path, settings.name, type(e).__name__, e)
        finally:
            requests = server.close(sid)
        if stop_reason == "agent_done" and not requests:
            stop_reason = "agent_no_requests"
        if stop_reason != "agent_done":
            logger.warning("openai_agent: sample lost (%s)", stop_reason)
        rows = recorder.outputs(stop_reason, max(1, int(settings.max_segments)))
        inputs = answer if isinstance(answer, dict) else {"answer": answer} if answer is not None else {}
        for out in rows:
            out.extra_fields["extra_info"] = {**extra, **inputs} if inputs else None
        return rows


def _tool_results(history: list[dict], delta: list[dict]) -> list[dict[str, Any]]:
    """The tool messages of ``delta`` as ``{tool, text, error}``, each named by the call it answers (its
    ``tool_call_id`` among the history's calls; else its own ``name``, else None)."""
    names = {c.get("id"): c.get("function", {}).get("name") for m in history for c in m.get("tool_calls") or ()
             if isinstance(c, dict)}
    return [{"tool": names.get(m.get("tool_call_id")) or m.get("name"), "text": m.get("content"), "error": None}
            for m in delta if m["role"] == "tool"]


def _argument_types(function: dict) -> dict[str, Any]:
    """An OpenAI function's ``{argument: JSON type}`` (what qwen3_coder's values are typed by); a request's
    schema is the agent's JSON, so anything malformed in it just gives no type."""
    parameters = function.get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    if not isinstance(properties, dict):
        return {}
    return {k: p.get("type") if isinstance(p, dict) else None for k, p in properties.items()}


async def _call(fn: Callable, kwargs: dict) -> Any:
    """The user's function on its own thread and event loop (``_in_thread``): a blocking agent cannot
    stall the engine's loop, and a hung one is abandoned at the deadline."""
    value = fn(**kwargs)
    return await value if inspect.isawaitable(value) else value
