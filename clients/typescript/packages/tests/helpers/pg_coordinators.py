"""``fencepost serve`` coordinators on one throwaway PostgreSQL database, for
the TypeScript tests that drive them.

By default two single-leader coordinators, as tests/system/test_failover.py
sets them up (a 2 s leader lease, renewed every 300 ms). Prints one JSON line:
``{"endpoints": [...]}`` (or ``{"skip": why}`` when no PostgreSQL is
installed), then answers one line per command read on stdin:

- ``leader``: waits for the one coordinator serving, prints ``{"address", "pid"}``;
- ``revive``: starts again every coordinator that exited (a standby now), prints ``{}``;
- ``exitcode ADDRESS``: waits (15 s at most) for that coordinator to exit,
  prints ``{"code": N}`` (null if it did not).

With ``--lead-shards``: two coordinators that lead shards apart, as
tests/system/test_lead_shards.py sets them up (``"shards"`` in the first line
gives the count). Commands:

- ``balanced``: waits until every shard is held by the coordinators running,
  each its share; prints ``{"owners": {shard: address}, "alive": [...]}``;
- ``owners``: the shards held now, ``{"owners": {shard: address}}``;
- ``kill ADDRESS``: SIGKILLs it, prints ``{}``; ``term ADDRESS``: SIGTERM,
  prints ``{"code": N}``;
- ``add``: starts one more coordinator, prints ``{"address", "pid"}``.

A command that fails prints ``{"error": why}``. EOF on stdin stops everything
(coordinators, then PostgreSQL), by pid.
"""

from __future__ import annotations

import json
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(REPO / "tests" / "system"))

from fencepost_devtools import pgcluster  # noqa: E402


def say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


def failover(url: str, tmp: Path) -> None:
    from test_failover import Coordinators  # the system tests' own harness

    group = Coordinators(url, tmp, 2)
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


def lead_shards(url: str, tmp: Path) -> None:
    from test_lead_shards import SHARDS, Coordinators  # the system tests' own harness

    group = Coordinators(url, tmp, 2)

    def alive() -> list[Any]:
        return [p for p in group.procs if p.proc is not None and p.proc.poll() is None]

    def by_address(address: str) -> Any:
        return next(p for p in group.procs if p.address == address)

    def answer(cmd: list[str]) -> object:
        if cmd == ["balanced"]:
            running = alive()
            return {"owners": group.wait_balanced(running, timeout=30),
                    "alive": [p.address for p in running]}
        if cmd == ["owners"]:
            return {"owners": group.owners()}
        if len(cmd) == 2 and cmd[0] == "kill":
            by_address(cmd[1]).kill()
            return {}
        if len(cmd) == 2 and cmd[0] == "term":
            return {"code": by_address(cmd[1]).stop()}
        if cmd == ["add"]:
            p = group.add().start()
            return {"address": p.address, "pid": p.proc.pid}
        raise ValueError(f"unknown command {' '.join(cmd)!r}")

    try:
        for p in group.procs:
            p.start()
        say({"endpoints": [p.address for p in group.procs], "shards": SHARDS})
        for line in sys.stdin:
            try:
                say(answer(line.split()))
            except Exception as exc:  # the test reads why; the helper goes on
                say({"error": f"{type(exc).__name__}: {exc}"[-4000:]})
    finally:
        group.close()


def main() -> None:
    if not pgcluster.available():
        say({"skip": "no PostgreSQL binaries (make postgres)"})
        return
    with pgcluster.Cluster.start() as pg, tempfile.TemporaryDirectory() as tmp:
        url = pg.create_database(f"ts_{uuid.uuid4().hex[:10]}")
        if "--lead-shards" in sys.argv[1:]:
            lead_shards(url, Path(tmp))
        else:
            failover(url, Path(tmp))


if __name__ == "__main__":
    main()
