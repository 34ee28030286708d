"""SandboxFusion's HTTP API both ways: a client (code runs on a SandboxFusion server, as verl's
``reward_model.sandbox_fusion.url`` does) and a server (``rlfoundry sandbox serve``) that runs this
project's sandbox behind the same API, so code execution can live on other machines.

The API subset used (SandboxFusion's ``POST /run_code``): request ``{"code", "language", "run_timeout",
"memory_limit_MB", "stdin"}``; response ``{"status": "Success" | "Failed" | "SandboxError", "message",
"run_result": {"status": "Finished" | "TimeLimitExceeded", "execution_time", "return_code", "stdout",
"stderr"}}``. The server adds ``rlfoundry_status`` (the sandbox's own status); the client uses it when
present and otherwise infers the status from the standard fields, so it works with either server.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from rlfoundry.sandbox.runner import SandboxLimits, SandboxResult, SandboxUnavailable, run_python
from rlfoundry.utils.http import send_json

__all__ = ["executor", "main", "make_server", "run_remote"]

_semaphores: dict[tuple[str, int], threading.BoundedSemaphore] = {}
_semaphores_lock = threading.Lock()
RETRIES = 3  # connection failures and 5xx answers: the server restarting or overloaded


def _semaphore(url: str, max_concurrent: int) -> threading.BoundedSemaphore:
    with _semaphores_lock:
        return _semaphores.setdefault((url, max_concurrent), threading.BoundedSemaphore(max_concurrent))


def run_remote(url: str, code: str, limits: SandboxLimits = SandboxLimits(), stdin: str = "",
               max_concurrent: int = 64, memory_limit_mb: int | None = None) -> SandboxResult:
    """Run ``code`` on the SandboxFusion server at ``url`` (its ``/run_code`` endpoint or base URL).
    A server that cannot be reached raises :class:`SandboxUnavailable` naming it (a reward counts that
    as its scorer's error, not as the program's failure)."""
    endpoint = url if url.rstrip("/").endswith("/run_code") else url.rstrip("/") + "/run_code"
    memory_mb = memory_limit_mb if memory_limit_mb is not None else limits.memory_bytes >> 20
    body = json.dumps({"code": code, "language": "python", "run_timeout": limits.wall_time_s,
                       "memory_limit_MB": memory_mb, "stdin": stdin}).encode()
    with _semaphore(endpoint, max_concurrent):
        answer, wall = _post(endpoint, body, timeout=limits.wall_time_s + 30)
    return _to_result(answer, wall, limits)


def executor(sandbox_fusion_url: str | None = None, memory_limit_mb: int | None = None,
             max_concurrent: int = 64) -> Callable[[str, SandboxLimits], SandboxResult]:
    """Where programs run: this machine's sandbox, or the SandboxFusion server at ``sandbox_fusion_url``."""
    if not sandbox_fusion_url:
        return run_python
    return functools.partial(_run_at, sandbox_fusion_url, memory_limit_mb, max_concurrent)


def _run_at(url: str, memory_limit_mb: int | None, max_concurrent: int, code: str, limits: SandboxLimits) -> SandboxResult:
    return run_remote(url, code, limits, max_concurrent=max_concurrent, memory_limit_mb=memory_limit_mb)


def _post(endpoint: str, body: bytes, timeout: float) -> tuple[dict, float]:
    error: Exception | None = None
    for attempt in range(RETRIES):
        start = time.monotonic()
        request = urllib.request.Request(endpoint, data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read()), time.monotonic() - start
        except urllib.error.HTTPError as e:
            error = e
            if e.code < 500:
                break  # the request itself is wrong: asking again changes nothing
        except (urllib.error.URLError, OSError, ValueError) as e:
            error = e
        time.sleep(0.5 * (attempt + 1))
    raise SandboxUnavailable(f"SandboxFusion server {endpoint} failed: {error}. Check reward_model.sandbox_fusion.url "
                             "(or the tool's sandbox_fusion_url) and that the server is running")


def _to_result(answer: dict, wall: float, limits: SandboxLimits) -> SandboxResult:
    if answer.get("status") == "SandboxError":
        raise SandboxUnavailable(f"SandboxFusion could not run the program: {answer.get('message')}")
    run = answer.get("run_result") or {}
    stdout, stderr = (str(run.get(k) or "")[: limits.max_output_bytes] for k in ("stdout", "stderr"))
    code = run.get("return_code")
    status = answer.get("rlfoundry_status") or _infer_status(run.get("status"), code, stderr)
    return SandboxResult(status, stdout, stderr, code, float(run.get("execution_time") or wall), "remote")


def _infer_status(run_status: str | None, code: int | None, stderr: str) -> str:
    if run_status == "TimeLimitExceeded":
        return "timeout"
    if code == 0:
        return "ok"
    if "MemoryError" in stderr:
        return "memory"
    return "killed" if code is not None and (code < 0 or code > 128) else "error"


# ---- the server -------------------------------------------------------------------------------


