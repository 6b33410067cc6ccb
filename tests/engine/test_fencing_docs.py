"""docs/FENCING.md: every complete Python block runs twice in a row against a
real server and prints what the page says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

DOC = Path(__file__).resolve().parents[2] / "docs" / "FENCING.md"


def test_the_example_runs_twice_and_prints_what_the_doc_says(make_server: Any) -> None:
    text = DOC.read_text()
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S)
              if not b.startswith("# fragment")]
    assert len(blocks) == 1
    promised = text[text.index("It prints:"):].split("```")[1].strip()
    with make_server() as server:
        env = {**os.environ, "FENCEPOST_ADDR": server.address}
        for _ in range(2):
            out = subprocess.run([sys.executable, "-c", blocks[0]], env=env,
                                 capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == promised
