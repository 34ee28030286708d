"""verl's tool classes other than GSM8K, loaded from verl-layout tool configs by their verl class names:
Geo3K's answer check, SandboxFusion code execution (this machine's sandbox, or a server), Search-R1's
retrieval client against a local HTTP server; the ones not built are start-up errors with the reason.
Expected texts are derived by hand from verl's tool code (verl/tools/*.py at b178a3cd5)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from rlfoundry.tools.geo3k import Geo3kTool
from rlfoundry.tools.parser import ParsedCall
from rlfoundry.tools.registry import ToolConfigError, initialize_tools_from_config
from rlfoundry.tools.runner import ToolCall, run_tool_calls
from rlfoundry.tools.sandbox_fusion import SandboxFusionTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse
from rlfoundry.tools.search import SearchTool


def _run(coro):
    return asyncio.run(coro)


def _schema(name: str, **properties: str) -> dict:
    return {"type": "function", "function": {"name": name, "description": name, "parameters": {
        "type": "object", "properties": {k: {"type": t} for k, t in properties.items()}, "required": list(properties)}}}


def _config(tmp_path, class_name: str, config: dict, schema: dict | None) -> Any:
    """A one-tool config in verl's layout (written here, not copied from verl)."""
    entry = {"class_name": class_name, "config": {"type": "native", **config}}
    if schema is not None:
        entry["tool_schema"] = schema
    path = tmp_path / "tools.yaml"
    path.write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
    return path


# ---- Geo3K -------------------------------------------------------------------------------------


def test_geo3k_tool_loads_by_verls_name_and_scores_answers_by_value(tmp_path):
    path = _config(tmp_path, "verl.tools.geo3k_tool.Geo3kTool", {}, _schema("calc_geo3k_reward", answer="string"))
    [tool] = initialize_tools_from_config(path)
    assert type(tool) is Geo3kTool and tool.name == "calc_geo3k_reward"
    instance, _ = _run(tool.create(create_kwargs={"ground_truth": "2\\sqrt{3}"}))
    # verl: f"Current parsed {answer=} {reward=}", reward 1.0 / 0.0 (format_score 0), step 0.0 on a rise else -0.05
    calls = [("3", 0.0, -0.05), ("2\\sqrt{3}", 1.0, 0.0), ("\\sqrt{12}", 1.0, -0.05), ("", 0.0, -0.05)]
    for answer, reward, step in calls:
        response, got_step, metrics = _run(tool.execute(instance, {"answer": answer}))
        assert (response.text, got_step, metrics) == (f"Current parsed answer={answer!r} reward={reward!r}", step, {})
    assert _run(tool.calc_reward(instance)) == 0.0  # the last answer's score
    other, _ = _run(tool.create(ground_truth="60"))  # the keyword spelling (verl's SGLang rollout)
    assert _run(tool.execute(other, {"answer": "60"}))[0].text == "Current parsed answer='60' reward=1.0"


# ---- SandboxFusion -----------------------------------------------------------------------------


def _fusion(tmp_path, **config) -> SandboxFusionTool:
    path = _config(tmp_path, "verl.tools.sandbox_fusion_tools.SandboxFusionTool", config,
                   _schema("code_interpreter", code="string"))
    [tool] = initialize_tools_from_config(path)
    assert type(tool) is SandboxFusionTool and tool.name == "code_interpreter"
    return tool


def test_sandbox_fusion_tool_answers_verls_text_from_this_machines_sandbox(tmp_path):
    tool = _fusion(tmp_path, default_timeout=5, memory_limit_mb=512)
    ok, reward, _ = _run(tool.execute("i", {"code": "print(sum(range(101)))"}))
    assert (ok.text, reward) == ("5050\n", 0.0)
    # a program that fails still "Finished": stdout then stderr, as verl joins them
    failed, _, _ = _run(tool.execute("i", {"code": "print('before')\n1/0"}))
    assert failed.text.startswith("before\nTraceback") and failed.text.rstrip().endswith("ZeroDivisionError: division by zero")
    # the call's own timeout (verl reads it from the arguments), below the configured 5 s
    start = time.monotonic()
    slow, _, _ = _run(tool.execute("i", {"code": "while True:\n    pass", "timeout": 1}))
    assert slow.text == "no stdout here" and time.monotonic() - start < 4
    assert tool._limits(1e9).wall_time_s == 5.0 and tool._limits("9").wall_time_s == 5.0  # never above the config
    cpp, _, _ = _run(tool.execute("i", {"code": "int main(){}", "language": "cpp"}))
    assert cpp.text == "error: language 'cpp' cannot run here; only python"
    assert _run(tool.calc_reward("i")) == 0.0
    with pytest.raises(ToolConfigError, match="default_language='cpp' cannot run here"):
        _fusion(tmp_path, default_language="cpp")