def _limits_for(request: dict, defaults: SandboxLimits, caps: SandboxLimits) -> SandboxLimits:
    """The request's limits, never above the server's ``caps`` (a client must not buy unbounded time or memory)."""
    wall = float(request.get("run_timeout") or defaults.wall_time_s)
    if not math.isfinite(wall) or wall <= 0:
        raise ValueError(f"run_timeout={request.get('run_timeout')!r} must be a positive number of seconds")
    wall = min(wall, caps.wall_time_s)
    memory_mb = int(request.get("memory_limit_MB") or -1)
    memory = min(memory_mb << 20, caps.memory_bytes) if memory_mb > 0 else defaults.memory_bytes
    return SandboxLimits(wall_time_s=wall, cpu_time_s=max(1, math.ceil(wall)), memory_bytes=memory,
                         max_output_bytes=defaults.max_output_bytes)


# the most a request may ask for (``rlfoundry sandbox serve --max-timeout-s / --max-memory-mb``)
DEFAULT_CAPS = SandboxLimits(wall_time_s=60.0, memory_bytes=4 << 30)


def handle_run_code(request: Any, defaults: SandboxLimits = SandboxLimits(), caps: SandboxLimits = DEFAULT_CAPS) -> dict:
    """One ``/run_code`` request → SandboxFusion's response body (never raises for bad input)."""
    if not isinstance(request, dict) or not isinstance(request.get("code"), str):
        return {"status": "SandboxError", "message": "the request must be a JSON object with a string 'code'"}
    language = str(request.get("language", "python"))
    if language not in ("python", "python3"):
        return {"status": "SandboxError", "message": f"language {language!r} is not supported here (python only)"}
    if request.get("files"):
        return {"status": "SandboxError", "message": "'files' is not supported by rlfoundry's sandbox server"}
    try:
        r = run_python(request["code"], _limits_for(request, defaults, caps), stdin=str(request.get("stdin") or ""))
    except Exception as e:  # noqa: BLE001 - whatever the request provoked is answered, never a dropped connection
        return {"status": "SandboxError", "message": f"{type(e).__name__}: {e}"}
    run = {"status": "TimeLimitExceeded" if r.status == "timeout" else "Finished", "execution_time": r.wall_s,
           "return_code": r.exit_code, "stdout": r.stdout, "stderr": r.stderr}
    return {"status": "Success" if r.ok else "Failed", "message": "", "compile_result": None, "run_result": run,
            "files": {}, "rlfoundry_status": r.status}


class _Handler(BaseHTTPRequestHandler):
    server_version = "rlfoundry-sandbox"
    defaults = SandboxLimits()
    caps = DEFAULT_CAPS
    slots = threading.BoundedSemaphore(8)  # sandboxes running at once; the others wait their turn

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/run_code":
            return self._send(404, {"status": "SandboxError", "message": f"no endpoint {self.path}; use POST /run_code"})
        try:
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
        except ValueError as e:
            return self._send(400, {"status": "SandboxError", "message": f"the body is not JSON: {e}"})
        with self.slots:
            answer = handle_run_code(request, self.defaults, self.caps)
        self._send(200, answer)

    def do_GET(self) -> None:  # noqa: N802
        self._send(200 if self.path.rstrip("/") in ("", "/v1/ping") else 404, {"status": "ok"})

    def _send(self, code: int, body: dict) -> None:
        send_json(self, code, body)

    def log_message(self, fmt: str, *args: Any) -> None:  # one line per request on stderr, not the default's
        print(f"[sandbox] {self.address_string()} {fmt % args}", file=sys.stderr)


def make_server(host: str = "127.0.0.1", port: int = 8080, defaults: SandboxLimits = SandboxLimits(),
                caps: SandboxLimits = DEFAULT_CAPS, max_concurrent: int = 8) -> ThreadingHTTPServer:
    """The HTTP server (not yet serving); port 0 picks a free one (``server.server_address``). At most
    ``max_concurrent`` programs run at once; a request's limits are cut to ``caps``."""
    handler = type("Handler", (_Handler,), {"defaults": defaults, "caps": caps,
                                            "slots": threading.BoundedSemaphore(max_concurrent)})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server


def main(argv: list[str] | None = None) -> int:
    """``rlfoundry sandbox serve [--host H] [--port P] [--max-output-bytes N] [--max-timeout-s S]
    [--max-memory-mb M] [--max-concurrent K]``."""
    parser = argparse.ArgumentParser(prog="rlfoundry sandbox", description="Serve this sandbox over SandboxFusion's API")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--max-output-bytes", type=int, default=SandboxLimits().max_output_bytes)
    parser.add_argument("--max-timeout-s", type=float, default=DEFAULT_CAPS.wall_time_s, help="most a request may ask")
    parser.add_argument("--max-memory-mb", type=int, default=DEFAULT_CAPS.memory_bytes >> 20, help="most a request may ask")
    parser.add_argument("--max-concurrent", type=int, default=8, help="programs running at once")
    args = parser.parse_args(argv)
    from rlfoundry.sandbox.runner import mode

    try:
        isolation = mode()  # refuse to serve at all rather than fail every request
    except SandboxUnavailable as e:
        print(f"rlfoundry sandbox: {e}", file=sys.stderr)
        return 2
    server = make_server(args.host, args.port, SandboxLimits(max_output_bytes=args.max_output_bytes),
                         SandboxLimits(wall_time_s=args.max_timeout_s, memory_bytes=args.max_memory_mb << 20),
                         args.max_concurrent)
    host, port = server.server_address[:2]
    print(f"rlfoundry sandbox ({isolation}) serving SandboxFusion's POST /run_code on http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
