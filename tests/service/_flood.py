"""A client that floods one Execute stream with writes for a while (the
fairness test runs it in its own process): ``python _flood.py ADDR SECONDS``.
Prints how many commands were answered."""

from __future__ import annotations

import sys
import time

import grpc

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc

BATCH = 500


def main() -> int:
    addr, seconds = sys.argv[1], float(sys.argv[2])
    deadline = time.monotonic() + seconds
    value = epb.JsonValue(json='"x"')

    def requests():  # type: ignore[no-untyped-def]
        i = 0
        while time.monotonic() < deadline:
            cmds = []
            for _ in range(BATCH):
                i += 1
                cmds.append(pb.Command(id=i, kv_set=epb.EngineKvSetRequest(
                    agent="flood", key=f"k{i % 1000}", value=value)))
            yield pb.ExecuteRequest(commands=cmds)

    answered = 0
    with grpc.insecure_channel(addr) as ch:
        print("ready", flush=True)
        stub = ledger_pb2_grpc.LedgerStub(ch)
        for resp in stub.Execute(requests(), timeout=seconds + 60):
            answered += len(resp.results)
    print(answered, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