class _RecipeTool(SandboxFusionTool):
    """recipe/retool's CustomSandboxFusionTool, its imports changed: it calls verl's pool and execute_code."""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[str, float, dict]:
        code = parameters["code"].split("```python")[-1].split("```")[0].strip()
        lines = code.split("\n")
        if not lines[-1].startswith("print"):
            lines[-1] = f"print({lines[-1]})"
        timeout = parameters.get("timeout", self.default_timeout)
        result = await self.execution_pool.execute.remote(self.execute_code, instance_id, "\n".join(lines), timeout,
                                                          self.default_language)
        return result, None, None


def test_a_recipe_subclass_runs_through_verls_pool_and_execute_code():
    tool = _RecipeTool({"type": "native", "default_timeout": 5}, OpenAIFunctionToolSchema.model_validate(
        _schema("code_interpreter", code="string")))
    [result] = run_tool_calls({"code_interpreter": tool}, [ToolCall("i", ParsedCall("code_interpreter", {
        "code": "```python\nx = 6\nx * 7\n```"}))], 1, 10.0)
    assert (result.text, result.reward, result.error) == ("42\n", 0.0, None)  # None reward/metrics: 0.0, {}


class _Canned(BaseHTTPRequestHandler):
    """A server that answers every POST with ``answers[path]`` (status, JSON body) after ``delay`` s, and
    records the request bodies."""

    answers: dict[str, list[tuple[int, Any]]] = {}
    seen: list[dict] = []
    delay = 0.0

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).seen.append(body)
        time.sleep(self.delay)
        queue = self.answers[self.path]
        status, answer = queue.pop(0) if len(queue) > 1 else queue[0]
        data = json.dumps(answer).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client stopped waiting (the timeout test)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    _Canned.answers, _Canned.seen, _Canned.delay = {}, [], 0.0
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Canned)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_sandbox_fusion_tool_on_a_server(tmp_path, server):
    _Canned.answers["/run_code"] = [(200, {"status": "Failed", "run_result": {
        "status": "TimeLimitExceeded", "stdout": "partial", "stderr": "", "return_code": None}})]
    tool = _fusion(tmp_path, sandbox_fusion_url=server + "/run_code", default_timeout=7, memory_limit_mb=256)
    response, _, _ = _run(tool.execute("i", {"code": "while True: pass"}))
    assert response.text == "no stdout here"  # verl: any run status but Finished
    assert _Canned.seen[0]["run_timeout"] == 7.0 and _Canned.seen[0]["memory_limit_MB"] == 256
    _Canned.answers["/run_code"] = [(200, {"status": "Failed", "run_result": {
        "status": "Finished", "stdout": "out\n", "stderr": "err\n", "return_code": 1}})]
    assert _run(tool.execute("i", {"code": "x"}))[0].text == "out\nerr\n"


# ---- Search ------------------------------------------------------------------------------------


def _search_tool(tmp_path, url: str, **config) -> SearchTool:
    schema = _schema("search", query_list="array")
    schema["function"]["parameters"]["properties"]["query_list"]["items"] = {"type": "string"}
    [tool] = initialize_tools_from_config(_config(tmp_path, "verl.tools.search_tool.SearchTool",
                                                  {"retrieval_service_url": url, **config}, schema))
    assert type(tool) is SearchTool and tool.name == "search"
    return tool


def _doc(contents: str, score: float) -> dict:
    return {"document": {"id": "x", "contents": contents}, "score": score}


def test_search_tool_formats_the_passages_of_each_query_as_verl_does(tmp_path, server):
    _Canned.answers["/retrieve"] = [(200, {"result": [[_doc("Paris\nCapital of France.", 0.9),
                                                       _doc("Lyon\nCity.\nSecond line.", 0.5)],
                                                      [_doc("Berlin\nCapital of Germany.", 0.8)]]})]
    tool = _search_tool(tmp_path, server + "/retrieve", topk=2, timeout=5)
    response, reward, metrics = _run(tool.execute("i", {"query_list": ["capital of france", "capital of germany"]}))
    assert _Canned.seen == [{"queries": ["capital of france", "capital of germany"], "topk": 2, "return_scores": True}]
    expected = ("Doc 1 (Title: Paris)\nCapital of France.\n\nDoc 2 (Title: Lyon)\nCity.\nSecond line."
                "\n---\nDoc 1 (Title: Berlin)\nCapital of Germany.")
    assert json.loads(response.text) == {"result": expected} and reward == 0.0
    assert metrics == {"query_count": 2, "status": "success", "total_results": 3, "api_request_error": None}
    _Canned.answers["/retrieve"] = [(200, {"result": []})]
    response, _, metrics = _run(tool.execute("i", {"query_list": ["nothing"]}))
    assert json.loads(response.text) == {"result": "No search results found."} and metrics["status"] == "no_results"
    bad, _, _ = _run(tool.execute("i", {"query_list": "not a list"}))
    assert json.loads(bad.text) == {"result": "Error: 'query_list' is missing, empty, or not a list in parameters."}


