"""docs/ENGINE_STORE.md's example runs as shown, against a real server."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from fencepost_server.storage.sqlite import Durability

DOC = Path(__file__).resolve().parents[2] / "docs" / "ENGINE_STORE.md"


def test_the_documented_example_runs_and_prints_what_the_doc_says(make_server: Any) -> None:
    text = DOC.read_text()
    section = text[text.index("## A worker's typical use") :]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    promised = re.search(r"It prints `([^`]*)`", section)
    assert promised is not None
    # durability does not matter to the example; spare it the fsyncs
    with make_server(durability=Durability.NORMAL) as server:
        env = {**os.environ, "FENCEPOST_ADDR": server.address}
        out = subprocess.run(
            [sys.executable, "-c", code.group(1)],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == promised.group(1)
