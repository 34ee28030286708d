"""verl's reward loop with a generative reward model: ``reward_model.model.path`` served over HTTP to
the custom reward function.

With ``reward_model.enable=true``, ``reward_model.use_reward_loop=true`` (verl's default) and
``custom_reward_function.path``, verl (January 2026) serves the reward model on vLLM/SGLang behind a
router and calls the function with ``reward_router_address`` ("host:port") and
``reward_model_tokenizer``; the function (often ``async``, e.g. FAPO's GenRM critic) POSTs SGLang's
native ``/generate`` requests there. Here the model runs on a rollout engine of its own (HF on any
device, vLLM or SGLang as ``reward_model.rollout.name`` says; weights loaded once, never synced) and
:class:`RewardModelServer` answers, on loopback:

- ``POST /generate``: ``{"input_ids": [ids] | [[ids], ...], "sampling_params": {...}}`` (or ``"text"``
  instead of ``input_ids``, tokenised with the model's tokenizer) -> SGLang's response
  ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "e2e_latency"}}``, a list of them for a list of prompts. ``sampling_params``:
  ``max_new_tokens`` (SGLang's default 128; cut at ``reward_model.rollout.response_length``, as a
  server's context length cuts it), ``temperature`` (1.0; 0 is greedy), ``top_p`` (1.0), ``top_k``
  (-1: all), ``n`` (1 only), ``skip_special_tokens`` (true, for ``text``). Another key, a prompt
  longer than ``reward_model.rollout.prompt_length`` or a malformed body is a 400 naming it.
- ``GET /health`` (200) and ``GET /get_model_info`` (``{"model_path"}``).

Requests that arrive together are generated together: one engine thread drains the queue and sends
the requests with equal sampling parameters as one batch (``generate`` is the worker group's
``generate_sequences``). The engine is not interrupted: a request waits until its batch is done, and
the reward manager's per-sample ``timeout_s`` bounds the function; :meth:`RewardModelServer.busy`
tells a timeout's report whether the server was still generating (the server hung) or idle (the
function did).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import json
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from rlfoundry.protocol import DataProto
from rlfoundry.rewards.rule import response_lengths
from rlfoundry.utils.http import send_json
from rlfoundry.utils.tokenizer import pad_id
from rlfoundry.utils.torch_functional import left_padded

logger = logging.getLogger(__name__)

SERVER_KWARGS = ("reward_router_address", "reward_model_tokenizer")  # what verl's reward loop passes
# SGLang's per-request defaults (its SamplingParams), so a request means what it means there
SAMPLING_DEFAULTS = {"max_new_tokens": 128, "temperature": 1.0, "top_p": 1.0, "top_k": -1, "n": 1,
                     "skip_special_tokens": True}


class GenerateRequestError(ValueError):
    """A request the server refuses (HTTP 400), naming the field."""


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int

    def meta_info(self) -> dict[str, Any]:
        """The engine call's settings (``resolve_sampling_params``' keys); temperature 0 is greedy as in SGLang."""
        greedy = self.temperature <= 1e-6
        return {"n": 1, "do_sample": not greedy, "temperature": 1.0 if greedy else self.temperature,
                "top_p": self.top_p, "top_k": self.top_k, "response_length": self.max_new_tokens}


def _number(params: dict, key: str, kind: type, low: float, high: float) -> Any:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float) if kind is float else int) or not low <= value <= high:
        raise GenerateRequestError(f"sampling_params.{key} must be a{'n integer' if kind is int else ' number'} "
                                   f"in [{low}, {high}], got {value!r}")
    return kind(value)


def parse_sampling(params: Any, response_cap: int) -> tuple[Sampling, bool]:
    """(settings, skip_special_tokens) from a request's ``sampling_params``; unknown keys are refused."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise GenerateRequestError("sampling_params must be a JSON object")
    unknown = sorted(set(params) - set(SAMPLING_DEFAULTS))
    if unknown:
        raise GenerateRequestError(f"sampling_params {unknown} are not supported by rlfoundry's reward-model server "
                                   f"(supported: {sorted(SAMPLING_DEFAULTS)})")
    merged = {**SAMPLING_DEFAULTS, **{k: v for k, v in params.items() if v is not None}}
    if _number(merged, "n", int, 1, 1) != 1:
        raise GenerateRequestError("sampling_params.n must be 1")
    sampling = Sampling(max_new_tokens=min(_number(merged, "max_new_tokens", int, 1, 1 << 31), response_cap),
                        temperature=_number(merged, "temperature", float, 0.0, 100.0),
                        top_p=_number(merged, "top_p", float, 1e-9, 1.0), top_k=_number(merged, "top_k", int, -1, 1 << 31))
    return sampling, bool(merged["skip_special_tokens"])


