"""``rollout_trace_op`` / ``rollout_trace_attr`` / ``RolloutTraceConfig`` (verl's contract): a no-op
without a back end; with one, one record per call with its inputs by name, its output or exception,
the enclosing attributes and its parent call; ``trace=False`` records nothing."""

from __future__ import annotations

import asyncio
import inspect
import json
import sys
import types
from dataclasses import dataclass

import pytest

from rlfoundry.utils.rollout_trace import RolloutTraceConfig, rollout_trace_attr, rollout_trace_op


@pytest.fixture(autouse=True)
def _fresh_config():
    RolloutTraceConfig.reset()
    yield
    RolloutTraceConfig.reset()


@dataclass
class _Output:
    prompt_ids: list[int]
    response_ids: list[int]


class _Tokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


class Traced:
    tokenizer = _Tokenizer()

    @rollout_trace_op
    async def inner(self, a, b="default"):
        return f"result: {a}, {b}"

    @rollout_trace_op
    async def outer(self, a):
        await self.inner("x", b="y")
        return a * 2

    @rollout_trace_op
    async def fails(self):
        raise ValueError("broken")

    @rollout_trace_op
    def sync(self, n, *, scale=3):
        return n * scale

    @rollout_trace_op
    async def generate(self):
        return _Output([0, 1], [2])


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_without_a_backend_the_methods_run_unchanged(tmp_path):
    t = Traced()
    assert asyncio.run(t.outer(21)) == 42 and t.sync(2) == 6
    assert list(inspect.signature(Traced.inner).parameters) == ["self", "a", "b"]  # wraps keeps the signature
    assert inspect.iscoroutinefunction(Traced.inner) and not inspect.iscoroutinefunction(Traced.sync)
    with rollout_trace_attr(step=1, sample_index=0, trace=False):  # no back end: nothing to switch off
        assert asyncio.run(t.inner(1)) == "result: 1, default"
    assert RolloutTraceConfig.get_backend() is None and RolloutTraceConfig.get_client() is None


def test_the_file_backend_records_calls_nesting_attributes_and_exceptions(tmp_path):
    path = tmp_path / "trace" / "calls.jsonl"
    RolloutTraceConfig.init("proj", "exp", "file", path=path)
    t = Traced()

    async def trajectory():
        with rollout_trace_attr(sample_index=7, step=3, rollout_n=1):
            assert await t.outer(5) == 10
            with pytest.raises(ValueError, match="broken"):
                await t.fails()
            with rollout_trace_attr(step=4, trace=False):
                await t.inner("hidden")
        await t.inner("bare")

    asyncio.run(trajectory())
    assert t.sync(2, scale=5) == 10
    inner, outer, fails, bare, sync = _records(path)  # each written when it finishes: inner before outer
    tags = {"sample_index": 7, "step": 3, "rollout_n": 1, "validate": False, "experiment_name": "exp"}
    assert (inner["op"], inner["inputs"], inner["output"], inner["attributes"]) == (
        "Traced.inner", {"a": "x", "b": "y"}, "result: x, y", tags)
    assert (outer["op"], outer["inputs"], outer["output"], outer["parent_id"]) == ("Traced.outer", {"a": 5}, 10, None)
    assert inner["parent_id"] == outer["id"] and fails["parent_id"] is None
    assert (fails["exception"], fails["output"]) == ("ValueError: broken", None)
    assert (bare["inputs"], bare["attributes"]) == ({"a": "bare", "b": "default"}, {})  # defaults applied; outside: no tags
    assert (sync["op"], sync["inputs"], sync["output"]) == ("Traced.sync", {"n": 2, "scale": 5}, 10)
    assert all(r["start"] <= r["end"] for r in (inner, outer, fails, bare, sync))


def test_token2text_adds_the_decoded_ids_to_the_record_not_to_the_result(tmp_path):
    path = tmp_path / "t.jsonl"
    RolloutTraceConfig.init("p", "e", "file", token2text=True, path=path)
    result = asyncio.run(Traced().generate())
    assert result == _Output([0, 1], [2])  # the caller gets its object back untouched
    [record] = _records(path)
    assert record["output"] == {"prompt_ids": [0, 1], "response_ids": [2], "prompt_text": "ab", "response_text": "c"}


def test_weave_backend_creates_and_finishes_calls_as_verl_does(monkeypatch):
    calls = []

    class Client:
        def create_call(self, op, inputs, attributes):
            calls.append(("create", op, inputs, attributes))
            return len(calls)

        def finish_call(self, call, output=None, exception=None):
            calls.append(("finish", call, output, type(exception).__name__ if exception else None))

    weave = types.ModuleType("weave")
    weave.init = lambda project: calls.append(("init", project)) or Client()
    weave.attributes = lambda attributes: __import__("contextlib").nullcontext()
    monkeypatch.setitem(sys.modules, "weave", weave)
    RolloutTraceConfig.init("proj", "exp", "weave")
    RolloutTraceConfig.init("other", "other", "file")  # a second init is ignored, as in verl
    assert RolloutTraceConfig.get_backend() == "weave"

    async def run():
        with rollout_trace_attr(step=2):
            await Traced().inner("a")
            with pytest.raises(ValueError):
                await Traced().fails()

    asyncio.run(run())
    tags = {"step": 2, "validate": False, "experiment_name": "exp"}
    assert calls == [("init", "proj"), ("create", "Traced.inner", {"a": "a", "b": "default"}, tags),
                     ("finish", 2, "result: a, default", None), ("create", "Traced.fails", {}, tags),
                     ("finish", 4, None, "ValueError")]


def test_unknown_or_missing_backends_are_errors_that_say_what_to_do(monkeypatch):
    with pytest.raises(ValueError, match=r"'dummy' is not one of \['weave', 'mlflow', 'file'\]"):
        RolloutTraceConfig.init("p", "e", "dummy")
    monkeypatch.setitem(sys.modules, "mlflow", None)  # makes `import mlflow` raise ImportError
    with pytest.raises(ImportError, match="pip install mlflow"):
        RolloutTraceConfig.init("p", "e", "mlflow")
    assert RolloutTraceConfig.get_backend() is None  # a failed init leaves tracing off
