"""Renewals answered from memory across a SIGKILL (docs/SPEC.md §4, §9).

* ``test_a_burst_of_renewals_from_memory_holds_across_kill_9``: leases renewed
  from memory (no commit: the version stays 1) right before a SIGKILL are not
  granted to anyone else before the expiry each renewal acknowledged, although
  the file holds only the acquire's earlier expiry: the restarted server treats
  every lease stored as live as renewed at its start.
* ``test_raw_compare_and_set_is_durable_before_its_answer``: the raw seam's
  compare-and-set (a client's own renewal) is still committed before it is
  answered: every swap acknowledged before a SIGKILL is there after it.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from _proc import CHANNEL_OPTIONS, connect_ro, error_record, now_ms, reason, running_server, ts_ms

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, run_store_pb2_grpc
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb

RUNS = 40
TTL_MS = 8_000


def _stored_expiries(db: Path) -> dict[str, int]:
    """Each run's lease expiry as the file holds it (runs table, then the
    change log above it, as a start reads them)."""
    import json

    conn = connect_ro(db)
    try:
        out: dict[str, int] = {}
        for run_id, text in conn.execute("SELECT run_id, record FROM runs"):
            rec = json.loads(text)
            if rec.get("lease"):
                out[run_id] = rec["lease"][2]
        for run_id, text in conn.execute(
            "SELECT run_id, record FROM changes ORDER BY revision"
        ):
            rec = json.loads(text) if text else None
            if rec and rec.get("lease"):
                out[run_id] = rec["lease"][2]
        return out
    finally:
        conn.close()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_burst_of_renewals_from_memory_holds_across_kill_9(tmp_path: Path) -> None:
    with running_server(tmp_path) as srv, grpc.insecure_channel(
        srv.address, options=CHANNEL_OPTIONS
    ) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        ids = [f"r{i:02d}" for i in range(RUNS)]
        acquired = {
            k: stub.Acquire(pb.AcquireRequest(run_id=k, owner="A", lease_ttl_ms=TTL_MS),
                            timeout=5).run
            for k in ids
        }
        time.sleep(2.5)  # the renewals then reach well past the acquires' expiries
        until: dict[str, int] = {}
        for _ in range(3):  # the burst: every renewal answered from memory
            for k in ids:
                r = stub.Renew(pb.RenewRequest(run_id=k, owner="A", fencing_token=1),
                               timeout=5).run
                assert (r.version, r.revision) == (1, acquired[k].revision), "not from memory"
                until[k] = ts_ms(r.lease.expires_at)
        srv.kill()  # right after the last acknowledgement: nothing flushed
        stored = _stored_expiries(srv.db_path)
        assert all(stored[k] == ts_ms(acquired[k].lease.expires_at) < until[k] - 2_000
                   for k in ids), "the renewals reached the file: the test proves nothing"
        srv.restart()

        granted: dict[str, rpb.Run] = {}
        held_past_stored = 0  # refusals the file's expiry alone would not explain
        deadline = max(until.values()) + TTL_MS + 10_000
        while len(granted) < RUNS and now_ms() < deadline:
            for k in ids:
                if k in granted:
                    continue
                sent = now_ms()
                try:
                    granted[k] = stub.Acquire(
                        pb.AcquireRequest(run_id=k, owner="B", lease_ttl_ms=TTL_MS), timeout=5
                    ).run
                except grpc.RpcError as err:
                    assert reason(err) == "RUN_LEASE_HELD", reason(err)
                    seen = error_record(err)
                    assert seen is not None and seen.lease.owner == "A"
                    assert ts_ms(seen.lease.expires_at) >= until[k]
                    held_past_stored += sent > stored[k]
            time.sleep(0.1)
        assert len(granted) == RUNS, f"only {len(granted)} runs granted to B by the deadline"
        for k, run in granted.items():
            at = ts_ms(run.lease.acquired_at)
            assert at >= until[k], (
                f"{k}: granted to B at {at}, {until[k] - at} ms before A's acknowledged "
                "renewal ran out")
            assert run.fencing_token == 2 and run.attempt == 2
        assert held_past_stored >= RUNS, held_past_stored
        assert srv.stop() == 0


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_raw_compare_and_set_is_durable_before_its_answer(tmp_path: Path) -> None:
    with running_server(tmp_path) as srv, grpc.insecure_channel(
        srv.address, options=CHANNEL_OPTIONS
    ) as ch:
        store = run_store_pb2_grpc.RunStoreStub(ch)
        now = now_ms()
        run = rpb.Run(schema=1, run_id="oma", version=1, status=rpb.RUN_STATUS_RUNNING,
                      attempt=1, fencing_token=1)
        run.created_at.FromMilliseconds(now)
        run.updated_at.FromMilliseconds(now)
        run.lease.owner = "agent"
        run.lease.acquired_at.FromMilliseconds(now)
        run.lease.expires_at.FromMilliseconds(now + 1_000)
        run.lease.ttl_ms = 1_000
        cur = store.Create(spb.CreateRequest(run=run), timeout=5).run
        for i in range(30):  # the client's own renewals: compare-and-set of the expiry
            nxt = rpb.Run()
            nxt.CopyFrom(cur)
            nxt.version = cur.version + 1
            nxt.revision = 0
            # far past start + ttl, so the restart rule leaves the stored expiry as it is
            nxt.lease.expires_at.FromMilliseconds(now + 600_000 + i)
            res = store.CompareAndSet(spb.CompareAndSetRequest(
                run_id="oma", expected_version=cur.version, next=nxt), timeout=5)
            assert res.swapped
            cur = res.run
        srv.kill()  # right after the last answer
        srv.restart()
        got = store.Get(spb.GetRequest(run_id="oma"), timeout=5)
        assert got.found and got.run == cur, "an acknowledged compare-and-set was lost"
        assert cur.version == 31 and ts_ms(cur.lease.expires_at) == now + 600_029
        assert srv.stop() == 0
