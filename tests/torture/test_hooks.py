"""The test-only server hooks: off by default (TestHooks is not even
registered), the clock only jumps forward, and ``--fault`` does nothing
without ``--test-hooks``."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc, testing_pb2, testing_pb2_grpc
from fencepost_server.clock import OffsetClock
from fencepost_server.config import Settings
from fencepost_server.testing import hooks
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread


def test_settings_read_the_hooks_from_the_environment() -> None:
    assert Settings.from_env({}).test_hooks is False
    s = Settings.from_env({"FENCEPOST_TEST_HOOKS": "1", "FENCEPOST_FAULT": "ack-before-commit",
                           "FENCEPOST_TEST_CLOCK_OFFSET_MS": "5000"})
    assert (s.test_hooks, s.fault, s.test_clock_offset_ms) == (True, "ack-before-commit", 5000)
    assert Settings.from_env({"FENCEPOST_TEST_HOOKS": "0"}).test_hooks is False


def test_hooks_are_not_served_by_default(tmp_path: Path) -> None:
    with ServerThread(tmp_path / "f.db") as srv, grpc.insecure_channel(srv.address) as ch:
        stub = testing_pb2_grpc.TestHooksStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            stub.JumpClock(testing_pb2.JumpClockRequest(ms=1000), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_jump_clock_moves_the_server_clock_forward_only(tmp_path: Path) -> None:
    clock = ManualClock(1_000_000)
    with ServerThread(tmp_path / "f.db", clock=clock, test_hooks=True) as srv, \
            grpc.insecure_channel(srv.address) as ch:
        stub = testing_pb2_grpc.TestHooksStub(ch)
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        a = ledger.Acquire(pb.AcquireRequest(run_id="r", owner="A", lease_ttl_ms=1000)).run
        with pytest.raises(grpc.RpcError) as held:
            ledger.Acquire(pb.AcquireRequest(run_id="r", owner="B"))
        assert held.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert stub.JumpClock(testing_pb2.JumpClockRequest(ms=1000)).now_ms == 1_001_000
        b = ledger.Acquire(pb.AcquireRequest(run_id="r", owner="B")).run  # A's lease expired
        assert b.fencing_token == a.fencing_token + 1
        for bad in (-1, 24 * 3600 * 1000 + 1):
            with pytest.raises(grpc.RpcError) as err:
                stub.JumpClock(testing_pb2.JumpClockRequest(ms=bad))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert clock.now_ms() == 1_001_000


def test_offset_clock_never_goes_back() -> None:
    c = OffsetClock()
    before = c.now_ms()
    assert c.jump(60_000) >= before + 60_000
    with pytest.raises(ValueError):
        c.jump(-1)


def test_a_fault_without_test_hooks_is_ignored(tmp_path: Path) -> None:
    with ServerThread(tmp_path / "f.db", fault="fence-ignores-owner") as srv, \
            grpc.insecure_channel(srv.address) as ch:
        assert not hooks.is_active(srv.writer)
        assert srv.writer.ack_before_commit is None
        with pytest.raises(grpc.RpcError):
            testing_pb2_grpc.TestHooksStub(ch).JumpClock(testing_pb2.JumpClockRequest(ms=1))


def test_a_broken_build_is_one_servers_writer_not_the_process(tmp_path: Path) -> None:
    with ServerThread(tmp_path / "f.db", test_hooks=True, fault="fence-ignores-owner") as srv:
        assert hooks.is_active(srv.writer)
        with ServerThread(tmp_path / "h.db") as sound:  # the same process: not broken
            assert not hooks.is_active(sound.writer)
    with ServerThread(tmp_path / "g.db", test_hooks=True, fault="ack-before-commit") as srv:
        assert srv.writer.ack_before_commit is hooks.ack_before_commit


def test_an_unknown_fault_is_refused(tmp_path: Path) -> None:
    srv = ServerThread(tmp_path / "f.db", test_hooks=True, fault="no-such-fault")
    try:
        with pytest.raises(RuntimeError, match="unknown --fault"):
            srv.start()
    finally:
        srv.close()


def test_fence_ignores_owner_lets_another_owner_renew_until_stopped(tmp_path: Path) -> None:
    def renew_as_b(address: str, token: int) -> grpc.StatusCode:
        with grpc.insecure_channel(address) as ch:
            try:
                ledger_pb2_grpc.LedgerStub(ch).Renew(
                    pb.RenewRequest(run_id="r", owner="B", fencing_token=token), timeout=10)
            except grpc.RpcError as err:
                return err.code()
            return grpc.StatusCode.OK

    srv = ServerThread(tmp_path / "f.db", test_hooks=True, fault="fence-ignores-owner")
    try:
        srv.start()
        with grpc.insecure_channel(srv.address) as ch:
            run = ledger_pb2_grpc.LedgerStub(ch).Acquire(
                pb.AcquireRequest(run_id="r", owner="A", lease_ttl_ms=60_000)).run
        assert renew_as_b(srv.address, run.fencing_token) == grpc.StatusCode.OK  # broken
        srv.restart()  # the next writer is built broken too
        assert hooks.is_active(srv.writer)
    finally:
        srv.close()
    with ServerThread(tmp_path / "f.db") as sound:
        assert renew_as_b(sound.address, run.fencing_token) == grpc.StatusCode.FAILED_PRECONDITION


def _watched_revisions(address: str, request: pb.WatchRunsRequest, upto: int) -> list[int]:
    """The revisions a WatchRuns stream sends (changes only) until it has sent ``upto``."""
    got: list[int] = []
    with grpc.insecure_channel(address) as ch:
        stream = ledger_pb2_grpc.LedgerStub(ch).WatchRuns(request, timeout=30)
        for msg in stream:
            if msg.run_id:
                got.append(msg.revision)
            if msg.revision >= upto:
                stream.cancel()
                break
    return got


def test_watch_drops_change_leaves_every_hundredth_revision_out(tmp_path: Path) -> None:
    """The broken build the torture's ``watch`` checker must catch: WatchRuns
    (by revision and by shards, replayed and live) never sends a change whose
    revision is 50 modulo 100; without --test-hooks nothing is left out."""
    made = [0]

    def changes(address: str, n: int) -> None:  # one new run each: one change each
        with grpc.insecure_channel(address) as ch:
            ledger = ledger_pb2_grpc.LedgerStub(ch)
            for _ in range(n):
                made[0] += 1
                ledger.Acquire(pb.AcquireRequest(run_id=f"r{made[0]}", owner="o"), timeout=10)

    with ServerThread(tmp_path / "f.db", test_hooks=True, fault="watch-drops-change") as srv:
        count = srv.writer.storage.shards
        every = [pb.ShardCursor(shard=s, after_revision=0) for s in range(count)]
        changes(srv.address, 120)
        assert _watched_revisions(srv.address, pb.WatchRunsRequest(from_revision=1), 120) == [
            r for r in range(1, 121) if r != 50]
        assert _watched_revisions(srv.address, pb.WatchRunsRequest(shards=every), 120) == [
            r for r in range(1, 121) if r != 50]
        live: list[int] = []
        with grpc.insecure_channel(srv.address) as ch:
            stream = ledger_pb2_grpc.LedgerStub(ch).WatchRuns(
                pb.WatchRunsRequest(shards=[pb.ShardCursor(shard=s) for s in range(count)]),
                timeout=30)
            assert next(stream).cursors  # the stream is open: what follows is live
            changes(srv.address, 40)
            for msg in stream:
                live.append(msg.revision)
                if msg.revision >= 160:
                    stream.cancel()
                    break
        assert live == [r for r in range(121, 161) if r != 150]
    with ServerThread(tmp_path / "g.db", fault="watch-drops-change") as sound:
        changes(sound.address, 60)
        assert _watched_revisions(sound.address, pb.WatchRunsRequest(from_revision=1), 60) == (
            list(range(1, 61)))
