"""The README stays a front door, and every relative link in it and in docs/ leads somewhere.

A link is ``[text](target)`` outside fenced code; ``target`` is a path relative to the file (checked to
exist) with an optional ``#anchor`` (checked against the target's headings, slugged as GitHub does).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = sorted((REPO / "docs").glob("*.md"))
MAX_README_LINES = 200  # issue 35: a newcomer reads the README in one sitting; detail lives in docs/

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(path: Path) -> list[str]:
    """The file's lines outside fenced code blocks (a link-like string in code is not a link)."""
    lines, fenced = [], False
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def github_slug(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped (not ``-`` or ``_``), spaces to ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose_lines(path):
        m = HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def relative_links(path: Path) -> list[tuple[int, str]]:
    found = []
    for number, line in enumerate(_prose_lines(path), 1):
        for target in LINK.findall(line):
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: ...
                found.append((number, target))
    return found


def test_github_slug_matches_githubs_anchors():
    # by hand, as GitHub renders these headings
    assert github_slug("Train your own agent (OpenAI chat API)") == "train-your-own-agent-openai-chat-api"
    assert github_slug("CPU kernels: one switch, chosen when the model is built") == \
        "cpu-kernels-one-switch-chosen-when-the-model-is-built"
    assert github_slug("Rule rewards by `data_source`") == "rule-rewards-by-data_source"
    assert github_slug("GPU-only paths") == "gpu-only-paths"


def test_readme_is_at_most_200_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines (at most {MAX_README_LINES}): move detail into docs/"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_points_to_an_existing_file_and_heading(doc):
    broken = []
    for number, target in relative_links(doc):
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists():
            broken.append(f"line {number}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"line {number}: {target} (no heading '#{anchor}' in {dest.relative_to(REPO)})")
    assert not broken, f"{doc.relative_to(REPO)} has broken links:\n" + "\n".join(broken)


def test_every_doc_is_reachable_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in relative_links(README)}
    orphans = [str(d.relative_to(REPO)) for d in DOCS if d.resolve() not in linked]
    assert not orphans, f"docs not linked from README.md: {orphans}"