def test_search_tool_retries_server_errors_and_gives_up_on_timeouts(tmp_path, server):
    _Canned.answers["/retrieve"] = [(503, {}), (200, {"result": [[_doc("T\nbody", 1.0)]]})]
    tool = _search_tool(tmp_path, server + "/retrieve", max_retries=2, timeout=5)
    response, _, _ = _run(tool.execute("i", {"query_list": ["q"]}))
    assert json.loads(response.text) == {"result": "Doc 1 (Title: T)\nbody"} and len(_Canned.seen) == 2
    _Canned.answers["/retrieve"] = [(404, {})]  # a client error is not retried
    response, _, metrics = _run(tool.execute("i", {"query_list": ["q"]}))
    assert "HTTP 404" in json.loads(response.text)["result"] and len(_Canned.seen) == 3
    assert metrics["status"] == "api_error"
    _Canned.delay = 1.0
    slow = _search_tool(tmp_path, server + "/retrieve", max_retries=1, timeout=0.2)
    start = time.monotonic()
    response, _, metrics = _run(slow.execute("i", {"query_list": ["q"]}))
    assert time.monotonic() - start < 0.9  # the request's timeout, not the server's pace
    assert json.loads(response.text)["result"].startswith("Search error: cannot reach the retrieval service")
    assert "timed out" in metrics["api_request_error"]
    with pytest.raises(ToolConfigError, match="retrieval_service_url"):
        _search_tool(tmp_path, "")


# ---- what is not built -------------------------------------------------------------------------


def test_verl_tools_that_cannot_run_here_are_start_up_errors_with_the_reason(tmp_path):
    zoom = _config(tmp_path, "verl.tools.image_zoom_in_tool.ImageZoomInTool", {}, _schema("zoom", bbox_2d="array"))
    with pytest.raises(ToolConfigError, match="ImageZoomInTool cannot run here: it answers with an image"):
        initialize_tools_from_config(zoom)
    mcp = tmp_path / "mcp.yaml"
    mcp.write_text(json.dumps({"tools": [{"class_name": "verl.tools.mcp_search_tool.MCPSearchTool",
                                          "config": {"type": "mcp", "rate_limit": 1},
                                          "mcp": {"mcp_servers_config_path": "./mcp_server.json"}}]}))
    with pytest.raises(ToolConfigError, match="MCPSearchTool.*mcp / fastmcp client"):
        initialize_tools_from_config(mcp)
    other = _config(tmp_path, "verl.tools.my_tool.MyTool", {}, _schema("mine"))
    with pytest.raises(ToolConfigError, match="not one of verl's tools that rlfoundry provides.*SearchTool"):
        initialize_tools_from_config(other)


def test_an_image_answer_is_an_error_not_a_silently_dropped_image():
    class Zoom(SandboxFusionTool):
        async def execute(self, instance_id, parameters, **kwargs):
            return ToolResponse(text="zoomed", image=["<an image>"]), 0.0, {}

    tool = Zoom({"type": "native"}, OpenAIFunctionToolSchema.model_validate(_schema("zoom")))
    [result] = run_tool_calls({"zoom": tool}, [ToolCall("i", ParsedCall("zoom", {}))], 1, 5.0)
    assert result.error == "image_answer" and "cannot show the model" in result.text


def test_a_tool_module_importing_a_verl_module_rlfoundry_lacks_is_told_which(tmp_path, monkeypatch):
    (tmp_path / "my_recipe_tool.py").write_text("from verl.tools.mcp_base_tool import MCPBaseTool\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = _config(tmp_path, "my_recipe_tool.CustomTool", {}, _schema("code_interpreter", code="string"))
    with pytest.raises(ToolConfigError, match=r"cannot be imported: verl\.tools\.mcp_base_tool \(imported by "
                                              r".*my_recipe_tool\.py:1\) has no counterpart in rlfoundry"):
        initialize_tools_from_config(path)