def parse_prompts(body: Any, tokenizer: Any) -> tuple[list[list[int]], bool]:
    """(token rows, whether the request was a list of prompts) from ``input_ids`` or ``text``."""
    if not isinstance(body, dict):
        raise GenerateRequestError("the request body must be a JSON object")
    if body.get("input_ids") is not None:
        ids = body["input_ids"]
        batched = isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
        rows = ids if batched else [ids]
        if not all(isinstance(r, list) and r and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                      for t in r) for r in rows):
            raise GenerateRequestError("input_ids must be a non-empty list of token ids (or a list of such lists)")
        return rows, batched
    text = body.get("text")
    batched = isinstance(text, list)
    texts = text if batched else [text]
    if not texts or not all(isinstance(t, str) and t for t in texts):
        raise GenerateRequestError("send input_ids (token ids) or text (a non-empty string or list of strings)")
    return [tokenizer(t)["input_ids"] for t in texts], batched


@dataclass
class _Job:
    ids: list[int]
    sampling: Sampling
    skip_special: bool
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    arrived: float = field(default_factory=time.perf_counter)


class RewardModelServer:
    """SGLang's ``/generate`` over ``generate`` (a rollout worker group's ``generate_sequences``).

    ``tokenizer``: the reward model's (decodes ``text``, encodes ``text`` prompts); ``prompt_cap`` and
    ``response_cap``: its engine's ``prompt_length`` and ``response_length``."""

    def __init__(self, generate: Callable[[DataProto], DataProto], tokenizer: Any, model_path: str,
                 prompt_cap: int, response_cap: int, host: str = "127.0.0.1", port: int = 0,
                 request_timeout_s: float = 600.0) -> None:
        self.generate, self.tokenizer, self.model_path = generate, tokenizer, str(model_path)
        self.request_timeout_s = float(request_timeout_s)
        # held while the engine generates: settle() waits on it, so no generation outlives the reward phase
        # (a colocated reward model shares the trainer's workers, which must not get two callers at once)
        self._engine_busy = threading.Lock()
        self.prompt_cap, self.response_cap = int(prompt_cap), int(response_cap)
        self.pad_id = pad_id(tokenizer)
        self.eos_ids = _eos_ids(tokenizer)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._inflight: dict[int, _Job] = {}
        self._httpd = _Server((host, int(port)), _handler_class(self))
        self.address = f"{host}:{self._httpd.server_address[1]}"
        self._threads = [threading.Thread(target=self._httpd.serve_forever, daemon=True, name="rlfoundry-rm-http"),
                         threading.Thread(target=self._engine_loop, daemon=True, name="rlfoundry-rm-engine")]
        for thread in self._threads:
            thread.start()

    # ---- HTTP side ---------------------------------------------------------------------------

    def answer(self, body: Any) -> Any:
        """The response to one ``/generate`` body (raises GenerateRequestError for a bad one)."""
        rows, batched = parse_prompts(body, self.tokenizer)
        sampling, skip = parse_sampling(body.get("sampling_params"), self.response_cap)
        for row in rows:
            if len(row) > self.prompt_cap:
                raise GenerateRequestError(f"a prompt of {len(row)} tokens is longer than the reward model's "
                                           f"reward_model.rollout.prompt_length={self.prompt_cap}")
        jobs = [_Job(row, sampling, skip) for row in rows]
        with self._lock:
            for job in jobs:
                self._inflight[id(job)] = job
        for job in jobs:
            self._queue.put(job)
        deadline = time.monotonic() + self.request_timeout_s
        try:
            results = [job.future.result(timeout=max(0.0, deadline - time.monotonic())) for job in jobs]
        except concurrent.futures.TimeoutError:
            for job in jobs:
                job.future.cancel()  # not generated yet: the engine skips it
            raise TimeoutError(f"the reward-model server at {self.address} did not answer within "
                               f"{self.request_timeout_s:g}s") from None
        finally:
            with self._lock:
                for job in jobs:
                    self._inflight.pop(id(job), None)
        return results if batched else results[0]

    def settle(self, timeout_s: float | None = None) -> bool:
        """End of a reward phase: requests whose callers gave up (a timed-out sample) are cancelled and
        the generation in progress, if any, finishes before the trainer uses its workers again.
        False: the engine was still generating after ``timeout_s``."""
        with self._lock:
            for job in self._inflight.values():
                job.future.cancel()  # a queued one only; the engine skips it
        acquired = self._engine_busy.acquire(timeout=-1 if timeout_s is None else timeout_s)
        if acquired:
            self._engine_busy.release()
        return acquired

    def busy(self) -> str:
        """Who a timeout waited for: the requests this server has not answered yet, or that it is idle."""
        with self._lock:
            waiting = list(self._inflight.values())
        where = f"the reward-model server at {self.address} ({self.model_path})"
        if not waiting:
            return f"{where} had no request pending: the reward function itself did not finish"
        oldest = time.perf_counter() - min(job.arrived for job in waiting)
        return f"{where} was still generating {len(waiting)} request(s), the oldest for {oldest:.1f}s"

    def shutdown(self) -> None:
        self._queue.put(None)
        self._httpd.shutdown()
        self._httpd.server_close()
        while not self._queue.empty():  # requests that arrived after the engine's last call fail, not hang
            job = self._queue.get()
            if job is not None and job.future.set_running_or_notify_cancel():
                job.future.set_exception(RuntimeError(f"the reward-model server at {self.address} shut down"))

    # ---- engine side -------------------------------------------------------------------------

    def _engine_loop(self) -> None:
        while True:
            jobs = [self._queue.get()]
            while not self._queue.empty():  # everything that arrived meanwhile joins this engine call
                jobs.append(self._queue.get())
            if any(job is None for job in jobs):
                for job in jobs:  # drained with the sentinel: they fail rather than wait forever
                    if job is not None and job.future.set_running_or_notify_cancel():
                        job.future.set_exception(RuntimeError(f"the reward-model server at {self.address} shut down"))
                return
            groups: dict[Sampling, list[_Job]] = {}
            for job in jobs:
                groups.setdefault(job.sampling, []).append(job)
            for sampling, group in groups.items():
                self._run(sampling, group)

    def _run(self, sampling: Sampling, jobs: list[_Job]) -> None:
        jobs = [job for job in jobs if job.future.set_running_or_notify_cancel()]  # callers that gave up: skipped
        if not jobs:
            return
        with self._engine_busy:
            self._generate_for(sampling, jobs)

    def _generate_for(self, sampling: Sampling, jobs: list[_Job]) -> None:
        started = time.perf_counter()
        try:
            out = self.generate(DataProto.from_dict(tensors=left_padded([j.ids for j in jobs], self.pad_id),
                                                    meta_info=sampling.meta_info()))
            responses, lengths = out.batch["responses"].cpu(), response_lengths(out).tolist()
        except Exception as err:  # noqa: BLE001 - the requests fail with the reason; the server goes on
            logger.warning("reward-model server: generating %d request(s) failed: %s: %s", len(jobs),
                           type(err).__name__, err)
            for job in jobs:
                job.future.set_exception(err)
            return
        latency = time.perf_counter() - started
        for job, row, n in zip(jobs, responses, lengths):
            job.future.set_result(self._response(job, row[:n].tolist(), sampling, latency))

    def _response(self, job: _Job, output_ids: list[int], sampling: Sampling, latency: float) -> dict:
        stopped = bool(output_ids) and output_ids[-1] in self.eos_ids
        finish = ({"type": "stop", "matched": output_ids[-1]} if stopped
                  else {"type": "length", "length": sampling.max_new_tokens})
        return {"text": self.tokenizer.decode(output_ids, skip_special_tokens=job.skip_special),
                "output_ids": output_ids,
                "meta_info": {"id": f"rlf-{next(self._ids)}", "finish_reason": finish,
                              "prompt_tokens": len(job.ids), "completion_tokens": len(output_ids),
                              "cached_tokens": 0, "e2e_latency": time.perf_counter() - job.arrived,
                              "engine_latency": latency}}


