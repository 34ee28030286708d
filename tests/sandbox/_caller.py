"""The attacked caller: a process that runs programs through one of the three entry points that run
untrusted code, one JSON request per line on stdin, one JSON answer per line on stdout. Attacks aim at
this process (its pid is their parent's), so the test process itself is never at risk."""

from __future__ import annotations

import asyncio
import json
import sys

from rlfoundry.rewards.code import compute_score
from rlfoundry.sandbox import SandboxLimits, run_python
from rlfoundry.tools.code_interpreter import CodeInterpreterTool
from rlfoundry.tools.schemas import OpenAIFunctionToolSchema

LIMITS = SandboxLimits(wall_time_s=3.0, cpu_time_s=1, memory_bytes=512 << 20, max_output_bytes=16384)
_SCHEMA = OpenAIFunctionToolSchema.model_validate({"type": "function", "function": {
    "name": "code_interpreter", "description": "run", "parameters": {"type": "object", "properties": {
        "code": {"type": "string", "description": "program"}}, "required": ["code"]}}})
TOOL = CodeInterpreterTool({"wall_time_s": 3.0, "cpu_time_s": 1, "memory_mb": 512, "max_output_bytes": 16384}, _SCHEMA)


def _said_escaped(text: str) -> bool:
    return "ESCAPED" in (text or "").splitlines()  # a line of its own: a traceback quoting the source is not one


def run(entry: str, code: str) -> dict:
    """``escaped``: the program reported that its privileged action succeeded (it prints ESCAPED)."""
    if entry == "run_python":
        r = run_python(code, LIMITS)
        return {"escaped": _said_escaped(r.stdout), "status": r.status, "stderr": r.stderr[-400:]}
    if entry == "tool":
        response, _, metrics = asyncio.run(TOOL.execute("i0", {"code": code}))
        return {"escaped": _said_escaped(response.text), "status": metrics.get("status")}
    # the code reward: a test that passes only if the program printed ESCAPED
    out = compute_score(f"```python\n{code}\n```", {"inputs": [""], "outputs": ["ESCAPED"]}, limits=LIMITS)
    return {"escaped": out["passed"] > 0, "status": out["reason"]}


for line in sys.stdin:
    request = json.loads(line)
    try:
        answer = run(request["entry"], request["code"])
    except Exception as e:  # noqa: BLE001 - the entry point raised: the test counts that as harm
        answer = {"raised": f"{type(e).__name__}: {e}"}
    print(json.dumps(answer), flush=True)
