"""Code rewards from unit tests: the response's program runs against the row's tests in the sandbox.

Rows (verl's code data sets: ``codecontests``, ``apps``, ``taco``, ``livecodebench``, ``codeforces``)
carry their tests in ``reward_model.ground_truth`` as JSON (a string or already decoded):

- standard input / output: ``{"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}``;
- call-based (APPS/TACO's ``fn_name``): ``{"fn_name": "add", "inputs": [[1, 2], ...], "outputs": [3, ...]}``
  (each input a list of arguments; an output may be wrapped in a one-element list, as APPS stores them).

The program is the response's last fenced code block (```python ... ``` or ``` ... ```), else the
whole response. Each test runs in its own sandboxed interpreter (``rlfoundry.sandbox.run_python``:
kernel namespaces and a seccomp filter — no processes, network, or files of the host — with CPU,
memory, output and wall-clock limits), so a loop, a crash, a fork or a memory blow-up fails that test
and nothing else; or, with ``sandbox_fusion_url`` (verl's ``reward_model.sandbox_fusion.url``), on
that SandboxFusion server. Outputs compare token by token after stripping (numbers within 1e-6 relative).

The score is the fraction of tests passed (``mode="fraction"``, verl's ``continuous=True``) or 1/0
(``mode="all"``, which stops at the first failure); a program that hits a limit (time, memory,
output) is not run on the remaining tests, which count as failed; the returned dict adds ``acc`` (all passed),
``passed``, ``total`` and ``reason`` (``passed``, ``no_code``, ``wrong_answer``, ``error``,
``timeout``, ``memory``, ``output_limit``, ``killed``, ``bad_tests``: the first failure's), which
reach ``reward_extra_info``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable

from rlfoundry.sandbox import SandboxLimits, SandboxResult
from rlfoundry.sandbox.fusion import executor

__all__ = ["CODE_DATA_SOURCES", "compute_score", "extract_code"]

CODE_DATA_SOURCES = ("codecontests", "apps", "taco", "livecodebench", "codeforces")
TEST_LIMITS = SandboxLimits(wall_time_s=6.0, cpu_time_s=4, memory_bytes=512 << 20, max_output_bytes=64 << 10)
MAX_TESTS = 16  # per response: a reward call must stay within the reward pool's per-sample timeout

# A program that ran into a limit once is not run again: its other tests count as failed (one looping
# program costs one wall-clock limit, not one per test).
_RESOURCE_FAILURES = frozenset({"timeout", "memory", "output_limit", "killed"})

_FENCE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)

# Call-based tests: the solution is imported as a module, the function (or Solution().method, as
# LeetCode-style solutions define it) called with the arguments; the result printed as JSON.
_CALL_HARNESS = """
import json, runpy, sys
_ns = runpy.run_path("solution.py", run_name="solution")
_name = {fn_name!r}
_fn = _ns.get(_name)
if _fn is None and "Solution" in _ns:
    _fn = getattr(_ns["Solution"](), _name)
if _fn is None:
    sys.exit(f"no function {{_name}} in the program")
print(json.dumps(_fn(*json.loads({args!r}))))
"""

_STDIN_HARNESS = """
import io, runpy, sys
sys.stdin = io.StringIO({stdin!r})
runpy.run_path("solution.py", run_name="__main__")
"""


def extract_code(response: str) -> str:
    """The last fenced code block of ``response``, else ``response`` itself (stripped)."""
    blocks = _FENCE.findall(response)
    return (blocks[-1] if blocks else response).strip()


def _load_tests(ground_truth: Any) -> dict[str, Any] | None:
    tests = json.loads(ground_truth) if isinstance(ground_truth, (str, bytes)) else ground_truth
    if not isinstance(tests, dict):
        return None
    inputs, outputs = tests.get("inputs"), tests.get("outputs")
    if not isinstance(inputs, list) or not isinstance(outputs, list) or len(inputs) != len(outputs) or not inputs:
        return None
    return tests


def _tokens_equal(got: str, want: str) -> bool:
    a, b = got.split(), want.split()
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if x == y:
            continue
        try:
            fx, fy = float(x), float(y)
        except ValueError:
            return False
        if not math.isclose(fx, fy, rel_tol=1e-6, abs_tol=1e-9):
            return False
    return True


def _call_output_equal(stdout: str, want: Any) -> bool:
    try:
        got = json.loads(stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return False
    if isinstance(want, list) and len(want) == 1 and got != want:
        want = want[0]  # APPS stores a call's expected value wrapped in a list
    return got == want or (isinstance(got, list) and isinstance(want, tuple) and got == list(want))


def _run_test(code: str, tests: dict[str, Any], i: int, limits: SandboxLimits,
              execute: Callable[[str, SandboxLimits], SandboxResult]) -> str:
    """``passed`` or the reason test ``i`` failed."""
    fn_name = tests.get("fn_name")
    if fn_name:
        harness = _CALL_HARNESS.format(fn_name=str(fn_name), args=json.dumps(tests["inputs"][i]))
    else:
        harness = _STDIN_HARNESS.format(stdin=str(tests["inputs"][i]))
    # the solution beside the harness, as a module file: its tracebacks name its own lines
    program = f"open('solution.py', 'w').write({code!r})\n{harness}"
    result = execute(program, limits)
    if not result.ok:
        return result.status
    want = tests["outputs"][i]
    same = _call_output_equal(result.stdout, want) if fn_name else _tokens_equal(result.stdout, str(want))
    return "passed" if same else "wrong_answer"


def compute_score(solution_str: str, ground_truth: Any, extra_info: dict | None = None, mode: str = "fraction",
                  limits: SandboxLimits = TEST_LIMITS, max_tests: int = MAX_TESTS,
                  sandbox_fusion_url: str | None = None, memory_limit_mb: int | None = None,
                  max_concurrent: int = 64, **_: Any) -> dict[str, Any]:
    """Run the response's program against the row's tests; see the module docstring."""
    if mode not in ("fraction", "all"):
        raise ValueError(f"code reward mode must be 'fraction' or 'all', got {mode!r}")
    try:
        tests = _load_tests(ground_truth)
    except ValueError:
        tests = None
    if tests is None:
        return {"score": 0.0, "acc": False, "passed": 0, "total": 0, "reason": "bad_tests"}
    total = min(len(tests["inputs"]), max_tests)
    code = extract_code(solution_str)
    if not code:
        return {"score": 0.0, "acc": False, "passed": 0, "total": total, "reason": "no_code"}
    passed, reason = 0, "passed"
    execute = executor(sandbox_fusion_url, memory_limit_mb, max_concurrent)
    for i in range(total):
        outcome = _run_test(code, tests, i, limits, execute)
        if outcome == "passed":
            passed += 1
            continue
        reason = reason if reason != "passed" else outcome
        if mode == "all" or outcome in _RESOURCE_FAILURES:
            break
    score = passed / total if mode == "fraction" else float(passed == total)
    return {"score": score, "acc": passed == total, "passed": passed, "total": total, "reason": reason}
