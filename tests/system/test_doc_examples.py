"""Every ```python block in README.md and docs/*.md runs as written, twice in a
row, against a real ``fencepost serve`` process.

Blocks are found when the tests are collected, so a page added to docs/ is
covered without touching this file. A block whose first line is the comment
``# fragment`` is skipped (it shows part of a program). Every other block is
a complete program: its literal address 127.0.0.1:50051 is rewritten to the
test server's, and it runs in a fresh interpreter from an empty directory,
twice, against the same server (which all blocks share, as a user's would);
both runs must exit 0.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from _proc import ServerProc

REPO = Path(__file__).resolve().parents[2]
DOC_ADDRESS = "127.0.0.1:50051"
FRAGMENT = "# fragment"
_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


@dataclass(frozen=True)
class Block:
    path: str  # relative to the repository
    line: int  # of the opening fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.path}:{self.line}"

    @property
    def fragment(self) -> bool:
        first = self.code.lstrip("\n").split("\n", 1)[0].strip()
        return first == FRAGMENT


def doc_pages(root: Path) -> list[Path]:
    """README.md and every docs/*.md under ``root``."""
    pages = [root / "README.md"] if (root / "README.md").exists() else []
    return pages + sorted((root / "docs").glob("*.md"))


def python_blocks(page: Path, root: Path) -> Iterator[Block]:
    """The fenced blocks whose info string is ``python`` (or ``py``), CommonMark fences."""
    lines = page.read_text(encoding="utf-8").split("\n")
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if m is None:
            i += 1
            continue
        fence, info, start = m["fence"], m["info"].strip(), i
        body: list[str] = []
        i += 1
        while i < len(lines):
            close = _FENCE.match(lines[i])
            if close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence) \
                    and not close["info"].strip():
                break
            body.append(lines[i])
            i += 1
        i += 1
        if info.split(" ", 1)[0].lower() in ("python", "python3", "py"):
            yield Block(str(page.relative_to(root)), start + 1, "\n".join(body) + "\n")


def all_blocks(root: Path = REPO) -> list[Block]:
    return [b for page in doc_pages(root) for b in python_blocks(page, root)]


BLOCKS = [b for b in all_blocks() if not b.fragment]


@pytest.fixture(scope="module")
def doc_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    where = tmp_path_factory.mktemp("doc-server")
    server = ServerProc(where / "fencepost.db", where / "server.log").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_the_example_runs_twice_as_written(
    block: Block, doc_server: ServerProc, tmp_path: Path
) -> None:
    code = block.code.replace(DOC_ADDRESS, doc_server.address)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FENCEPOST_")}
    env["PYTHONUNBUFFERED"] = "1"
    for run in (1, 2):
        out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, (
            f"{block.id}, run {run} of 2, exited {out.returncode}:\n{out.stderr[-4000:]}"
            f"\n--- server log ---\n{doc_server.log_tail(2000)}"
        )


def test_the_docs_hold_examples_and_each_is_run_or_marked_a_fragment() -> None:
    blocks = all_blocks()
    assert {b.path for b in blocks} >= {"README.md", "docs/ENGINE_STORE.md"}
    assert BLOCKS and all(b in BLOCKS or b.fragment for b in blocks)


def test_a_new_page_in_docs_is_picked_up(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("```sh\nmake\n```\n")
    (tmp_path / "docs" / "NEW.md").write_text(
        "# New\n\n```python\nprint(1)\n```\n\n````python\n# fragment\nx\n````\n"
        "\n```sh\nnot python\n```\n\n~~~py\nprint(2)\n~~~\n"
    )
    found = all_blocks(tmp_path)
    assert [(b.path, b.line, b.fragment) for b in found] == [
        ("docs/NEW.md", 3, False), ("docs/NEW.md", 7, True), ("docs/NEW.md", 16, False)]
    assert found[0].code == "print(1)\n"
