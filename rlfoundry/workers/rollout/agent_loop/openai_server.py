"""An OpenAI-compatible chat endpoint over the rollout engine, for agents the framework does not own.

``POST /s/<session>/v1/chat/completions`` and ``GET /s/<session>/v1/models``: each trajectory of an
``openai_agent`` row gets a session (its ``base_url`` is ``http://<host>:<port>/s/<session>/v1``), so
the endpoint knows whose conversation a request continues; every request carries the run's secret as
``Authorization: Bearer <api_key>`` (the ``api_key`` an OpenAI client is made with). The server is the
standard library's threading HTTP server on loopback (``rollout.agent.openai.host`` for an agent that
runs elsewhere); a request is handed to its session's handler on the agent loop's event loop, where it
joins the other trajectories' engine calls (``server.py``).

Errors have OpenAI's body, ``{"error": {"message", "type", "param", "code"}}``, and status: 400 for a
malformed request, 401 for a missing or wrong key, 404 for an unknown path or session, 403 once the
session is closed or past its deadline (not retried by OpenAI clients, which retry 408, 409, 429, 5xx).
An unknown model name is a 404 listing the served names (``policy`` and ``rlfoundry-policy``), as vLLM answers.

``POST /s/<session>/v1/completions`` is the text-completion API (a prompt as text or token ids). With
``stream: true`` either answer comes as server-sent events (``chat.completion.chunk`` / ``text_completion``
chunks, one per sampled token, then ``data: [DONE]``; a last chunk with ``usage`` when
``stream_options.include_usage``): the turn is generated whole, batched with the other trajectories' turns,
then sent, so the streamed tokens are the recorded ones. Parameters the endpoint cannot honour are refused
with a 400 naming them (``tool_choice`` other than auto/none, ``response_format`` other than text: they need
constrained decoding, whose samples are not what the trainer scores; ``echo``, ``suffix``, ``best_of``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Awaitable, Callable

from rlfoundry.utils.http import send_json

__all__ = ["ChatRequest", "CompletionRequest", "MODEL_IDS", "OpenAIEndpoint", "RequestError", "parse_chat_request",
           "parse_completion_request"]

logger = logging.getLogger(__name__)

MODEL_ID = "rlfoundry-policy"
MODEL_IDS = ("policy", MODEL_ID)  # the names served (/v1/models); any other is a 404, as vLLM answers
_MAX_TOP_LOGPROBS = 20  # OpenAI's limit for chat (vLLM's default cap too)
_MAX_BODY = 64 * 1024 * 1024
_ROLES = ("system", "user", "assistant", "tool", "developer")


class RequestError(Exception):
    """An OpenAI-style error: HTTP ``status`` and the body's ``type``, ``param`` and ``code``."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class _Sampling:
    """What both APIs share: how many choices, the sampling fields, logprobs and streaming."""

    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    model: str = MODEL_ID
    seed: int | None = None
    logprobs: bool = False  # each sampled token's log-prob (the rollout log-prob the trainer records)
    top_logprobs: int = 0  # and the k most likely tokens at each step
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprob tokens as "token_id:<id>"


