"""A busy leader on PostgreSQL keeps leading: its batches hold a lock on the
leader row (the epoch check, FOR KEY SHARE) to COMMIT, and its renewals must
never wait behind them. Found by tests/engine/test_engine_scale.py::
test_list_runs_without_limit_returns_100_000_runs[postgres] on a loaded machine
(batches of 1024 creates took over a second, the renewal's lock_timeout)."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from _db import PgPool

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server.storage.postgres import PostgresStorage
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

pytestmark = [pytest.mark.timeout(120)]

# Each batch holds the leader row this long: longer than the renewal interval
# (200 ms, also the renewal's lock_timeout), well within the lease (1 s, of which
# the leader counts 800 ms as safe): a renewal that waited for the batch would
# always be in time.
BATCH_HOLDS_S = 0.5


def test_a_leader_whose_batches_outlast_the_renewal_interval_keeps_leading(
    pg_pool: PgPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = pg_pool.take()
    real_begin = PostgresStorage._begin

    def slow_begin(self: Any, db: Any) -> None:
        real_begin(self, db)  # the epoch check: the leader row is locked from here
        time.sleep(BATCH_HOLDS_S)

    try:
        with ServerThread(url, clock=ManualClock(), leader_lease="1s",
                          leader_renew="200ms") as srv:
            assert srv.app is not None and srv.app.serving
            monkeypatch.setattr(PostgresStorage, "_begin", slow_begin)
            stop = time.monotonic() + 5.0  # five leader leases of back-to-back batches
            failures: list[str] = []

            def load(worker: int) -> None:
                with grpc.insecure_channel(srv.address) as ch:
                    stub = ledger_pb2_grpc.LedgerStub(ch)
                    i = 0
                    while time.monotonic() < stop:
                        i += 1
                        try:
                            stub.Acquire(pb.AcquireRequest(run_id=f"w{worker}-{i}", owner="w"),
                                         timeout=10)
                        except grpc.RpcError as exc:
                            failures.append(f"{exc.code()}: {exc.details()}")
                            return

            threads = [threading.Thread(target=load, args=(n,)) for n in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            monkeypatch.undo()
            assert not failures, failures[:3]
            assert srv.app.serving and not srv.app.deposed.is_set()
    finally:
        pg_pool.give_back(url)
