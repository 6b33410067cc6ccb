"""KeepAlive under process faults (docs/SPEC.md §6.1, §9; docs/STREAMS.md), with a real
``fencepost serve`` process and SDK worker processes (tests/system/_stream_worker.py):

- a: the server is SIGKILLed and restarted on the same file and port mid-stream:
  the SDK reconnects by itself, the leases whose ttl had not passed stay held
  and keep being renewed; leases that expired while their (SIGSTOPped) holder
  was cut off and were taken over by another owner are reported lost with
  ``taken_over``, and only those.
- b: a worker that closes its client, or dies with os._exit, revokes nothing:
  another owner is refused RUN_LEASE_HELD until expires_at and gets the run
  right after, with nothing written to the run in between.
- c: a tracked lease whose renewals stop (holder SIGSTOPped) is pushed
  ``expiring`` to a raw KeepAlive observer at its expiry; a late renewal still
  wins when nobody took the run (and re-arms ``expiring``); a takeover is
  pushed as ``lost``.
- d: the server SIGSTOPped (unreachable but connected): the SDK declares the
  lease at risk at its safe-until, which is never later than the send time of
  the last answered renewal + ttl, and ``guard()`` cancels the guarded work
  then -- a worker cut off from the coordinator stops on its own.

Every process is killed (and SIGCONTed first) when a test ends, pass or fail.
"""

from __future__ import annotations

import contextlib
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _proc import CHANNEL_OPTIONS, ServerProc, now_ms, reason, running_server, ts_ms
from _stream_worker import WorkerProc, worker_pool

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

SLACK_S = 0.3  # event-loop / scheduling latency allowed on a busy 2-CPU machine


@contextlib.contextmanager
def ledger(srv: ServerProc) -> Iterator[Any]:
    with grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS) as ch:
        yield ledger_pb2_grpc.LedgerStub(ch)


def get_run(stub: Any, run_id: str) -> Any:
    return stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=10).run


def wait_for(
    what: str | Callable[[], str], pred: Callable[[], Any], timeout: float, every: float = 0.05
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(every)


def try_acquire(stub: Any, run_id: str, owner: str, ttl_ms: int = 60_000) -> tuple[
        int, int, Any]:
    """One Acquire: (sent_ms, answered_ms, the Run or the refusal's reason)."""
    sent = now_ms()
    try:
        run: Any = stub.Acquire(pb.AcquireRequest(run_id=run_id, owner=owner,
                                                  lease_ttl_ms=ttl_ms), timeout=10).run
    except grpc.RpcError as err:
        run = reason(err)
    return sent, now_ms(), run


def acquire_after_expiry(stub: Any, run_id: str, owner: str, timeout: float) -> tuple[
        list[tuple[int, int, str]], tuple[int, int, Any]]:
    """Poll Acquire until it succeeds: (the refusals, the success)."""
    refusals: list[tuple[int, int, str]] = []
    deadline = time.monotonic() + timeout
    while True:
        sent, answered, got = try_acquire(stub, run_id, owner)
        if not isinstance(got, str):
            return refusals, (sent, answered, got)
        refusals.append((sent, answered, got))
        assert time.monotonic() < deadline, f"{run_id}: still refused: {refusals[-3:]}"
        time.sleep(0.02)


def finish_raw(stub: Any, run: Any, owner: str) -> None:
    stub.Finish(pb.FinishRequest(run_id=run.run_id, owner=owner,
                                 fencing_token=run.fencing_token,
                                 status=rpb.RUN_STATUS_COMPLETED), timeout=10)


class RawKeepAlive:
    """A raw KeepAlive stream (an observer that tracks without renewing)."""

    def __init__(self, stub: Any, owner: str) -> None:
        self._requests: queue.Queue[Any] = queue.Queue()
        self.answers: queue.Queue[tuple[int, Any]] = queue.Queue()
        self._requests.put(pb.KeepAliveRequest(hello=pb.KeepAliveHello(owner=owner)))
        self.call = stub.KeepAlive(self._feed())
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _feed(self) -> Iterator[Any]:
        while (msg := self._requests.get()) is not None:
            yield msg

    def _read(self) -> None:
        try:
            for resp in self.call:
                self.answers.put((now_ms(), resp))
        except grpc.RpcError as err:
            self.answers.put((now_ms(), err))

    def track(self, run_id: str, token: int) -> None:
        self._requests.put(pb.KeepAliveRequest(
            track=pb.KeepAliveTrack(run_id=run_id, fencing_token=token)))

    def next(self, timeout: float) -> tuple[int, Any] | None:
        try:
            return self.answers.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        self._requests.put(None)
        self.call.cancel()
        self._thread.join(5)


def stopped(srv: ServerProc) -> contextlib.AbstractContextManager[None]:
    """SIGSTOP the server for the block; SIGCONT on the way out, whatever happens."""

    @contextlib.contextmanager
    def cm() -> Iterator[None]:
        assert srv.proc is not None
        srv.proc.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            if srv.proc.poll() is None:
                srv.proc.send_signal(signal.SIGCONT)

    return cm()


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProc]:
    """One server for b, c and d (distinct run ids); a needs its own to kill."""
    with running_server(tmp_path_factory.mktemp("shared")) as srv:
        yield srv