@dataclass
class ChatRequest(_Sampling):
    """A validated ``/v1/chat/completions`` body (the fields the endpoint acts on)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str = "auto"  # or "none": the reply's text is not read for calls


@dataclass
class CompletionRequest(_Sampling):
    """A validated ``/v1/completions`` body: one prompt, as text or token ids."""

    prompt: str | list[int] = ""


def _bad(message: str, param: str, code: str = "invalid_value") -> RequestError:
    return RequestError(400, message, param, code)


def _number(body: dict, key: str, low: float, high: float, integer: bool = False) -> Any:
    value = body.get(key)
    if value is None:
        return None
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not low <= value <= high:
        raise _bad(f"{key} must be {'an integer' if integer else 'a number'} in [{low}, {high}], got {value!r}", key)
    return value


def _message(i: int, m: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict) or m.get("role") not in _ROLES:
        raise _bad(f"{where} must be an object with a role in {list(_ROLES)}", where)
    content = m.get("content")
    if isinstance(content, list):  # content parts: only text is meaningful to a text policy
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            raise _bad(f"{where}.content: only text parts are supported", f"{where}.content")
        content = "".join(p["text"] for p in content)
    if content is None and not (m["role"] == "assistant" and m.get("tool_calls")):
        raise _bad(f"{where}.content is required for a {m['role']} message", f"{where}.content")
    if content is not None and not isinstance(content, str):
        raise _bad(f"{where}.content must be a string or a list of text parts", f"{where}.content")
    calls = m.get("tool_calls") or []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(fn.get("arguments"), str)):
            raise _bad(f"{where}.tool_calls[{j}] must have function.name and function.arguments (a JSON string)",
                       f"{where}.tool_calls")
    return {**m, "content": content}


def _flag(body: dict, key: str) -> bool:
    value = body.get(key)
    if value is not None and not isinstance(value, bool):
        raise _bad(f"{key} must be true or false, got {value!r}", key)
    return bool(value)


def _model(body: dict) -> str:
    model = body.get("model")
    if model is None:
        return MODEL_ID
    if model not in MODEL_IDS:
        raise RequestError(404, f"The model {model!r} does not exist: this endpoint serves {list(MODEL_IDS)} "
                           "(both are the policy being trained)", "model", "model_not_found", "not_found_error")
    return model


def _sampling(body: dict, max_tokens_default: int | None) -> dict[str, Any]:
    """The shared fields, checked; ``logprobs`` / ``top_logprobs`` are left to each API (they differ)."""
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop must be a string or a list of at most 4 non-empty strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    stream, options = _flag(body, "stream"), body.get("stream_options")
    if options is not None and not stream:
        raise _bad("stream_options is only allowed when stream is true", "stream_options")
    if options is not None and not (isinstance(options, dict) and isinstance(options.get("include_usage", False), bool)):
        raise _bad("stream_options must be an object whose include_usage is true or false", "stream_options")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise _bad(f"seed must be an integer, got {seed!r}", "seed")
    return {"n": _number(body, "n", 1, 128, integer=True) or 1, "temperature": _number(body, "temperature", 0, 2),
            "top_p": _number(body, "top_p", 0, 1),
            "max_tokens": _number({"max_tokens": max_tokens}, "max_tokens", 1, 1 << 30, integer=True) or max_tokens_default,
            "stop": stop, "model": _model(body), "seed": seed, "stream": stream,
            "include_usage": bool((options or {}).get("include_usage")),
            "tokens_as_ids": _flag(body, "return_tokens_as_token_ids")}


def _unsupported(param: str, message: str) -> RequestError:
    return _bad(message, param, "unsupported_value")


def _tool_choice(body: dict) -> str:
    """auto (the policy's calls are read from its text) or none (not read); forcing a call is refused."""
    choice = body.get("tool_choice")
    if choice is None or choice in ("auto", "none"):
        return choice or "auto"
    if choice == "required" or isinstance(choice, dict):
        raise _unsupported("tool_choice", f"tool_choice={json.dumps(choice)} is not supported: forcing a call needs "
                           "constrained decoding, and a constrained sample is not what the trainer scores; this "
                           "endpoint supports tool_choice 'auto' (the policy's calls are parsed) and 'none'")
    raise _bad(f"tool_choice must be 'auto', 'none', 'required' or a named function, got {choice!r}", "tool_choice")


def _response_format(body: dict) -> None:
    fmt = body.get("response_format")
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if fmt is None or kind == "text":
        return
    if kind in ("json_object", "json_schema"):
        raise _unsupported("response_format", f"response_format type {kind!r} is not supported: it needs constrained "
                           "decoding, and a constrained sample is not what the trainer scores; this endpoint "
                           "supports response_format {'type': 'text'} (ask for JSON in the prompt instead)")
    raise _bad(f"response_format must be {{'type': 'text' | 'json_object' | 'json_schema'}}, got {fmt!r}",
               "response_format")


def parse_chat_request(body: Any) -> ChatRequest:
    """The request, or a :class:`RequestError` naming the first bad field."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_json")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages must be a non-empty list", "messages", "missing_required_parameter")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and "name" in t["function"] for t in tools)):
        raise _bad("tools must be a list of {type: function, function: {name, parameters}}", "tools")
    logprobs = _flag(body, "logprobs")
    top = _number(body, "top_logprobs", 0, _MAX_TOP_LOGPROBS, integer=True) or 0
    if top and not logprobs:
        raise _bad("top_logprobs needs logprobs: true", "top_logprobs")
    _response_format(body)
    return ChatRequest(messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools or None,
                       tool_choice=_tool_choice(body), logprobs=logprobs, top_logprobs=top,
                       **_sampling(body, None))


def parse_completion_request(body: Any) -> CompletionRequest:
    """A ``/v1/completions`` request (one prompt: a string, or token ids), or a :class:`RequestError`."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object", "body", "invalid_json")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one prompt
    is_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_ids:
        raise _bad("prompt must be one non-empty string or one list of token ids (one prompt per request)", "prompt")
    for key, default in (("echo", False), ("suffix", None), ("best_of", None)):
        if body.get(key) not in (default, None) and not (key == "best_of" and body[key] == body.get("n", 1)):
            raise _unsupported(key, f"{key} is not supported by this endpoint")
    logprobs = _number(body, "logprobs", 0, _MAX_TOP_LOGPROBS, integer=True)
    return CompletionRequest(prompt=prompt, logprobs=logprobs is not None, top_logprobs=logprobs or 0,
                             **_sampling(body, 16))  # OpenAI's (and vLLM's) default max_tokens for completions


