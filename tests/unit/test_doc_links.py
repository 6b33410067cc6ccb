"""The repository explains itself: every relative link in README.md, docs/*.md,
the dated logs in notes/, the design notes beside the code (and .proto comments)
resolves to a file in the repository, and to a heading when it names an anchor;
no link leaves the repository; every ``docs/NAME.md`` or ``notes/NAME.md`` a
tracked file mentions exists; and nothing outside tests/ points at the
workspace's ``../shared`` files. Pages added to docs/ are checked without
touching this file."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# [text](target) and [text](target "title"); images too. Not inside code spans.
_INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$")
_DOC_MENTION = re.compile(r"\b(?:docs|notes)/[A-Z][A-Z0-9_]*\.md\b")


def tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True,
                         check=True)
    return [f for f in out.stdout.splitlines() if (REPO / f).is_file()]


def doc_pages() -> list[Path]:
    """README.md, docs/, the dated logs in notes/ and the design notes beside the code."""
    beside_code = sorted((REPO / "server").rglob("*.md"))
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")),
            *sorted((REPO / "notes").glob("*.md")), *beside_code]


def prose_lines(text: str, *, spans: bool = False) -> list[tuple[int, str]]:
    """Lines outside fenced code blocks, with code spans blanked out (kept
    with ``spans``)."""
    lines, fence = [], ""
    for number, line in enumerate(text.splitlines(), 1):
        m = _FENCE.match(line)
        if m and (not fence or (m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence))):
            fence = "" if fence else m.group(1)
            continue
        if not fence:
            lines.append((number, line if spans else _CODE_SPAN.sub("``", line)))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped,
    spaces as hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8"), spans=True):
        m = _HEADING.match(line)
        if m:
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(path: Path) -> list[tuple[int, str]]:
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".proto":
        lines = [(n, line.split("//", 1)[1]) for n, line in enumerate(text.splitlines(), 1)
                 if "//" in line]
    else:
        lines = prose_lines(text)
    found = [(n, m.group(1)) for n, line in lines for m in _INLINE.finditer(line)]
    body = "\n".join(line for _, line in lines)
    found += [(0, m.group(1)) for m in _REFERENCE.finditer(body)]
    return found


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    problems = []
    for line, target in links(path):
        where = f"{path.relative_to(root)}:{line}: {target}"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            problems.append(f"{where} points outside the repository")
            continue
        file_part, _, anchor = target.partition("#")
        resolved = (path.parent / file_part).resolve() if file_part else path
        if not resolved.is_relative_to(root):
            problems.append(f"{where} leaves the repository")
        elif not resolved.exists():
            problems.append(f"{where} does not exist")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{where}: no heading with that anchor in {resolved.name}")
    return problems


PAGES = [p for p in doc_pages() if p.exists()] + sorted((REPO / "proto").rglob("*.proto"))


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_resolves(path: Path) -> None:
    assert broken_links(path) == []


def test_every_docs_page_mentioned_exists() -> None:
    missing = []
    for name in tracked_files():
        if name.startswith("tests/") or not name.endswith((".py", ".pyi", ".proto", ".md",
                                                            ".toml", "Makefile")):
            continue
        text = (REPO / name).read_text(encoding="utf-8", errors="replace")
        missing += [f"{name}: {m}" for m in set(_DOC_MENTION.findall(text))
                    if not (REPO / m).exists()]
    assert missing == []


def test_the_docs_index_links_every_page() -> None:
    index = REPO / "docs" / "README.md"
    linked = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    pages = {p.resolve() for p in (REPO / "docs").glob("*.md")} - {index.resolve()}
    assert sorted(p.name for p in pages - linked) == []


def test_no_file_outside_tests_mentions_the_workspace() -> None:
    offenders = [name for name in tracked_files() if not name.startswith("tests/")
                 and "../shared" in (REPO / name).read_text(encoding="utf-8", errors="replace")]
    assert offenders == []


def test_the_checker_catches_what_it_is_for(tmp_path: Path) -> None:
    assert "51-acquire" in anchors(REPO / "docs" / "SPEC.md")
    assert slug("5. Ledger service (`fencepost.v1.Ledger`)") == "5-ledger-service-fencepostv1ledger"
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "A.md").write_text("# A\n\n## 5.1 Acquire\n\n## Same\n\n## Same\n")
    page = docs / "B.md"
    page.write_text(
        "[ok](A.md#51-acquire) [dup](A.md#same-1) `[code](nope.md)`\n"
        "```\n[fenced](gone.md)\n```\n"
        "[gone](C.md) [anchor](A.md#nope) [web](https://example.org) [up](../../x)\n"
        "[ref]: A.md#a\n"
    )
    assert [t for _, t in links(page)] == [
        "A.md#51-acquire", "A.md#same-1", "C.md", "A.md#nope", "https://example.org",
        "../../x", "A.md#a"]
    assert broken_links(page, tmp_path) == [
        "docs/B.md:5: C.md does not exist",
        "docs/B.md:5: A.md#nope: no heading with that anchor in A.md",
        "docs/B.md:5: https://example.org points outside the repository",
        "docs/B.md:5: ../../x leaves the repository",
    ]


def test_no_file_outside_tests_cites_an_issue_number() -> None:
    """Docs and code speak to users, not to the tracker."""
    pattern = re.compile(r"\bissues?\s*#?\d+\b|\(#\d+\)", re.I)
    offenders = [
        f"{name}: {m.group(0)}" for name in tracked_files() if not name.startswith("tests/")
        for m in pattern.finditer((REPO / name).read_text(encoding="utf-8", errors="replace"))
    ]
    assert offenders == []
