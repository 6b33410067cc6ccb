"""bench/scale.py (``make bench-scale``), small: a fill with two timed slices
and the first slice timed again on a fresh store afterwards, restarts (clean,
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
         "--restarts", "1", "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    fill = json.loads(out.read_text())["orders"]["random"]
    assert [s["at_runs"] for s in fill["slices"]] == [500, 3000]
    assert fill["baseline_after"]["at_runs"] == 500
    assert fill["baseline_after"]["us_per_run"] > 0
    first, last, after = fill["slices"][0], fill["slices"][-1], fill["baseline_after"]
    expected = last["us_per_run"] / ((first["us_per_run"] + after["us_per_run"]) / 2)
    assert abs(fill["growth_bracketed"] - expected) < 0.01
    # the last slice runs past the last checkpoint; each round of submitters
    # may finish a run or two past its target
    assert 3000 + 500 + 20 <= fill["runs"] <= 3000 + 500 + 20 + 3 * 16
    assert fill["serving_s"] > 0 and fill["after_crash_serving_s"] > 0
    assert fill["list_running_count"] == 20
    assert "against the mean of the first slice" in proc.stdout
