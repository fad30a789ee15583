"""The documentation stands on its own in a clone of the repository.

README.md, bench/README.md and every docs/**/*.md must not point outside the repository
(`../shared/...`), must not speak of tracker issues by number ("issue 19"), and every relative
Markdown link must name a file that exists (resolved from the linking file; `#anchor` stripped)
and, when it has an anchor into a Markdown file, a heading of that file.
"""

from __future__ import annotations

import re
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(```|~~~).*?^\1", re.M | re.S)
CODE_SPAN = re.compile(r"`[^`\n]*`")
# [text](target) and ![alt](target), with an optional "title" after the target; the text may
# wrap onto the next line, as Markdown allows
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
ISSUE = re.compile(r"\bissues?\s*#?\d+", re.I)


def doc_files() -> list[Path]:
    docs = sorted((ROOT / "docs").rglob("*.md"))
    return [ROOT / "README.md", ROOT / "bench" / "README.md", *docs]


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def prose(text: str) -> str:
    """The text with fenced code blocks and code spans blanked: links there are code."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading anchor of a Markdown file, GitHub's "-1", "-2" suffixes for repeats."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text()).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path) -> list[str]:
    """Relative links of `path` whose file, or whose anchor in a Markdown file, is missing."""
    bad = []
    for target in links(path.read_text()):
        if SCHEME.match(target):  # http(s), mailto: not a file of the repository
            continue
        file_part, _, anchor = target.partition("#")
        dest = path if not file_part else (path.parent / file_part).resolve()
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif not dest.is_relative_to(ROOT):
            bad.append(f"{target}: outside the repository")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    return bad


@pytest.mark.parametrize("path", doc_files(), ids=doc_id)
def test_no_path_outside_the_repository(path):
    lines = [f"{i}: {line}" for i, line in enumerate(path.read_text().splitlines(), 1)]
    assert [line for line in lines if "../shared" in line] == []


@pytest.mark.parametrize("path", doc_files(), ids=doc_id)
def test_no_issue_numbers(path):
    lines = [f"{i}: {line}" for i, line in enumerate(path.read_text().splitlines(), 1)]
    assert [line for line in lines if ISSUE.search(line)] == []


@pytest.mark.parametrize("path", doc_files(), ids=doc_id)
def test_relative_links_resolve(path):
    assert broken_links(path) == []


def test_the_checks_catch_what_they_are_for(tmp_path, monkeypatch):
    """The link check finds a missing file, a missing anchor and a link out of the repository
    (its text wrapped onto a second line or not), and leaves web links, code and good links
    alone; the issue pattern finds its forms."""
    root = tmp_path / "repo"
    monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
    (root / "docs").mkdir(parents=True)
    (tmp_path / "outside.md").write_text("# Outside\n")
    (root / "docs" / "B.md").write_text("# Big title: (v2), `x_y`\n## Part\n## Part\n")
    page = root / "docs" / "A.md"
    page.write_text(
        "# A\n[ok](B.md) [ok](B.md#big-title-v2-x_y) [ok](B.md#part-1) [ok](#a)\n"
        "[web](https://example.com/x) `[code](nowhere.md)`\n```\n[code](nowhere.md)\n```\n"
        "[gone](C.md) [bad anchor](B.md#nope) [out](../../outside.md) ![img](pic.png)\n"
        "a [wrapped\nlink](D.md) and [another](B.md#part-2)\n"
    )
    assert broken_links(page) == [
        "C.md: no such file",
        "B.md#nope: no heading with anchor #nope",
        "../../outside.md: outside the repository",
        "pic.png: no such file",
        "D.md: no such file",
        "B.md#part-2: no heading with anchor #part-2",
    ]
    assert all(ISSUE.search(s) for s in ("issue 19", "Issue 7's shapes", "issues 7 and 19"))
    assert not ISSUE.search("the issue's finding; tissue 3 is biology")
