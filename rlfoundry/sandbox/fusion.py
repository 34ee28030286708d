"""SandboxFusion's HTTP API both ways: a client (code runs on a SandboxFusion server, as verl's
``reward_model.sandbox_fusion.url`` does) and a server (``rlfoundry sandbox serve``) that runs this
project's sandbox behind the same API, answering as SandboxFusion answers, so code execution can live
on other machines and SandboxFusion's clients work unchanged.

The API (SandboxFusion's ``POST /run_code`` and ``GET /v1/ping``): request ``{"code", "language",
"compile_timeout", "run_timeout", "memory_limit_MB", "stdin", "files", "fetch_files"}`` (``files``:
path → base64 content written before the run; ``fetch_files``: paths returned base64 after it);
response ``{"status": "Success" | "Failed" | "SandboxError", "message", "compile_result", "run_result",
"executor_pod_name", "files"}``, each result ``{"status": "Finished" | "TimeLimitExceeded" | "Error",
"execution_time", "return_code" (null after a time limit), "stdout", "stderr"}``. A request SandboxFusion
would not validate (an unknown language, a missing ``code``) gets FastAPI's 422. rlfoundry adds one
request key, ``max_output_bytes`` (the output kept per stream; default and most 1 MiB, SandboxFusion's),
which the client sends so a remote run is cut where a local one is; SandboxFusion ignores it.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import functools
import glob
import json
import math
import os
import shutil
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Callable, Dict, List, Literal, Optional

from pydantic import BaseModel, ValidationError

from rlfoundry.sandbox.namespace import WORKDIR, Job
from rlfoundry.sandbox.runner import (SandboxLimits, SandboxResult, SandboxUnavailable, exit_status, run_job,
                                      run_python)
from rlfoundry.utils.http import send_json

__all__ = ["LANGUAGES", "RunCodeRequest", "executor", "handle_run_code", "main", "make_server", "run_remote"]

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
                       "memory_limit_MB": memory_mb, "stdin": stdin,
                       "max_output_bytes": limits.max_output_bytes}).encode()
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
    out, err = (str(run.get(k) or "") for k in ("stdout", "stderr"))
    # a stream that reached the limit is the local sandbox's output_limit (SandboxFusion itself keeps 1 MiB)
    full = any(len(s.encode("utf-8", errors="replace")) >= limits.max_output_bytes for s in (out, err))
    code = run.get("return_code")
    status = "output_limit" if full else _infer_status(run.get("status"), code, err)
    stdout, stderr = (s[: limits.max_output_bytes] for s in (out, err))
    return SandboxResult(status, stdout, stderr, code, float(run.get("execution_time") or wall), "remote")


def _infer_status(run_status: str | None, code: int | None, stderr: str) -> str:
    """The local sandbox's status from SandboxFusion's fields, by the rules ``runner`` applies."""
    if run_status == "TimeLimitExceeded":
        return "timeout"
    return exit_status(code, stderr, shell_signals=True)


# ---- the server -------------------------------------------------------------------------------

# SandboxFusion's ``language`` values (its ``Language`` literal); a value outside it is refused with 422
# as SandboxFusion's FastAPI validation refuses it. Those this server runs: see RUNNERS.
LANGUAGES = ("python", "cpp", "nodejs", "go", "go_test", "java", "php", "csharp", "bash", "typescript", "sql",
             "rust", "cuda", "lua", "R", "perl", "D_ut", "ruby", "scala", "julia", "pytest", "junit",
             "kotlin_script", "jest", "verilog", "python_gpu", "lean", "swift", "racket")
OUTPUT_BYTES = 1 << 20  # SandboxFusion keeps up to 1 MiB of each stream
COMPILE_FILE_BYTES = 64 << 20  # the largest file a compiler may write (the program)


class RunCodeRequest(BaseModel):
    """SandboxFusion's ``/run_code`` request (its field names, types and defaults), plus
    ``max_output_bytes``: rlfoundry's key for the output cap per stream (SandboxFusion ignores it)."""

    code: str
    language: Literal[LANGUAGES]  # type: ignore[valid-type]
    compile_timeout: float = 10
    run_timeout: float = 10
    memory_limit_MB: int = -1
    stdin: Optional[str] = None
    files: Dict[str, Optional[str]] = {}
    fetch_files: List[str] = []
    max_output_bytes: Optional[int] = None


