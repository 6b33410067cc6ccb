"""fencepost's fault-proof (torture) harness: worker processes issue randomized
ledger commands and raw compare-and-sets on a few hot runs while a nemesis
SIGKILLs and restarts the server, SIGSTOPs workers past their ttl, cuts client
connections and jumps the server's clock; every operation is recorded and the
history is checked (linearizability, fencing, durability, tokens, liveness);
a watcher reads the change feed through the SDK all along (watcher.py,
watching.py).

    python -m torture --duration 60 --seed 1          (make torture DURATION=60 SEED=1)

``--store postgres --coordinators 3``: the same against coordinators sharing
one throwaway PostgreSQL, the nemesis deposing leaders and crashing the
database, the checkers seeing one history across failovers (coordinators.py,
failover.py).

See docs/RELIABILITY.md. The process helpers of the system tests
(tests/system/_proc.py, _history.py) are reused, so they are put on the path.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_SYSTEM_TESTS = str(REPO / "tests" / "system")
if _SYSTEM_TESTS not in sys.path:
    sys.path.insert(0, _SYSTEM_TESTS)
