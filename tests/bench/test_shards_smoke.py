"""bench/shards.py (``make bench-shards``): a smoke run against real
coordinators (``fencepost serve --lead-shards``) on a real PostgreSQL, tiny
sizes, and the shape of what it reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fencepost_devtools import pgcluster

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not pgcluster.available(), reason="PostgreSQL's server binaries missing")
def test_bench_shards_smoke(tmp_path: Path) -> None:
    out = tmp_path / "shards.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "shards.py"), "--smoke", "--shapes", "fleet",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=540,
    )
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    result = json.loads(out.read_text())
    assert result["failures"] == [], log
    summary = {(m["shape"], m["coordinators"]): m for m in result["summary"]}
    assert set(summary) == {("fleet", 1), ("fleet", 2)}, log
    for m in summary.values():
        assert m["ops_per_s"] > 0 and m["errors"] == 0, (m, log)
        for cpu in ("coordinators_us_per_op", "postgres_us_per_op", "clients_us_per_op"):
            assert m[cpu] > 0, (cpu, m, log)
    assert summary[("fleet", 1)]["ratio_to_1"] == 1.0

    moves = result["moves"]
    assert [e["kind"] for e in moves["events"]] == ["join", "move", "move", "leave", "leave"], log
    assert all(e["cli_s"] > 0 for e in moves["events"] if e["kind"] == "move"), log
    assert set(moves["by_kind_ms"]) == {"join", "move", "leave"}, log
    assert all(e["moved"] for e in moves["events"]), log
    assert moves["unavailable_ms"]["n"] > 0 and moves["moved_never_answered"] == 0, log
    assert moves["held"] > 0 and moves["leases_lost"] == 0, log

    kills = result["kills"]
    assert kills["kills"] == 2 and kills["shards_never_answered"] == 0, log
    assert kills["all_shards_answered_s"]["p50"] > 0, log
    assert kills["held"] > 0 and kills["leases_lost"] == 0, log
    # every process the bench started is gone (they all ran inside its workdir)
    assert result["workdir"] not in subprocess.run(
        ["ps", "-eo", "args"], capture_output=True, text=True).stdout
