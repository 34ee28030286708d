"""DAPO's math scorer (verl's ``verl.utils.reward_score.math_dapo``): +1 / -1 with the verdict and the
answer read, ``{"score", "acc", "pred"}``.

Two ways to read the answer, as DAPO's recipes use them:

- default (Minerva): the last ``Answer: ...`` line of the response's last 300 characters, and the
  ground truth, both put through Minerva's answer normalisation (Lewkowycz et al. 2022, appendix D:
  the text after the last ``=``, units and filler words dropped, ``$...$`` / ``\\text{}`` /
  ``\\boxed{}`` unwrapped, ``\\frac12`` as ``\\frac{1}{2}``, ``1,000`` as ``1000``) and compared as
  strings. No answer line reads as ``[INVALID]``.
- ``strict_box_verify=True``: the last ``\\boxed{...}`` in the response's last 100 characters (from
  ``pause_tokens_index[-1] - 100`` when given) must equal the ground truth exactly; ``pred`` is the
  box's content, or None without one.

Unlike ``rewards.math`` (math-verify, 1.0 / 0.0), nothing here parses mathematics: ``0.5`` and
``\\frac{1}{2}`` differ, as they do for the recipes trained with it.
"""

from __future__ import annotations

import re

__all__ = ["compute_score", "is_correct_minerva", "is_correct_strict_box", "last_boxed_only_string",
           "normalize_final_answer", "remove_boxed", "verify"]

_WINDOW = 300  # characters of the response read at all (the longest MATH-500 answer is 159)
_STRICT_WINDOW = 100  # characters searched for the box in strict mode
_INVALID = "[INVALID]"
_BOX = "\\boxed{"

# Minerva's normalisation tables: literal replacements in order, then fragments deleted.
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_DELETE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue",
           "points", "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals",
           "edges", "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}",
           "\\text{}^2", "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;",
           ",\\!", "{,}", '"', "\\dots")
# Then, in order: keep the first $...$ span's math; unwrap \text, \textbf, \overline (first closing
# brace) and \boxed (last closing brace); spell out \fracab and \sqrta.
_REWRITE = tuple((re.compile(p), r) for p, r in (
    (r"(.*?)(\$)(.*?)(\$)(.*)", r"$\3$"),
    (r"(\\text\{)(.*?)(\})", r"\2"),
    (r"(\\textbf\{)(.*?)(\})", r"\2"),
    (r"(\\overline\{)(.*?)(\})", r"\2"),
    (r"(\\boxed\{)(.*)(\})", r"\2"),
    (r"(frac)([^{])(.)", r"frac{\2}{\3}"),
    (r"(sqrt)([^{])", r"sqrt{\2}"),
))


def last_boxed_only_string(text: str) -> str | None:
    """The last ``\\boxed{...}`` in ``text`` with its braces balanced, or None (none, or cut off inside)."""
    start = text.rfind(_BOX)
    if start < 0:
        return None
    depth = 0
    for end in range(start + len(_BOX) - 1, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            return text[start:end + 1]
    return None


def remove_boxed(boxed: str) -> str:
    if not (boxed.startswith(_BOX) and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{...}} expression: {boxed[:80]!r}")
    return boxed[len(_BOX):-1]


def normalize_final_answer(answer: str) -> str:
    """Minerva's normal form of a final answer (module docstring)."""
    answer = answer.split("=")[-1]
    for old, new in _REPLACE:
        answer = answer.replace(old, new)
    for fragment in _DELETE:
        answer = answer.replace(fragment, "")
    for pattern, replacement in _REWRITE:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def is_correct_minerva(solution_str: str, gt: str, gt_need_extract: bool = False,
                       answer_pattern: str = r"(?i)Answer\s*:\s*([^\n]+)") -> tuple[bool, str]:
    """(the normalised last answer line equals the normalised ground truth, that answer)."""
    found = re.findall(answer_pattern, solution_str)
    pred = normalize_final_answer(found[-1] if found else _INVALID)
    if gt_need_extract:  # a reference solution: its boxed answer
        gt = remove_boxed(last_boxed_only_string(gt) or "")
    return pred == normalize_final_answer(gt), pred


def is_correct_strict_box(pred: str, gt: str, pause_tokens_index: list[int] | None = None) -> tuple[int, str | None]:
    """(1 if the last box near the end holds exactly ``gt`` else -1, the box's content or None)."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 indices, got {pause_tokens_index}")
        tail = pred[pause_tokens_index[-1] - _STRICT_WINDOW:]
    else:
        tail = pred[-_STRICT_WINDOW:]
    boxed = last_boxed_only_string(tail)
    content = remove_boxed(boxed) if boxed is not None else None
    return (1 if content == gt else -1), content


def verify(solution_str: str, answer: str, strict_box_verify: bool = False,
           pause_tokens_index: list[int] | None = None) -> tuple[bool, str | None]:
    if strict_box_verify:
        verdict, pred = is_correct_strict_box(solution_str, answer, pause_tokens_index)
        return verdict == 1, pred
    return is_correct_minerva(solution_str, answer)


def compute_score(solution_str: str, ground_truth: str, strict_box_verify: bool = False,
                  pause_tokens_index: list[int] | None = None) -> dict:
    """``{"score": 1.0 or -1.0, "acc": bool, "pred": the answer read}`` for the response's end."""
    correct, pred = verify(solution_str[-_WINDOW:], ground_truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