def _limits_for(request: RunCodeRequest, defaults: SandboxLimits, caps: SandboxLimits,
                timeout: float | None = None) -> SandboxLimits:
    """The request's limits, never above the server's ``caps`` (a client must not buy unbounded time,
    memory or output); ``timeout`` is the phase's (run_timeout unless given)."""
    wall = request.run_timeout if timeout is None else timeout
    if not math.isfinite(wall) or wall <= 0:
        raise ValueError(f"the timeout {wall!r} must be a positive number of seconds")
    wall = min(wall, caps.wall_time_s)
    mb = request.memory_limit_MB
    memory = min(mb << 20, caps.memory_bytes) if mb > 0 else defaults.memory_bytes
    output = min(request.max_output_bytes or defaults.max_output_bytes, defaults.max_output_bytes)
    return SandboxLimits(wall_time_s=wall, cpu_time_s=max(1, math.ceil(wall)), memory_bytes=memory,
                         max_output_bytes=max(1, output))


# the most a request may ask for (``rlfoundry sandbox serve --max-timeout-s / --max-memory-mb``)
DEFAULT_CAPS = SandboxLimits(wall_time_s=60.0, memory_bytes=4 << 30)
SERVER_DEFAULTS = SandboxLimits(max_output_bytes=OUTPUT_BYTES)


def handle_run_code(body: Any, defaults: SandboxLimits = SERVER_DEFAULTS,
                    caps: SandboxLimits = DEFAULT_CAPS) -> tuple[int, Any]:
    """One ``/run_code`` request → (HTTP status, SandboxFusion's response body); never raises for bad
    input: a request SandboxFusion would not validate gets its 422, a run that fails its SandboxError."""
    try:
        request = RunCodeRequest.model_validate(body)
    except ValidationError as e:
        return 422, {"detail": _validation_detail(e, body)}
    answer = {"status": "Success", "message": "", "compile_result": None, "run_result": None,
              "executor_pod_name": os.environ.get("MY_POD_NAME"), "files": {}}
    try:
        compile_result, run_result, files = _run(request, defaults, caps)
    except Exception as e:  # noqa: BLE001 - whatever the request provoked is answered, never a dropped connection
        return 200, {**answer, "status": "SandboxError", "message": f"{type(e).__name__}: {e}"}
    runs = [r for r in (compile_result, run_result) if r is not None]
    failed = any(r["status"] == "TimeLimitExceeded" or r["return_code"] not in (0, None) for r in runs)
    return 200, {**answer, "status": "Failed" if failed else "Success", "compile_result": compile_result,
                 "run_result": run_result, "files": files}


def _validation_detail(error: ValidationError, body: Any) -> list[dict]:
    """pydantic's errors as FastAPI reports a request body's (``loc`` under ``body``, no ``url``)."""
    if body is None:
        return [{"type": "missing", "loc": ["body"], "msg": "Field required", "input": None}]
    detail = [{**e, "loc": ["body", *e["loc"]]} for e in error.errors(include_url=False)]
    return json.loads(json.dumps(detail, default=str))  # a ctx may hold an exception object