def _eos_ids(tokenizer: Any) -> set[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    return set(eos if isinstance(eos, list) else [] if eos is None else [eos])


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 4096  # every sample of a batch may post at once (the default backlog is 5)


def _handler_class(server: RewardModelServer) -> type:
    class _Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0].rstrip("/")
            if path == "/health":
                self._reply(200, {})
            elif path == "/get_model_info":
                self._reply(200, {"model_path": server.model_path, "is_generation": True})
            else:
                self._reply(404, _error(f"GET {path} is not served (POST /generate, GET /health, GET /get_model_info)"))

        def do_POST(self) -> None:  # noqa: N802
            raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if self.path.split("?", 1)[0].rstrip("/") != "/generate":
                self._reply(404, _error(f"POST {self.path} is not served: rlfoundry's reward-model server has "
                                        "SGLang's native /generate only"))
                return
            try:
                self._reply(200, server.answer(json.loads(raw or b"null")))
            except (GenerateRequestError, json.JSONDecodeError, UnicodeDecodeError) as err:
                self._reply(400, _error(str(err)))
            except Exception as err:  # noqa: BLE001 - that request fails (its sample's failure_score), not the run
                self._reply(500, _error(f"{type(err).__name__}: {err}"))

        def _reply(self, status: int, body: Any) -> None:
            send_json(self, status, body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            logger.debug("reward-model server: " + format, *args)

    return _Handler


def _error(message: str) -> dict:
    return {"error": {"message": message}}
