"""verl's retrieval tool (``verl.tools.search_tool.SearchTool``, Search-R1's): the model sends
``query_list`` and gets the top passages of each query from a retrieval service over HTTP.

The service's API (Search-R1's ``retrieval_server``): ``POST retrieval_service_url`` with
``{"queries": [...], "topk": k, "return_scores": true}`` → ``{"result": [[{"document": {"contents":
"title\\ntext"}, "score": s}, ...] per query]}``. The answer is verl's text: a JSON object whose
``result`` is, per query, ``Doc i (Title: title)\\ntext`` blocks, queries separated by ``\\n---\\n``
(or the error / "No search results found."); metrics ``query_count``, ``status``, ``total_results``,
``api_request_error``.

Config (verl's keys): ``retrieval_service_url`` (required), ``topk`` (3), ``timeout`` (30 s per request),
``rate_limit`` with ``enable_global_rate_limit`` (else ``num_workers``): requests in flight at once, per
process; rlfoundry's ``max_retries`` (3): 5xx answers, timeouts and refused connections are retried after
1, 2, … s (verl retries 10 times, longer than the agent loop's ``tool_timeout_s`` waits).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import urllib.error
import urllib.request
from typing import Any

from rlfoundry.tools.base import BaseTool
from rlfoundry.tools.registry import ToolConfigError
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["SearchTool", "format_passages", "search"]


def _result(text: str) -> str:
    return json.dumps({"result": text}, ensure_ascii=False)


class SearchTool(BaseTool):
    """``search(query_list)`` → the passages, as verl's tool answers."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema):
        super().__init__(config, tool_schema)
        c = self.config
        self.url = c.get("retrieval_service_url")
        if not self.url:
            raise ToolConfigError("SearchTool needs config.retrieval_service_url (the retrieval service's "
                                  "/retrieve endpoint, e.g. http://127.0.0.1:8000/retrieve)")
        self.topk, self.timeout = int(c.get("topk", 3)), float(c.get("timeout", 30))
        self.max_retries = int(c.get("max_retries", 3))
        at_once = c.get("rate_limit", 120) if c.get("enable_global_rate_limit", True) else c.get("num_workers", 120)
        self._slots = threading.BoundedSemaphore(int(at_once))

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> tuple[ToolResponse, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=_result("Error: 'query_list' is missing, empty, or not a list in parameters.")), 0.0, {}
        text, metrics = await asyncio.to_thread(self._search, [str(q) for q in queries])
        return ToolResponse(text=text), 0.0, metrics

    def _search(self, queries: list[str]) -> tuple[str, dict]:
        with self._slots:
            answer, error = search(self.url, queries, self.topk, self.timeout, self.max_retries)
        metrics = {"query_count": len(queries), "status": "api_error", "total_results": 0, "api_request_error": error}
        if error is not None:
            return _result(f"Search error: {error}"), metrics
        results = answer.get("result") if isinstance(answer, dict) else None
        if not results:
            return _result("No search results found."), {**metrics, "status": "no_results"}
        try:
            text = "\n---\n".join(format_passages(r) for r in results)
        except (KeyError, TypeError, AttributeError) as e:
            return _result(f"Error processing search results: {e!r}"), {**metrics, "status": "processing_error"}
        total = sum(len(r) if isinstance(r, list) else 1 for r in results)
        return _result(text), {**metrics, "status": "success", "total_results": total}


def format_passages(passages: list[dict]) -> str:
    """``Doc i (Title: first line)\\nthe other lines`` per passage, blank lines between (verl's layout)."""
    blocks = []
    for i, passage in enumerate(passages, 1):
        title, _, text = passage["document"]["contents"].partition("\n")
        blocks.append(f"Doc {i} (Title: {title})\n{text}")
    return "\n\n".join(blocks).strip()


def search(url: str, queries: list[str], topk: int, timeout: float, max_retries: int) -> tuple[Any, str | None]:
    """``(the service's JSON answer, None)`` or ``(None, what went wrong)``; each request under ``timeout``."""
    body = json.dumps({"queries": queries, "topk": topk, "return_scores": True}).encode()
    error = "no request made"
    for attempt in range(max(1, max_retries)):
        request = urllib.request.Request(url, data=body, method="POST",
                                         headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return json.loads(response.read()), None
        except urllib.error.HTTPError as e:
            error = f"the retrieval service answered HTTP {e.code} ({url})"
            if e.code < 500:
                break  # the request itself is wrong: asking again changes nothing
        except json.JSONDecodeError as e:
            return None, f"the retrieval service's answer is not JSON ({e.msg}; {url})"
        except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timed out
            error = f"cannot reach the retrieval service at {url}: {getattr(e, 'reason', e)}"
        if attempt + 1 < max_retries:
            time.sleep(attempt + 1)
    return None, error
