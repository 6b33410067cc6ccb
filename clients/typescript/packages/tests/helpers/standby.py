"""A stand-in standby coordinator for the TypeScript endpoint tests: the
Python SDK tests' ``Standby`` (tests/sdk/_standby.py), a real gRPC server
that refuses every fencepost call with UNAVAILABLE + NOT_LEADER naming
``leader`` (empty: none known) and records what it refused.

Prints ``{"address": ...}``, then answers one line per command on stdin:
``leader ADDR`` (or ``leader`` alone: none) -> ``{}``; ``refused`` ->
``[[method, request_id], ...]``. EOF stops it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5] / "tests" / "sdk"))

from _standby import Standby


def main() -> None:
    with Standby(leader=sys.argv[1] if len(sys.argv) > 1 else "") as standby:
        print(json.dumps({"address": standby.address}), flush=True)
        for line in sys.stdin:
            cmd = line.split()
            if cmd and cmd[0] == "leader":
                standby.leader = cmd[1] if len(cmd) > 1 else ""
                print("{}", flush=True)
            elif cmd == ["refused"]:
                print(json.dumps([[r.method, r.request_id] for r in standby.refused]), flush=True)


if __name__ == "__main__":
    main()