# -- a: kill -9 and restart mid-stream ------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_kill9_restart_mid_stream_keeps_live_leases_loses_only_taken_over(
    tmp_path: Path,
) -> None:
    long_ttl, short_ttl = 5_000, 1_000
    srv = ServerProc(tmp_path / "fencepost.db", tmp_path / "server.log")
    try:
        srv.start()
        with worker_pool() as workers:
            # A keeps running through the crash; B is SIGSTOPped across it
            a = WorkerProc("hold", {"addr": srv.address, "owner": "holder-a", "groups": [
                ["a-long-", 20, long_ttl], ["a-short-", 3, short_ttl]]},
                tmp_path / "holder-a.err")
            workers.append(a)
            b = WorkerProc("hold", {"addr": srv.address, "owner": "holder-b", "groups": [
                ["b-long-", 4, long_ttl], ["b-short-", 6, short_ttl]]},
                tmp_path / "holder-b.err")
            workers.append(b)
            ready = {"holder-a": a.expect("ready", 30)["leases"],
                     "holder-b": b.expect("ready", 30)["leases"]}
            time.sleep(1.0)  # a few stream renewals of the short leases
            b.signal(signal.SIGSTOP)
            time.sleep(0.05)
            t_kill = time.monotonic()
            srv.kill()
            srv.start()  # same file, same port
            t_up = time.monotonic()
            print(f"\nserver down for {t_up - t_kill:.2f} s (restart included)")

            with ledger(srv) as stub:
                # B's short leases expired while B was cut off: another owner takes them
                taken: dict[str, Any] = {}
                for run_id, info in ready["holder-b"].items():
                    rec = get_run(stub, run_id)
                    assert rec.lease.owner == "holder-b"
                    assert rec.fencing_token == info["token"]
                    if run_id.startswith("b-short-"):
                        refusals, (_, _, run) = acquire_after_expiry(stub, run_id, "rival", 5)
                        assert all(r[2] == "RUN_LEASE_HELD" for r in refusals), refusals
                        assert run.fencing_token == info["token"] + 1 and run.attempt == 2
                        taken[run_id] = run
                    elif ts_ms(rec.lease.expires_at) > now_ms() + 100:
                        # acknowledged until T: nobody else gets it before T, crash or not
                        _, _, got = try_acquire(stub, run_id, "rival")
                        assert got == "RUN_LEASE_HELD", (run_id, got)
                b.signal(signal.SIGCONT)

                # B reconnects by itself and learns exactly those losses
                def b_lost() -> Any:
                    r = b.request("report", "report")
                    return r if len(r["lost"]) >= len(taken) else None

                rb = wait_for("B to learn its losses", b_lost, 10, every=0.2)
                assert {k: v[0] for k, v in rb["lost"].items()} == {
                    run_id: "taken_over" for run_id in taken}

                # every lease nobody took is still held, same token, and renewed
                # again and again after the restart
                kept = {run_id: (owner, info["token"])
                        for owner, leases in ready.items() for run_id, info in leases.items()
                        if run_id not in taken}

                def expiries() -> dict[str, int]:
                    out = {}
                    for run_id, (owner, token) in kept.items():
                        rec = get_run(stub, run_id)
                        assert rec.lease.owner == owner and rec.fencing_token == token, rec
                        assert rec.status == rpb.RUN_STATUS_RUNNING
                        out[run_id] = ts_ms(rec.lease.expires_at)
                    return out

                first = expiries()
                time.sleep(long_ttl / 3000 + 0.3)  # one renewal interval of the long ones
                second = expiries()
                later = now_ms()
                for run_id in kept:
                    assert second[run_id] > first[run_id], f"{run_id} not renewed"
                    assert second[run_id] > later, f"{run_id} expired"

                last: list[Any] = []

                def both_safe() -> Any:
                    ra, rb = a.request("report", "report"), b.request("report", "report")
                    last[:] = [ra["at_risk_now"], rb["at_risk_now"]]
                    return (ra, rb) if not ra["at_risk_now"] and not rb["at_risk_now"] else None

                ra, rb = wait_for(lambda: f"every kept lease to be safe; at risk: {last}",
                                  both_safe, 5, every=0.1)
                print(f"A: sessions {ra['sessions']} at-risk {ra['at_risk']}; "
                      f"B: sessions {rb['sessions']} at-risk {rb['at_risk']}")
                assert ra["lost"] == {}
                assert ra["active"] == 23 and rb["active"] == 4
                assert ra["sessions"] >= 2 and rb["sessions"] >= 2  # reconnected by itself
                # A's long leases were never at risk when the outage (restart
                # included) ended well within what was left of their ttl
                long_at_risk = [r for r in ra["at_risk"] if r.startswith("a-long-")]
                if t_up - t_kill < long_ttl * 2 / 3000 - 1.0:
                    assert long_at_risk == []
                elif long_at_risk:
                    print(f"(restart too slow to require it: {len(long_at_risk)} long "
                          "leases were at risk for a while)")

                fa = a.request("finish", "finished")
                fb = b.request("finish", "finished")
                assert (fa["ok"], fa["errors"]) == (23, {})
                assert (fb["ok"], fb["errors"]) == (4, {})
                for run in taken.values():
                    finish_raw(stub, run, "rival")
                for w in workers:
                    w.request("exit", "closed")
    finally:
        srv.kill()