Handler = Callable[["ChatRequest | CompletionRequest"], Awaitable[dict[str, Any]]]


@dataclass
class _Session:
    handler: Handler
    loop: asyncio.AbstractEventLoop
    deadline: float  # time.monotonic() after which requests are refused
    closed: bool = False
    requests: int = 0
    inflight: set = field(default_factory=set)  # concurrent futures of requests being answered


class OpenAIEndpoint:
    """The HTTP server, its secret and its sessions. Start once per worker; sessions come and go.

    Args: ``host`` and ``port`` to bind (port 0: any free one), ``advertise`` the host name the agents
    are given (default: ``host``)."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, advertise: str | None = None):
        self.api_key = "rlf-" + secrets.token_urlsafe(24)  # per run: a new endpoint, a new secret
        self._sessions: dict[str, _Session] = {}
        self._lock = threading.Lock()
        self._httpd = _Server((host, int(port)), _handler_class(self))
        self.host, self.port = advertise or host, self._httpd.server_address[1]
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True, name="rlfoundry-openai-endpoint")
        self._thread.start()

    def open(self, handler: Handler, loop: asyncio.AbstractEventLoop, timeout_s: float) -> tuple[str, str]:
        """A new session answered by ``handler`` on ``loop`` until ``timeout_s`` from now; returns
        ``(session id, base_url)``."""
        sid = secrets.token_urlsafe(12)
        with self._lock:
            self._sessions[sid] = _Session(handler, loop, time.monotonic() + float(timeout_s))
        return sid, f"http://{self.host}:{self.port}/s/{sid}/v1"

    def close(self, sid: str) -> int:
        """Refuse the session's later requests and fail those still waiting; returns its request count."""
        with self._lock:
            session = self._sessions.pop(sid, None)
            if session is None:
                return 0
            session.closed = True  # under the lock: a request admitted after this sees it (_admit)
            waiting = list(session.inflight)
        for future in waiting:
            future.cancel()
        return session.requests

    def shutdown(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    # ---- called from the HTTP threads ----------------------------------------------------------

    def answer(self, method: str, path: str, auth: str | None, raw: bytes | None) -> tuple[int, dict | list[str]]:
        """The status and the reply: a JSON body, or a stream's server-sent events (a list of ``data:`` lines)."""
        try:
            return 200, self._answer(method, path, auth, raw)
        except RequestError as e:
            return e.status, e.body()
        except Exception as e:  # noqa: BLE001 - the agent gets a 500 with the reason, the run goes on
            logger.warning("openai endpoint: %s %s failed: %s: %s", method, path, type(e).__name__, e)
            return 500, RequestError(500, f"{type(e).__name__}: {e}", type_="server_error").body()

    def _answer(self, method: str, path: str, auth: str | None, raw: bytes | None) -> dict | list[str]:
        parts = path.split("?", 1)[0].strip("/").split("/")
        if len(parts) < 3 or parts[0] != "s" or parts[2] != "v1":
            raise RequestError(404, f"unknown path {path!r}: use the base_url the agent was given "
                               "(http://host:port/s/<session>/v1)", code="unknown_url", type_="not_found_error")
        if not auth or not secrets.compare_digest(auth.encode(), f"Bearer {self.api_key}".encode()):
            raise RequestError(401, "missing or wrong API key: send the api_key the agent was given as "
                               "'Authorization: Bearer <api_key>'", code="invalid_api_key", type_="authentication_error")
        route = "/".join(parts[3:])
        session = self._session(parts[1])
        if method == "GET" and route == "models":
            return {"object": "list", "data": [_model_card(m) for m in MODEL_IDS]}
        if method == "GET" and route.startswith("models/"):
            return _model_card(_model({"model": route.split("/", 1)[1]}))
        parse = {"chat/completions": parse_chat_request, "completions": parse_completion_request}.get(route)
        if method != "POST" or parse is None:
            raise RequestError(404, f"{method} /v1/{route} is not served: POST /v1/chat/completions, POST "
                               "/v1/completions, GET /v1/models", code="unknown_url", type_="not_found_error")
        try:
            body = json.loads(raw or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON ({e})", "body", "invalid_json") from e
        request = parse(body)
        result = self._complete(session, request)
        if request.stream:
            return stream_events(result, request.include_usage)
        for choice in result["choices"]:
            choice.pop("_pieces", None)
        return result

    def _session(self, sid: str) -> _Session:
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.closed:
            raise RequestError(403, "this session is closed: its trajectory has finished or was cut off",
                               code="session_closed", type_="permission_denied_error")
        if time.monotonic() > session.deadline:
            raise RequestError(403, "the trajectory's deadline has passed (rollout.agent.openai.timeout_s)",
                               code="deadline_exceeded", type_="permission_denied_error")
        return session

    def _admit(self, session: _Session, request: ChatRequest | CompletionRequest) -> concurrent.futures.Future:
        """Count and start the request unless its session closed meanwhile (the check and the start
        under the lock that ``close`` takes, so no completion runs for a finished trajectory)."""
        with self._lock:
            if session.closed:
                raise RequestError(403, "this session is closed: its trajectory has finished or was cut off",
                                   code="session_closed", type_="permission_denied_error")
            session.requests += 1
            future = asyncio.run_coroutine_threadsafe(session.handler(request), session.loop)
            session.inflight.add(future)
        return future

    def _complete(self, session: _Session, request: ChatRequest | CompletionRequest) -> dict:
        future = self._admit(session, request)
        try:
            return future.result(timeout=max(0.0, session.deadline - time.monotonic()))
        except (concurrent.futures.TimeoutError, concurrent.futures.CancelledError) as e:
            future.cancel()
            raise RequestError(403, "the trajectory's deadline passed or it was closed before the completion was "
                               "ready", code="deadline_exceeded", type_="permission_denied_error") from e
        finally:
            with self._lock:
                session.inflight.discard(future)


def _model_card(name: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "rlfoundry"}


def stream_events(result: dict, include_usage: bool) -> list[str]:
    """A completion as server-sent events: per choice, one chunk per sampled token (its text piece and, when
    asked, its log-prob entry), then one with the finish reason; the usage last when asked; ``[DONE]``.
    A chat choice opens with its role and sends its tool calls whole after the text; ``_pieces`` (one text
    piece per sampled token, joined: the choice's text) is what the handler recorded for this."""
    chat = result["object"] == "chat.completion"
    head = {"id": result["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": result["created"], "model": result["model"]}
    usage = {"usage": None} if include_usage else {}
    events = []

    def emit(choice: dict) -> None:
        events.append(json.dumps({**head, "choices": [choice], **usage}))

    for choice in result["choices"]:
        index, pieces, logprobs = choice["index"], choice.pop("_pieces"), choice.get("logprobs")
        message = choice.get("message") or {}
        if chat:
            emit({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})
        if message.get("tool_calls"):  # the text before the calls, every token's entry with it, then the calls
            entries = logprobs and {"content": logprobs["content"]}
            emit({"index": index, "delta": {"content": message.get("content") or ""}, "logprobs": entries,
                  "finish_reason": None})
            emit({"index": index, "delta": {"tool_calls": [{"index": i, **call} for i, call in
                                                          enumerate(message["tool_calls"])]},
                  "logprobs": None, "finish_reason": None})
        else:
            for k, piece in enumerate(pieces):
                entry = None if logprobs is None else _token_logprobs(logprobs, k, chat)
                emit({"index": index, "delta": {"content": piece}, "logprobs": entry, "finish_reason": None} if chat
                     else {"index": index, "text": piece, "logprobs": entry, "finish_reason": None})
        end = {"index": index, "logprobs": None, "finish_reason": choice["finish_reason"]}
        emit({**end, "delta": {}} if chat else {**end, "text": ""})
    if include_usage:
        events.append(json.dumps({**head, "choices": [], "usage": result["usage"]}))
    return events + ["[DONE]"]


def _token_logprobs(logprobs: dict, k: int, chat: bool) -> dict:
    """Token ``k``'s part of a choice's log-probs, in the API's layout."""
    if chat:
        return {"content": logprobs["content"][k:k + 1]}
    return {key: values[k:k + 1] if values is not None else None for key, values in logprobs.items()}


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # every trajectory of a batch may connect at once (the default backlog is 5)


def _handler_class(endpoint: OpenAIEndpoint) -> type:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses its connection

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self._reply(*endpoint.answer("GET", self.path, self.headers.get("Authorization"), None))

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            if length > _MAX_BODY:
                self.close_connection = True  # the unread body must not be parsed as the next request
                self._reply(413, RequestError(413, "request body too large").body())
                return
            raw = self.rfile.read(length) if length else b""
            self._reply(*endpoint.answer("POST", self.path, self.headers.get("Authorization"), raw))

        def _reply(self, status: int, body: dict | list[str]) -> None:
            if isinstance(body, dict):
                send_json(self, status, body)
                return
            data = "".join(f"data: {event}\n\n" for event in body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Cache-Control", "no-cache")
            self.send_header("Content-Length", str(len(data)))  # the turn is whole: its events are sent at once
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one line per request is noise
            logger.debug("openai endpoint: " + format, *args)

    return _Handler
