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

__all__ = ["ChatRequest", "OpenAIEndpoint", "RequestError", "parse_chat_request"]

logger = logging.getLogger(__name__)

MODEL_ID = "rlfoundry-policy"  # what /v1/models lists; a request may name any model (it is the policy)
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
class ChatRequest:
    """A validated ``/v1/chat/completions`` body (the fields the endpoint acts on)."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    stop: list[str] = field(default_factory=list)
    model: str = MODEL_ID


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
    if body.get("stream"):
        raise _bad("stream=true is not supported by this endpoint", "stream", "unsupported_parameter")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else stop or []
    if not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) and s for s in stop)):
        raise _bad("stop must be a string or a list of at most 4 non-empty strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    return ChatRequest(
        messages=[_message(i, m) for i, m in enumerate(messages)], tools=tools or None,
        n=_number(body, "n", 1, 128, integer=True) or 1, temperature=_number(body, "temperature", 0, 2),
        top_p=_number(body, "top_p", 0, 1),
        max_tokens=_number({"max_tokens": max_tokens}, "max_tokens", 1, 1 << 30, integer=True),
        stop=stop, model=str(body.get("model") or MODEL_ID))


Handler = Callable[[ChatRequest], Awaitable[dict[str, Any]]]


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

    def answer(self, method: str, path: str, auth: str | None, raw: bytes | None) -> tuple[int, dict]:
        try:
            return 200, self._answer(method, path, auth, raw)
        except RequestError as e:
            return e.status, e.body()
        except Exception as e:  # noqa: BLE001 - the agent gets a 500 with the reason, the run goes on
            logger.warning("openai endpoint: %s %s failed: %s: %s", method, path, type(e).__name__, e)
            return 500, RequestError(500, f"{type(e).__name__}: {e}", type_="server_error").body()

    def _answer(self, method: str, path: str, auth: str | None, raw: bytes | None) -> dict:
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
            return {"object": "list", "data": [{"id": MODEL_ID, "object": "model", "created": 0, "owned_by": "rlfoundry"}]}
        if method != "POST" or route != "chat/completions":
            raise RequestError(404, f"{method} /v1/{route} is not served: POST /v1/chat/completions, GET /v1/models",
                               code="unknown_url", type_="not_found_error")
        try:
            body = json.loads(raw or b"")
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise _bad(f"the request body is not valid JSON ({e})", "body", "invalid_json") from e
        return self._complete(session, parse_chat_request(body))

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

    def _admit(self, session: _Session, request: ChatRequest) -> concurrent.futures.Future:
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

    def _complete(self, session: _Session, request: ChatRequest) -> dict:
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

        def _reply(self, status: int, body: dict) -> None:
            send_json(self, status, body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: one line per request is noise
            logger.debug("openai endpoint: " + format, *args)

    return _Handler
