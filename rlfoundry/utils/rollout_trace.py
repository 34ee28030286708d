"""Rollout tracing under verl's names (``verl.utils.rollout_trace``), so agent loops and tools that
carry verl's ``@rollout_trace_op`` run unchanged but for imports.

- ``RolloutTraceConfig.init(project_name, experiment_name, backend, token2text=False, ...)`` picks the
  back end once per process (later calls are ignored, as in verl); ``reset()`` forgets it.
- ``@rollout_trace_op`` on a method (async or not) records each call: the op (``Class.method``), its
  inputs (arguments bound by name, ``self`` left out), its output or exception, the attributes of the
  enclosing ``rollout_trace_attr`` and, with ``token2text``, the decoded ``prompt_ids`` / ``response_ids``
  of an output that has them (decoded with ``self.tokenizer``). With no back end it only calls the method.
- ``with rollout_trace_attr(sample_index=, step=, rollout_n=, validate=, trace=True):`` tags the calls
  made inside with a trajectory's identity; ``trace=False`` switches tracing off inside.

Back ends: ``weave`` and ``mlflow`` as in verl (installed separately; spans through their clients), and
``file``, ours: one JSON object per call appended to ``path`` (default ``rollout_trace.jsonl``), with
``id`` / ``parent_id`` linking a call to the traced call it ran inside, and start/end times. Any other
name is an error that lists these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import json
import os
import threading
import time
from contextvars import ContextVar
from pathlib import Path
from typing import Any

__all__ = ["BACKENDS", "RolloutTraceConfig", "rollout_trace_attr", "rollout_trace_op"]

BACKENDS = ("weave", "mlflow", "file")

_trace_enabled: ContextVar[bool] = ContextVar("rlfoundry_trace_enabled", default=True)
_attributes: ContextVar[dict[str, Any]] = ContextVar("rlfoundry_trace_attributes", default={})
_parent: ContextVar[int | None] = ContextVar("rlfoundry_trace_parent", default=None)


class RolloutTraceConfig:
    """The process's trace settings (verl's singleton and class methods)."""

    _instance: RolloutTraceConfig | None = None

    def __init__(self) -> None:
        self.backend: str | None = None
        self.client: Any = None
        self.token2text = False
        self.project_name: str | None = None
        self.experiment_name: str | None = None
        self.max_samples_per_step_per_worker: int | None = None  # for the caller that picks traced samples
        self._initialized = False

    @classmethod
    def get_instance(cls) -> RolloutTraceConfig:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @classmethod
    def init(cls, project_name: str, experiment_name: str, backend: str | None, token2text: bool = False,
             max_samples_per_step_per_worker: int | None = None, path: str | os.PathLike | None = None) -> None:
        config = cls.get_instance()
        if config._initialized:
            return
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"rollout trace backend {backend!r} is not one of {list(BACKENDS)} (or null for none)")
        config.client = _make_client(backend, project_name, path)
        config.backend, config.token2text = backend, bool(token2text)
        config.project_name, config.experiment_name = project_name, experiment_name
        config.max_samples_per_step_per_worker = max_samples_per_step_per_worker
        config._initialized = True

    @classmethod
    def get_backend(cls) -> str | None:
        return cls.get_instance().backend

    @classmethod
    def get_client(cls) -> Any:
        return cls.get_instance().client

    @classmethod
    def enable_token2text(cls) -> bool:
        return cls.get_instance().token2text

    @classmethod
    def reset(cls) -> None:
        cls._instance = None


def _make_client(backend: str | None, project_name: str, path: str | os.PathLike | None) -> Any:
    if backend == "file":
        return _FileClient(Path(path or "rollout_trace.jsonl"))
    if backend is None:
        return None
    try:
        module = __import__(backend)
    except ImportError as e:
        raise ImportError(f"rollout trace backend {backend!r} needs the {backend} package: pip install {backend}") from e
    if backend == "weave":
        return module.init(project_name)
    module.config.enable_async_logging()
    module.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI", "sqlite:////tmp/mlruns.db"))  # verl's default
    module.set_experiment(project_name)
    return module


@contextlib.contextmanager
def rollout_trace_attr(sample_index: Any = None, step: int | None = None, rollout_n: int | None = None,
                       name: str = "rollout_trace", validate: bool = False, trace: bool = True):
    """Tag the traced calls inside with these attributes (``None`` ones left out); ``trace=False``:
    record nothing inside. Without a back end it does nothing. ``name``: the mlflow span's name."""
    config = RolloutTraceConfig.get_instance()
    if config.backend is None:
        yield
        return
    if not trace:
        token = _trace_enabled.set(False)
        try:
            yield
        finally:
            _trace_enabled.reset(token)
        return
    given = {"sample_index": sample_index, "step": step, "rollout_n": rollout_n}
    attributes = {**_attributes.get(), **{k: v for k, v in given.items() if v is not None},
                  "validate": validate, "experiment_name": config.experiment_name}
    token = _attributes.set(attributes)
    try:
        with _backend_scope(config, name, attributes):
            yield
    finally:
        _attributes.reset(token)


