"""docs/errors.md must match the tests: every test it names exists, and every case has a row."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "errors.md"
_TEST_REF = re.compile(r"`(tests/[\w/]+\.py)::(test_\w+)(?:\[([\w-]+)\])?`")

# The cases of the reliability issue (bad input, faults, security): each needs a table row.
REQUIRED_ROWS = [
    "unknown or misspelt key", "wrong type", "inconsistent batch sizes", "model path does not exist",
    "not an HF model directory", "no pad token", "no chat template", "without `prompt`", "empty data set",
    "`truncation=error`", "`rollout.name` not installed", "`resume_mode=resume_path`", "`adv_estimator=gae`",
    "custom reward file does not exist", "lacks the function", "not writable",
    "SIGKILL during a save", "SIGKILL in the middle of a step", "random SIGKILLs", "Ray worker dies", "Ray worker hangs",
    "NaN/Inf loss or gradient, once", "in a row", "reward function raises", "out of memory in generation",
    "out of memory in an actor or critic update", "disk full", "weights_only=True", "trust_remote_code", "dashboard",
]


def _table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| ---")]


def test_every_test_named_in_the_doc_exists():
    refs = _TEST_REF.findall(DOC.read_text(encoding="utf-8"))
    assert len(refs) >= 30
    for path, name, param in refs:
        source = (REPO / path).read_text(encoding="utf-8")
        assert re.search(rf"^def {name}\(", source, re.M), f"{path}::{name} does not exist"
        if param:
            assert f'"{param}"' in source, f"{path}::{name}[{param}] is not a parameter of that test"


def test_every_case_has_a_row_with_a_test():
    rows = _table_rows(DOC.read_text(encoding="utf-8"))
    for case in REQUIRED_ROWS:
        matching = [r for r in rows if case in r.split(" | ")[0]]
        assert matching, f"no row for {case!r} in {DOC.name}"
        assert all(_TEST_REF.search(r) for r in matching), f"row for {case!r} names no test"


def test_every_reliability_test_is_in_the_doc():
    """The other direction: a new reliability test without a doc row fails here."""
    named = {name for _, name, _ in _TEST_REF.findall(DOC.read_text(encoding="utf-8"))}
    helpers = {"test_the_scanner_catches_each_unsafe_pattern", "test_fault_specs_parse_and_bad_ones_are_errors",
               "test_fault_fires_only_on_its_hit_and_size", "test_soak_long_random_kills"}
    for path in sorted((REPO / "tests" / "reliability").glob("test_*.py")):
        if path.name in ("test_errors_doc.py", "test_faults_unit.py"):
            continue
        for name in re.findall(r"^def (test_\w+)\(", path.read_text(encoding="utf-8"), re.M):
            assert name in named or name in helpers, f"{path.name}::{name} is not in docs/errors.md"