def _run(request: RunCodeRequest, defaults: SandboxLimits, caps: SandboxLimits):
    """(compile_result, run_result, fetched files) for the request's language."""
    runner = RUNNERS.get(request.language)
    if runner is None or not runner.available():
        served = ", ".join(k for k, r in RUNNERS.items() if r.available())
        raise ValueError(f"language {request.language!r} is not available on this server (it runs {served})")
    limits = _limits_for(request, defaults, caps)
    for name in [*request.files, *request.fetch_files]:
        _inside(WORKDIR, name)  # a path outside the working directory is refused before anything runs
    stdin = request.stdin or ""
    if runner.source == "main.py" and not request.files and not request.fetch_files:
        return None, _command_result(run_python(request.code, limits, stdin=stdin)), {}  # no host directory needed
    with tempfile.TemporaryDirectory(prefix="rlfoundry-fusion-") as work:
        _write_files(work, request.files)
        Path(work, runner.source).write_text(request.code, encoding="utf-8", errors="replace")
        compiled = None
        if runner.compile is not None:
            phase = _limits_for(request, defaults, caps, request.compile_timeout)
            phase = dataclasses.replace(phase, memory_bytes=caps.memory_bytes, max_output_bytes=COMPILE_FILE_BYTES)
            compiled = _command_result(run_job(Job(runner.compile(), work, processes=True), phase), limits.max_output_bytes)
            if compiled["status"] != "Finished" or compiled["return_code"] != 0:
                return compiled, None, _fetch_files(work, request.fetch_files)
        ran = _command_result(run_job(Job(runner.run, work), limits, stdin=stdin))
        return compiled, ran, _fetch_files(work, request.fetch_files)


def _command_result(r: SandboxResult, max_output: int | None = None) -> dict:
    """SandboxFusion's CommandRunResult: a run cut by its time limit is ``TimeLimitExceeded`` with no
    return code, as SandboxFusion reports it."""
    timed_out = r.status == "timeout"
    return {"status": "TimeLimitExceeded" if timed_out else "Finished", "execution_time": r.wall_s,
            "return_code": None if timed_out else r.exit_code,
            "stdout": r.stdout[:max_output], "stderr": r.stderr[:max_output]}


def _inside(work: str, name: str) -> str:
    """The host path of ``name`` (relative to the working directory, or absolute under /sandbox), refusing
    any path that leaves it: the program's world has no other directory the server can reach."""
    rel = os.path.relpath(name, WORKDIR) if os.path.isabs(name) else name
    path = os.path.normpath(os.path.join(work, rel))
    if not path.startswith(os.path.join(work, "")):
        raise ValueError(f"file path {name!r} is outside the working directory {WORKDIR} (use a relative path)")
    return path