# -- b: closing revokes nothing -------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_closed_or_crashed_client_revokes_nothing_before_the_ttl(
    tmp_path: Path, shared_server: ServerProc
) -> None:
    ttl = 1_500
    srv = shared_server
    with worker_pool() as workers, ledger(srv) as stub:
        graceful = WorkerProc("hold", {"addr": srv.address, "owner": "closer",
                                       "groups": [["close-", 3, ttl]]},
                              tmp_path / "closer.err")
        workers.append(graceful)
        crasher = WorkerProc("hold", {"addr": srv.address, "owner": "crasher",
                                      "groups": [["crash-", 3, ttl]]},
                             tmp_path / "crasher.err")
        workers.append(crasher)
        leases = {**{r: ("closer", i["token"])
                     for r, i in graceful.expect("ready", 30)["leases"].items()},
                  **{r: ("crasher", i["token"])
                     for r, i in crasher.expect("ready", 30)["leases"].items()}}
        time.sleep(0.7)  # renewed over the stream at least once
        graceful.request("exit", "closed")  # client.aclose(): the stream ends cleanly
        assert graceful.wait(10) == 0
        crasher.send("crash")  # os._exit: nothing closed
        assert crasher.wait(10) == 3
        time.sleep(0.2)  # anything still in flight from the dead has landed

        snap = {}
        for run_id, (owner, token) in leases.items():
            rec = get_run(stub, run_id)
            snap[run_id] = rec
            assert rec.lease.owner == owner and rec.fencing_token == token
            assert rec.status == rpb.RUN_STATUS_RUNNING
            assert ts_ms(rec.lease.expires_at) > now_ms(), f"{run_id} already expired"

        pending = set(leases)
        refusals: dict[str, list[tuple[int, int, str]]] = {r: [] for r in leases}
        wins: dict[str, tuple[int, int, Any]] = {}
        deadline = time.monotonic() + ttl / 1000 + 5
        while pending:
            assert time.monotonic() < deadline, f"never acquired: {pending}"
            for run_id in sorted(pending):
                sent, answered, got = try_acquire(stub, run_id, "rival")
                if isinstance(got, str):
                    refusals[run_id].append((sent, answered, got))
                else:
                    wins[run_id] = (sent, answered, got)
                    pending.discard(run_id)
            time.sleep(0.02)

        lags = {}
        for run_id, rec in snap.items():
            expires = ts_ms(rec.lease.expires_at)
            assert refusals[run_id], f"{run_id}: no refusal before the expiry"
            for sent, _, why in refusals[run_id]:
                assert why == "RUN_LEASE_HELD", (run_id, why)
                assert sent < expires, f"{run_id}: refused after its expiry ({sent} >= {expires})"
            sent, answered, run = wins[run_id]
            assert answered >= expires, f"{run_id}: granted {expires - answered} ms early"
            # nothing was written between the holder's exit and the takeover
            assert run.version == rec.version + 1
            assert run.fencing_token == rec.fencing_token + 1 and run.attempt == 2
            lags[run_id] = sent - expires
        print(f"\nfirst successful acquire sent this long after expires_at (ms): {lags}")
        for _, _, run in wins.values():
            finish_raw(stub, run, "rival")