def _backend_scope(config: RolloutTraceConfig, name: str, attributes: dict) -> contextlib.AbstractContextManager:
    if config.backend == "weave":
        import weave

        return weave.attributes(attributes)
    if config.backend == "mlflow":
        return _mlflow_tagged_span(config.client, name, attributes)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _mlflow_tagged_span(mlflow: Any, name: str, attributes: dict):
    with mlflow.start_span(name=name) as span:
        for key, value in attributes.items():
            mlflow.set_trace_tag(span.trace_id, str(key), str(value))
        yield


def rollout_trace_op(func):
    """Trace each call of the method ``func`` (async or not) on the configured back end."""
    signature = inspect.signature(func)

    def active() -> RolloutTraceConfig | None:
        config = RolloutTraceConfig.get_instance()
        return config if config.backend is not None and _trace_enabled.get() else None

    def inputs(self, args, kwargs) -> dict[str, Any]:
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        return {k: v for i, (k, v) in enumerate(bound.arguments.items()) if i > 0}  # all but self

    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def traced_async(self, *args, **kwargs):
            config = active()
            if config is None:
                return await func(self, *args, **kwargs)
            with _call(config, func.__qualname__, inputs(self, args, kwargs)) as outputs:
                result = await func(self, *args, **kwargs)
                outputs.append(_recorded(config, self, result))
            return result

        return traced_async

    @functools.wraps(func)
    def traced(self, *args, **kwargs):
        config = active()
        if config is None:
            return func(self, *args, **kwargs)
        with _call(config, func.__qualname__, inputs(self, args, kwargs)) as outputs:
            result = func(self, *args, **kwargs)
            outputs.append(_recorded(config, self, result))
        return result

    return traced


def _recorded(config: RolloutTraceConfig, owner: Any, result: Any) -> Any:
    """What the trace shows of ``result``: itself, or with token2text a copy of its fields plus the
    decoded ``prompt_text`` / ``response_text`` (the caller still gets the untouched result)."""
    decode = getattr(getattr(owner, "tokenizer", None), "decode", None)
    if not (config.token2text and decode and hasattr(result, "prompt_ids")):
        return result
    fields = result.model_dump() if hasattr(result, "model_dump") else dict(vars(result))
    fields["prompt_text"] = decode(result.prompt_ids)
    if hasattr(result, "response_ids"):
        fields["response_text"] = decode(result.response_ids)
    return fields


@contextlib.contextmanager
def _call(config: RolloutTraceConfig, op: str, inputs: dict[str, Any]):
    """One traced call on the back end: started here, finished with the output the body appends to
    the yielded list, or with the exception it raised (which goes on up)."""
    outputs: list[Any] = []
    if config.backend == "mlflow":
        with config.client.start_span(name=op) as span:  # the span records an exception itself
            span.set_inputs(inputs)
            yield outputs
            span.set_outputs(outputs[0])
        return
    client = config.client
    handle = client.create_call(op=op, inputs=inputs, attributes=dict(_attributes.get()))
    token = _parent.set(handle.id) if isinstance(handle, _FileCall) else None  # calls made inside are its children
    try:
        yield outputs
    except BaseException as e:
        client.finish_call(handle, exception=e)
        raise
    finally:
        if token is not None:
            _parent.reset(token)
    client.finish_call(handle, output=outputs[0])


@dataclasses.dataclass
class _FileCall:
    id: int
    record: dict[str, Any]


class _FileClient:
    """The ``file`` back end: weave's ``create_call`` / ``finish_call`` shape, each finished call appended
    to a JSON-lines file as one line (threads share the file; a lock keeps lines whole)."""

    def __init__(self, path: Path):
        self.path = path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def create_call(self, op: str, inputs: dict[str, Any], attributes: dict[str, Any]) -> _FileCall:
        call_id = next(self._ids)
        return _FileCall(call_id, {"id": call_id, "parent_id": _parent.get(), "op": op, "inputs": inputs,
                                   "attributes": attributes, "start": time.time()})

    def finish_call(self, call: _FileCall, output: Any = None, exception: BaseException | None = None) -> None:
        record = {**call.record, "end": time.time(), "output": output,
                  "exception": None if exception is None else f"{type(exception).__name__}: {exception}"}
        line = json.dumps(record, default=_jsonable)
        with self._lock, self.path.open("a") as f:
            f.write(line + "\n")


def _jsonable(value: Any) -> Any:
    """JSON for what ``json`` cannot write itself: pydantic models and dataclasses by their fields,
    arrays and tensors as lists, anything else by its ``repr``."""
    if hasattr(value, "model_dump"):
        return value.model_dump()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)
