"""Two ``fencepost serve`` coordinators on one throwaway PostgreSQL database,
for the TypeScript failover tests (the same set-up as
tests/system/test_failover.py: a 2 s leader lease, renewed every 300 ms).

Prints one JSON line: ``{"endpoints": [...]}`` (or ``{"skip": why}`` when no
PostgreSQL is installed), then answers one line per command read on stdin:

- ``leader``: waits for the one coordinator serving, prints ``{"address", "pid"}``;
- ``revive``: starts again every coordinator that exited (a standby now), prints ``{}``;
- ``exitcode ADDRESS``: waits (15 s at most) for that coordinator to exit,
  prints ``{"code": N}`` (null if it did not).

EOF on stdin stops everything (coordinators, then PostgreSQL), by pid.
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO / "tests" / "system"))

from fencepost_devtools import pgcluster  # noqa: E402


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def main() -> None:
    if not pgcluster.available():
        say({"skip": "no PostgreSQL binaries (make postgres)"})
        return
    from test_failover import Coordinators  # the system tests' own harness

    with pgcluster.Cluster.start() as pg, tempfile.TemporaryDirectory() as tmp:
        url = pg.create_database(f"ts_{uuid.uuid4().hex[:10]}")
        group = Coordinators(url, Path(tmp), 2)
        try:
            group.start_all()
            say({"endpoints": [p.address for p in group.procs]})
            for line in sys.stdin:
                cmd = line.split()
                if cmd == ["leader"]:
                    p = group.wait_leader(timeout=30)
                    say({"address": p.address, "pid": p.proc.pid if p.proc else None})
                elif cmd == ["revive"]:
                    for p in group.procs:
                        if p.proc is None or p.proc.poll() is not None:
                            p.start(serving=False)
                    say({})
                elif len(cmd) == 2 and cmd[0] == "exitcode":
                    p = next(x for x in group.procs if x.address == cmd[1])
                    try:
                        code = p.proc.wait(15) if p.proc else None
                    except Exception:
                        code = None
                    say({"code": code})
                else:
                    say({"error": f"unknown command {line.strip()!r}"})
        finally:
            group.close()


if __name__ == "__main__":
    main()
