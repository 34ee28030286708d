"""MATH scorer: math-verify decides whether the response's final answer equals the ground truth.

math-verify parses both sides to sympy and compares them, so ``0.5`` matches ``\\frac{1}{2}``,
``\\dfrac`` and ``\\frac`` are the same, ``2\\sqrt{2}`` matches ``\\sqrt{8}``, intervals and sets
compare as sets, and units / ``^\\circ`` / ``\\$`` are stripped. The response's ``\\boxed{}``
answer wins over any other number in the text (verl's prompt asks for ``\\boxed{}``).

Also here: ``last_boxed_only_string`` / ``remove_boxed``, used by preprocessing to take the ground
truth from a MATH reference solution.
"""

from __future__ import annotations

import threading

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

# math-verify's own timeouts use SIGALRM, which only the main thread may set; elsewhere we pass
# None and rely on the reward pool's per-sample timeout instead.
_MATH_VERIFY_TIMEOUT_S = 5
_GOLD_CONFIG = [LatexExtractionConfig()]
_PRED_CONFIG = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]
_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced) or ``\\boxed 5`` in ``text``; None if absent."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    command = next(cmd for cmd in _BOX_COMMANDS if text.startswith(cmd, start))
    after = start + len(command)
    if text.startswith(" ", after):  # "\boxed 5": the argument runs to the next space or "$"
        end = after + 1
        while end < len(text) and text[end] not in " $":
            end += 1
        return text[start:end]
    if not text.startswith("{", after):
        return None
    depth = 0
    for i in range(after, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start : i + 1]
    return None  # unbalanced: the generation was cut off inside the box


def remove_boxed(boxed: str) -> str:
    """``\\boxed{x}`` -> ``x`` (also ``\\fbox{x}`` and ``\\boxed x``)."""
    for command in _BOX_COMMANDS:
        if boxed.startswith(command + " "):
            return boxed[len(command) + 1 :]
        if boxed.startswith(command + "{") and boxed.endswith("}"):
            return boxed[len(command) + 1 : -1]
    raise ValueError(f"not a boxed expression: {boxed[:80]!r}")


def _timeout() -> int | None:
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def math_verify_equal(solution_str: str, ground_truth: str) -> bool:
    """math-verify's verdict: the response's final answer equals ``ground_truth`` mathematically."""
    timeout = _timeout()
    gold = parse("\\boxed{" + ground_truth + "}", _GOLD_CONFIG, parsing_timeout=timeout)
    if not gold:  # not LaTeX math (e.g. a bare expression): let math-verify try every extractor
        gold = parse(ground_truth, parsing_timeout=timeout)
    pred = parse(solution_str, _PRED_CONFIG, parsing_timeout=timeout)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=timeout))


def compute_score(solution_str: str, ground_truth: str) -> float:
    """1.0 if the response's final answer is mathematically equal to ``ground_truth``, else 0.0."""
    ground_truth = str(ground_truth).strip()
    boxed = last_boxed_only_string(solution_str)
    if boxed is not None and remove_boxed(boxed).strip() == ground_truth:
        return 1.0  # the common exact case, without sympy
    return 1.0 if math_verify_equal(solution_str, ground_truth) else 0.0
