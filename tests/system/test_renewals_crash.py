"""Renewals answered from memory across a SIGKILL (docs/SPEC.md §4, §9).

* ``test_a_burst_of_renewals_from_memory_holds_across_kill_9``: leases renewed
  from memory (no commit: the version stays 1) right before a SIGKILL are not
  granted to anyone else before the expiry each renewal acknowledged, although
  the file holds only the acquire's earlier expiry: the restarted server treats
  every lease stored as live as renewed at its start.
* ``test_100000_leases_renewed_from_memory_survive_kill_9``: the same at
  scale, over Execute streams: 100,000 leases, each renewed once from memory,
  then SIGKILL. After the restart every one is still held by its owner with
  its token and at least the expiry acknowledged, and another owner's
  Acquire of each is refused, many of them after the file's expiry.
* ``test_raw_compare_and_set_is_durable_before_its_answer``: the raw seam's
  compare-and-set (a client's own renewal) is still committed before it is
  answered: every swap acknowledged before a SIGKILL is there after it.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
from _proc import (
    CHANNEL_OPTIONS,
    connect_ro,
    error_record,
    execute_all,
    now_ms,
    reason,
    running_server,
    status_reason,
    status_record,
    ts_ms,
)

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


MANY = 100_000
MANY_TTL_MS = 30_000  # longer than the acquires and the burst take on a busy machine
PAST_STORED = MANY // 10  # Acquires sent after the file's expiry, at least


def _list_all(stub: ledger_pb2_grpc.LedgerStub) -> dict[str, rpb.Run]:
    runs: dict[str, rpb.Run] = {}
    token = ""
    while True:
        page = stub.ListRuns(pb.ListRunsRequest(page_size=1000, page_token=token), timeout=30)
        runs.update((r.run_id, r) for r in page.runs)
        token = page.next_page_token
        if not token:
            return runs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_100000_leases_renewed_from_memory_survive_kill_9(tmp_path: Path) -> None:
    with running_server(tmp_path) as srv, grpc.insecure_channel(
        srv.address, options=CHANNEL_OPTIONS
    ) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        ids = [f"m{i:06d}" for i in range(MANY)]
        t0 = time.monotonic()
        got = execute_all(stub, [
            pb.Command(id=i + 1, acquire=pb.AcquireRequest(run_id=k, owner="A",
                                                           lease_ttl_ms=MANY_TTL_MS))
            for i, k in enumerate(ids)])
        ramp_s = time.monotonic() - t0
        acquired = {ids[i - 1]: r.acquire.run for i, r in got.items()
                    if r.WhichOneof("kind") == "acquire"}
        assert len(acquired) == MANY, f"{MANY - len(acquired)} acquires failed"
        assert ramp_s < MANY_TTL_MS / 2000, f"acquiring took {ramp_s:.1f} s: machine too busy"
        time.sleep(2.0)  # every renewal then reaches past its acquire's expiry

        t1 = time.monotonic()
        got = execute_all(stub, [
            pb.Command(id=i + 1, renew=pb.RenewRequest(run_id=k, owner="A", fencing_token=1))
            for i, k in enumerate(ids)])
        burst_s = time.monotonic() - t1
        until: dict[str, int] = {}
        for i, r in got.items():
            k = ids[i - 1]
            assert r.WhichOneof("kind") == "renew", (k, r)
            run = r.renew.run
            assert (run.version, run.revision) == (1, acquired[k].revision), "not from memory"
            until[k] = ts_ms(run.lease.expires_at)
        assert len(until) == MANY
        srv.kill()  # right after the last acknowledgement: nothing flushed
        stored = _stored_expiries(srv.db_path)
        unflushed = [k for k in ids if stored[k] < until[k]]
        assert len(unflushed) >= PAST_STORED, "the renewals reached the file: proves nothing"
        t2 = time.monotonic()
        srv.restart()
        restart_s = time.monotonic() - t2

        # the server's view: every lease held by A, same token, expiry >= acknowledged
        runs = _list_all(stub)
        assert len(runs) == MANY
        short = [k for k, run in runs.items() if ts_ms(run.lease.expires_at) < until[k]]
        assert not short, (f"{len(short)} leases came back shorter than acknowledged, e.g. "
                           f"{short[0]}: {ts_ms(runs[short[0]].lease.expires_at)} < "
                           f"{until[short[0]]}")
        for k, run in runs.items():
            assert (run.status, run.lease.owner, run.fencing_token, run.attempt) == (
                rpb.RUN_STATUS_RUNNING, "A", 1, 1), run
            assert run.version >= 1 and run.revision >= acquired[k].revision

        # another owner, in the order of the file's expiries, from just past the
        # PAST_STORED-th: refused before each acknowledged expiry, file's or not
        order = sorted(unflushed, key=stored.__getitem__)
        wait_ms = stored[order[PAST_STORED - 1]] + 50 - now_ms()
        if wait_ms > 0:
            time.sleep(wait_ms / 1000)
        order += [k for k in ids if stored[k] >= until[k]]
        sent = now_ms()
        got = execute_all(stub, [
            pb.Command(id=i + 1, acquire=pb.AcquireRequest(run_id=k, owner="B",
                                                           lease_ttl_ms=MANY_TTL_MS))
            for i, k in enumerate(order)])
        answered = now_ms()
        past_stored = late = 0
        for i, r in got.items():
            k = order[i - 1]
            if r.WhichOneof("kind") == "acquire":  # only once A's renewal ran out
                at = ts_ms(r.acquire.run.lease.acquired_at)
                assert at >= until[k], (
                    f"{k}: granted to B at {at}, {until[k] - at} ms before A's "
                    "acknowledged renewal ran out")
                late += 1
                continue
            assert status_reason(r.error) == "RUN_LEASE_HELD", r.error
            seen = status_record(r.error)
            assert seen.lease.owner == "A" and seen.fencing_token == 1
            assert ts_ms(seen.lease.expires_at) >= until[k]
            past_stored += sent > stored[k]
        assert len(got) == MANY
        assert past_stored >= PAST_STORED, past_stored
        print(f"\n{MANY:,} leases: acquired in {ramp_s:.1f} s, renewed in {burst_s:.1f} s, "
              f"restart {restart_s:.1f} s; {past_stored:,} of B's Acquires (sent "
              f"{(answered - sent) / 1000:.1f} s) came after the file's expiry, {late} "
              "after A's")

        # the holder carries on under its token
        got = execute_all(stub, [
            pb.Command(id=i + 1, renew=pb.RenewRequest(run_id=k, owner="A", fencing_token=1))
            for i, k in enumerate(ids[:1000])])
        assert all(r.WhichOneof("kind") == "renew" for r in got.values())
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
