"""bench/ts_lifecycle.py, small: the TypeScript client and the Python SDK in
the same run, each in the fleet and the engine shape, over plaintext and over
mutual TLS, against real servers; every measurement completes lifecycles."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DIST = REPO / "clients" / "typescript" / "packages" / "client" / "dist" / "index.js"


@pytest.mark.skipif(shutil.which("node") is None or not DIST.exists(),
                    reason="needs node and the TypeScript client built (npm run build)")
def test_a_small_run_measures_both_clients_in_both_shapes_with_and_without_tls(
    tmp_path: Path,
) -> None:
    out = tmp_path / "ts.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "ts_lifecycle.py"), "--seconds", "0.3",
         "--rounds", "2", "--concurrency", "3", "--json", str(out)],
        cwd=REPO / "bench", capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    seen = {(r["client"], r["shape"], r["security"]) for r in result["results"]}
    every = {(c, s, t) for c in ("typescript", "python") for s in ("fleet", "engine")
             for t in ("plain", "tls")}
    assert seen == every
    assert len(result["results"]) == 2 * len(every)  # each, every round
    assert all(r["lifecycles"] > 0 and r["p99_ms"] > 0 for r in result["results"])
    assert len(result["summary"]) == len(every)
    assert "median of 2 round(s)" in proc.stdout