def _write_files(work: str, files: dict[str, str | None]) -> None:
    """``files``: path → base64 content, written before the run (a null content is skipped, as SandboxFusion does)."""
    for name, content in files.items():
        if content is None:
            continue
        path = _inside(work, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        Path(path).write_bytes(base64.b64decode(content, validate=True))


def _fetch_files(work: str, names: list[str]) -> dict[str, str]:
    """``fetch_files`` that exist as regular files after the run, base64-encoded. The program has ended,
    so nothing changes under us; a symlink it left is not followed (it could name a host file)."""
    fetched = {}
    for name in names:
        path = _inside(work, name)
        if os.path.realpath(path) != path or not os.path.isfile(path):
            continue
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            fetched[name] = base64.b64encode(f.read()).decode()
    return fetched


@dataclass(frozen=True)
class _Runner:
    """How a language runs: its source file, the compile command (none for Python) and the run command,
    all relative to the working directory."""

    source: str
    run: tuple[str, ...]
    compile: Callable[[], tuple[str, ...]] | None = None
    needs: str | None = None  # the compiler that must exist on this machine

    def available(self) -> bool:
        return self.needs is None or shutil.which(self.needs) is not None


def _cpp_command() -> tuple[str, ...]:
    """SandboxFusion's C++ command: C++17 and OpenSSL and pthreads, the libraries this machine lacks left out."""
    libs = [f"-l{lib}" for lib in ("crypto", "ssl", "pthread") if _linkable(lib)]
    return ("g++", "-std=c++17", "main.cpp", "-o", "test", *libs)


@functools.lru_cache(maxsize=None)
def _linkable(lib: str) -> bool:
    return any(glob.glob(f"{d}/lib{lib}.so") or glob.glob(f"{d}/lib{lib}.a")
               for d in ("/usr/lib", "/usr/lib/*-linux-gnu", "/usr/lib64", "/lib/*-linux-gnu"))


RUNNERS = {
    "python": _Runner("main.py", (sys.executable, "-I", "-B", "main.py")),
    "cpp": _Runner("main.cpp", ("./test",), _cpp_command, needs="g++"),
}


class _Handler(BaseHTTPRequestHandler):
    server_version = "rlfoundry-sandbox"
    defaults = SERVER_DEFAULTS
    caps = DEFAULT_CAPS
    slots = threading.BoundedSemaphore(8)  # sandboxes running at once; the others wait their turn

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if self.path.rstrip("/") != "/run_code":
            return self._send(405 if self.path == "/v1/ping" else 404, _not_found(self.path))
        raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        try:
            request = json.loads(raw) if raw.strip() else None
        except ValueError as e:  # FastAPI's answer to a body that is not JSON
            return self._send(422, {"detail": [{"type": "json_invalid", "loc": ["body", getattr(e, "pos", 0)],
                                                "msg": "JSON decode error", "input": {}, "ctx": {"error": str(e)}}]})
        with self.slots:
            code, answer = handle_run_code(request, self.defaults, self.caps)
        self._send(code, answer)

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/v1/ping":
            return self._send(200, "pong")
        self._send(405 if self.path.rstrip("/") == "/run_code" else 404, _not_found(self.path))

    def _send(self, code: int, body: Any) -> None:
        send_json(self, code, body)

    def log_message(self, fmt: str, *args: Any) -> None:  # one line per request on stderr, not the default's
        print(f"[sandbox] {self.address_string()} {fmt % args}", file=sys.stderr)


def _not_found(path: str) -> dict:
    """FastAPI's bodies for a path it has not (404) or has for the other method (405)."""
    return {"detail": "Method Not Allowed" if path.rstrip("/") in ("/run_code", "/v1/ping") else "Not Found"}


def make_server(host: str = "127.0.0.1", port: int = 8080, defaults: SandboxLimits = SERVER_DEFAULTS,
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
    parser.add_argument("--max-output-bytes", type=int, default=OUTPUT_BYTES,
                        help="output kept per stream, and the most a request's max_output_bytes may ask (1 MiB)")
    parser.add_argument("--max-timeout-s", type=float, default=DEFAULT_CAPS.wall_time_s, help="most a request may ask")
    parser.add_argument("--max-memory-mb", type=int, default=DEFAULT_CAPS.memory_bytes >> 20, help="most a request may ask")
    parser.add_argument("--max-concurrent", type=int, default=8, help="programs running at once")
    args = parser.parse_args(argv)
    from rlfoundry.sandbox.runner import caps_in_force, mode

    try:
        isolation = mode()  # refuse to serve at all rather than fail every request
    except SandboxUnavailable as e:
        print(f"rlfoundry sandbox: {e}", file=sys.stderr)
        return 2
    server = make_server(args.host, args.port, SandboxLimits(max_output_bytes=args.max_output_bytes),
                         SandboxLimits(wall_time_s=args.max_timeout_s, memory_bytes=args.max_memory_mb << 20),
                         args.max_concurrent)
    host, port = server.server_address[:2]
    languages = ", ".join(k for k, r in RUNNERS.items() if r.available())
    print(f"rlfoundry sandbox ({isolation}; {languages}) serving SandboxFusion's POST /run_code on "
          f"http://{host}:{port}", flush=True)
    print(f"rlfoundry sandbox caps: {caps_in_force()}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0