# -- c: expiring ------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_stopped_renewals_push_expiring_to_a_tracking_stream(
    tmp_path: Path, shared_server: ServerProc
) -> None:
    ttl = 1_000
    srv = shared_server
    with worker_pool() as workers, ledger(srv) as stub:
        holder = WorkerProc("hold", {"addr": srv.address, "owner": "holder",
                                     "groups": [["x-", 1, ttl]]}, tmp_path / "holder.err")
        workers.append(holder)
        run_id, info = next(iter(holder.expect("ready", 30)["leases"].items()))
        token = info["token"]
        observer = RawKeepAlive(stub, "observer")
        try:
            observer.track(run_id, token)
            assert observer.next(0.8) is None  # renewed all along: nothing to say

            for round_ in (1, 2):
                holder.signal(signal.SIGSTOP)  # its renewals stop
                time.sleep(0.1)
                rec = get_run(stub, run_id)
                expires = ts_ms(rec.lease.expires_at)
                got = observer.next(ttl / 1000 + 2)
                assert got is not None, f"round {round_}: no expiring"
                at, msg = got
                assert not isinstance(msg, Exception), msg
                assert msg.WhichOneof("kind") == "expiring", msg
                assert msg.expiring.run_id == run_id and msg.expiring.fencing_token == token
                assert ts_ms(msg.expiring.expires_at) == expires
                assert expires <= at <= expires + 1000, (at - expires)
                print(f"\nround {round_}: expiring pushed {at - expires} ms after expires_at")
                if round_ == 1:
                    # nobody took it: the holder's next renewal still wins
                    holder.signal(signal.SIGCONT)

                    def safe_again() -> Any:
                        r = holder.request("report", "report")
                        return r if r["at_risk"] and not r["at_risk_now"] else None

                    r = wait_for("the holder to renew", safe_again, 5, every=0.1)
                    assert r["lost"] == {} and r["active"] == 1
                    rec = get_run(stub, run_id)
                    assert rec.lease.owner == "holder" and rec.fencing_token == token
                    assert ts_ms(rec.lease.expires_at) > expires
                    assert observer.next(0.3) is None  # a renewal is no loss
            # round 2: taken over while the holder is stopped
            _, (_, _, run) = acquire_after_expiry(stub, run_id, "rival", 5)
            got = observer.next(3)
            assert got is not None and not isinstance(got[1], Exception), got
            msg = got[1]
            assert msg.WhichOneof("kind") == "lost", msg
            assert msg.lost.reason == pb.LOST_REASON_TAKEN_OVER
            assert msg.lost.fencing_token == token
            assert msg.lost.record.fencing_token == run.fencing_token == token + 1
            holder.signal(signal.SIGCONT)

            def lost() -> Any:
                rep = holder.request("report", "report")
                return rep if rep["lost"] else None

            r = wait_for("the holder to learn its loss", lost, 5, every=0.1)
            assert r["lost"][run_id][0] == "taken_over" and r["active"] == 0
            finish_raw(stub, run, "rival")
        finally:
            observer.close()


