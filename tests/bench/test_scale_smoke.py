"""bench/scale.py (``make bench-scale``), small: a fill with two timed slices
and two interleaved rounds (the big store, then a fresh small one), restarts (clean,
after a kill -9, with no index saved) of a real ``fencepost serve``, and
the filtered listing, all written to its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_a_small_scale_run_measures_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "scale.py"), "--runs", "3000", "--ids", "random",
         "--live", "20", "--slice", "500", "--checkpoints", "500,3000", "--submitters", "16",
         "--restarts", "1", "--rounds", "2", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fill = json.loads(out.read_text())["orders"]["random"]
    assert [s["at_runs"] for s in fill["slices"]] == [500, 3000]
    rounds = fill["rounds"]
    assert len(rounds) == 2
    # each round: a slice on the big store, growing past the fill, then the
    # first checkpoint's slice on a fresh small store
    assert rounds[0]["big"]["at_runs"] >= 3000 + 500 + 20
    assert rounds[1]["big"]["at_runs"] >= rounds[0]["big"]["at_runs"] + 500
    assert all(r["small"]["at_runs"] == 500 and r["small"]["us_per_run"] > 0 for r in rounds)
    big = sorted(r["big"]["us_per_run"] for r in rounds)
    small = sorted(r["small"]["us_per_run"] for r in rounds)
    expected = ((big[0] + big[1]) / 2) / ((small[0] + small[1]) / 2)
    assert abs(fill["growth_side_by_side"] - expected) < 0.01
    assert fill["cpu_growth_side_by_side"] > 0
    # the last slice runs past the last checkpoint, then two rounds' slices;
    # each round of submitters may finish a run or two past its target
    assert 3000 + 3 * 500 + 20 <= fill["runs"] <= 3000 + 3 * 500 + 20 + 3 * 3 * 16
    assert fill["serving_s"] > 0 and fill["after_crash_serving_s"] > 0
    assert fill["list_running_count"] == 20
    assert "side by side x" in proc.stdout
