"""GSM8K scorer, verl-compatible signature.

``strict``: the answer is the number after the last ``####`` (the format the GSM8K reference
solutions and verl's prompt instruction use). ``flexible``: the last number anywhere in the text.
Thousands separators and ``$`` are dropped, and numbers compare by value (``18.00`` == ``18``),
which is what a grader means; verl compares the strings.

The values are verl's, types included: ``score`` / ``format_score`` as given, and the int ``0`` when no
answer is found (verl's GSM8K tool prints the value, so its text says ``reward=0`` there, ``reward=0.0``
for a wrong answer).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

# Only the tail matters for both methods; clipping keeps the regex linear on degenerate
# (very long, repetitive) generations.
_CLIP_CHARS = 400
_NUMBER = r"-?(?:\$\s*)?-?(?:[0-9][0-9,]*(?:\.[0-9]+)?|\.[0-9]+)"
_STRICT = re.compile(r"####\s*(" + _NUMBER + ")")
_ANY_NUMBER = re.compile(_NUMBER)


def normalize_number(text: str) -> Decimal | None:
    """``"$1,234.50"`` -> Decimal("1234.50"); anything that is not a plain number -> None."""
    cleaned = re.sub(r"[\s,$]", "", text).rstrip(".")
    try:
        value = Decimal(cleaned)
    except InvalidOperation:
        return None
    return value if value.is_finite() else None


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    """The raw answer string the method picks, or None when there is none."""
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    tail = solution_str[-_CLIP_CHARS:]
    pattern = _STRICT if method == "strict" else _ANY_NUMBER
    found = pattern.findall(tail)
    return found[-1] if found else None


def compute_score(
    solution_str: str,
    ground_truth: str,
    method: str = "strict",
    format_score: float = 0.0,
    score: float = 1.0,
) -> float:
    """``score`` if the extracted answer equals ``ground_truth`` by value, ``format_score`` if an
    answer was found but is wrong, ``0`` if none was found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0
    predicted, expected = normalize_number(answer), normalize_number(str(ground_truth))
    if predicted is not None and predicted == expected:
        return score
    return format_score