# -- d: unreachable server, guard() ---------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_sigstopped_server_guard_cancels_work_at_safe_until(
    tmp_path: Path, shared_server: ServerProc
) -> None:
    ttl_ms = 1_500
    ttl = ttl_ms / 1000
    srv = shared_server
    with worker_pool() as workers, ledger(srv) as stub:
        w = WorkerProc("hold", {"addr": srv.address, "owner": "worker", "spy": True,
                                "groups": [["g-", 1, ttl_ms]]}, tmp_path / "worker.err")
        workers.append(w)
        run_id, info = next(iter(w.expect("ready", 30)["leases"].items()))
        time.sleep(0.7)  # at least one stream renewal answered
        w.send("guard", run_id=run_id)
        w.expect("guard_entered", 5)
        time.sleep(0.2)
        t_stop = time.monotonic()
        with stopped(srv):  # connected but silent: renewals go out, no answer comes
            done = w.expect("guard_done", ttl + 5)
            t_seen = time.monotonic()
        assert done["error"] == "LeaseAtRiskError" and done["reason"] == "at_risk", done
        cancelled = done["cancelled_at"]  # the work task saw CancelledError here
        safe_until = done["safe_until_at_cancel"]
        assert t_seen - t_stop < ttl + 2

        r = w.request("report", "report", detail=True)
        wire = [e for e in r["wire"] if e[1] == run_id]
        # once resumed the server may push `expiring` before it reads the renewal
        # queued while it was stopped (the lease did pass its expiry unrenewed)
        late_expiring = [e for e in wire if e[0] == "expiring" and e[2] >= cancelled]
        wire = [e for e in wire if e not in late_expiring]
        assert not [e for e in wire if e[0] not in ("renew", "renewed")], wire
        sends = [e[2] for e in wire if e[0] == "renew"]
        answers = [e for e in wire if e[0] == "renewed" and e[2] < cancelled]
        assert answers, "no stream renewal answered before the stop"
        # answers come in the order of the renewals: the k-th answers the k-th send
        last_sent = sends[len(answers) - 1]
        last_expires_ms = answers[-1][4]
        assert last_sent < t_stop

        # safe-until: never past the last answered renewal's send + ttl, nor past
        # the moment the server stopped + ttl
        assert safe_until <= last_sent + ttl + 1e-3, (safe_until - last_sent)
        assert safe_until <= t_stop + ttl
        # declared at risk (and the work cancelled) at safe-until, not before,
        # and only scheduling latency after
        assert safe_until <= cancelled <= safe_until + SLACK_S, cancelled - safe_until
        # the episode that cancelled the work (seen by a task waiting on at_risk_event)
        seen = [t for t in r["at_risk_times"][run_id] if t <= cancelled + SLACK_S]
        assert seen and safe_until <= seen[-1] <= safe_until + SLACK_S
        assert cancelled - t_stop <= ttl + SLACK_S
        margin_ms = last_expires_ms - done["cancelled_wall_ms"]
        print(f"\nsafe_until = last answered send + {safe_until - last_sent:.3f} s; "
              f"work cancelled {1000 * (cancelled - safe_until):.1f} ms after safe_until, "
              f"{margin_ms:.1f} ms before the server's expires_at")
        assert done["cancelled_wall_ms"] <= last_expires_ms + 1000 * SLACK_S

        # the server is back: the queued renewal is answered, nobody took the run
        def safe_again() -> Any:
            rep = w.request("report", "report")
            return rep if not rep["at_risk_now"] else None

        rep = wait_for("the lease to be safe again", safe_again, 5, every=0.1)
        assert rep["lost"] == {} and rep["active"] == 1
        rec = get_run(stub, run_id)
        assert rec.lease.owner == "worker" and rec.fencing_token == info["token"]
        assert ts_ms(rec.lease.expires_at) > now_ms()
        assert w.request("finish", "finished")["ok"] == 1
