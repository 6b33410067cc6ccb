"""bench/store_writer.py --writers: K writer processes on one PostgreSQL, small: the
default K list from the core count, which bound a K is said to hit, and a short run
of real writer processes on a throwaway cluster whose JSON holds every figure and a
model consistent with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))

import store_writer  # noqa: E402

from fencepost_devtools import pgcluster  # noqa: E402


def test_the_default_writer_counts_go_one_past_the_cores_and_stop_at_four() -> None:
    assert store_writer.default_writers(1) == [1, 2]
    assert store_writer.default_writers(2) == [1, 2, 3]
    assert store_writer.default_writers(64) == [1, 2, 3, 4]
    assert store_writer.parse_writers("1,3") == [1, 3]


def test_a_bad_writer_count_is_refused_naming_the_flag() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "store_writer.py"), "--writers", "1,0"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert "--writers" in proc.stderr and ">= 1" in proc.stderr


def _figures(**over: float) -> dict[str, float]:
    s = {"idle_share": 0.5, "busiest_writer_core": 0.5, "mean_batch": 10.0,
         "commit_ms": 5.0, "writer_cores": 0.5, "pg_cores": 0.2, "other_cores": 0.0}
    s.update(over)
    return s


def test_the_bound_named_is_the_one_the_machine_showed() -> None:
    assert store_writer.binding(_figures(idle_share=0.02), 2, 64).startswith("CPU")
    assert store_writer.binding(_figures(busiest_writer_core=0.97), 2, 64).startswith("writer")
    assert store_writer.binding(_figures(mean_batch=64.0), 2, 64).startswith("load")
    assert store_writer.binding(_figures(), 2, 64).startswith("PostgreSQL")


@pytest.mark.skipif(not pgcluster.available(), reason="PostgreSQL binaries not installed")
def test_k_writer_processes_on_one_postgresql_measure_every_figure(tmp_path: Path) -> None:
    out = tmp_path / "writers.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "store_writer.py"), "--writers", "1,2",
         "--rounds", "1", "--warmup", "0.3", "--duration", "1", "--submitters", "16",
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert sorted(r["writers"] for r in res["runs"]) == [1, 2]
    for r in res["runs"]:
        assert r["commands_per_s"] > 0 and r["commits_per_s"] > 0 and r["refused"] == 0
        assert r["writer_cpu_us_per_command"] > 0 and r["pg_cpu_us_per_command"] > 0
        assert r["mean_batch"] * r["commits_per_s"] == pytest.approx(r["commands_per_s"],
                                                                     rel=0.05)
        assert 0 <= r["idle_share"] <= 1
    summary = {int(k): v for k, v in res["summary"].items()}
    model = res["model"]
    r1 = summary[1]["commands_per_s"]
    assert model["r1_commands_per_s"] == pytest.approx(r1)
    cpus = model["cpus"]
    for k, m in model["per_k"].items():
        s = summary[int(k)]
        cores = max(0.0, cpus - s["other_cores"])
        bound = cores * 1e6 / (s["writer_cpu_us_per_command"] + s["pg_cpu_us_per_command"])
        ceiling = model["pg_ceiling_commands_per_s"] or float("inf")
        assert m["predicted"] == pytest.approx(min(int(k) * r1, bound, ceiling))
    assert "binds:" in proc.stdout and "predicted(N, C)" in proc.stdout
