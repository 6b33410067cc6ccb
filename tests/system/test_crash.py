"""SIGKILL the server under load and restart it on the same file (docs/SPEC.md §5.5, §9).

* ``test_crash_under_load``: ten client threads (each its own channel and
  owner) run Acquire / Renew / RecordCheckpoint / Finish / Release loops on
  their own runs and on a few shared ones. The server is SIGKILLed mid-load,
  restarted on the same file and port, SIGKILLed again, restarted again; the
  clients ride through the outages by retrying with the same request id. Every
  write a client saw acknowledged must be in the committed history with that
  version and token, tokens never go backwards, revisions are gap-free, the
  runs table matches the history, and ``PRAGMA integrity_check`` is ok - both
  on the file a crash left behind and after a final graceful stop.
* ``test_lease_survives_crash``: a lease acknowledged (by a Renew) until T is
  not granted to another owner before T across a SIGKILL and restart, and is
  granted after T.
"""

from __future__ import annotations

import random
import re
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import grpc
import pytest
from _history import check_acks, check_history, fmt, load
from _proc import CHANNEL_OPTIONS, error_record, now_ms, reason, running_server, ts_ms

from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost.v1 import record_pb2 as rpb

CLIENTS = 10
SHARED = [f"shared-{i}" for i in range(4)]
RETRYABLE = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "STORAGE_UNAVAILABLE"}


class Client(threading.Thread):
    """One worker: own channel, own owner id; records every acknowledged write."""

    def __init__(self, idx: int, addr: str, stop: threading.Event) -> None:
        super().__init__(name=f"client-{idx}", daemon=True)
        self.idx = idx
        self.owner = f"client-{idx}"
        self.addr = addr
        self.stop = stop
        self.rng = random.Random(idx)
        self.acks: list[dict[str, Any]] = []
        self.errors: Counter[str] = Counter()
        self.retries = 0
        self.unknown = 0  # calls abandoned with an unknown outcome at the end
        self.failure: BaseException | None = None
        self.stub: ledger_pb2_grpc.LedgerStub | None = None

    def call(self, op: str, run_id: str, sent: int | None, method: str, req: Any) -> Any:
        """Call with a request id; retry transport failures with the same id
        (docs/SPEC.md §5.5) until answered. Returns the Run, or the refusal reason."""
        req.request_id = uuid.uuid4().hex
        fn = getattr(self.stub, method)
        give_up = None
        tries = 0
        while True:
            tries += 1
            try:
                resp = fn(req, timeout=3)
            except grpc.RpcError as err:
                why = reason(err)
                if why not in RETRYABLE:
                    self.errors[why] += 1
                    return why
                self.retries += 1
                if self.stop.is_set():
                    give_up = give_up or time.monotonic() + 3
                    if time.monotonic() > give_up:
                        self.unknown += 1
                        return why
                time.sleep(0.02)
                continue
            run: rpb.Run = resp.run
            self.acks.append({
                "op": op, "run_id": run_id, "owner": self.owner, "sent_token": sent,
                "token": run.fencing_token, "version": run.version,
                "revision": run.revision, "status": int(run.status), "at": time.monotonic(),
                "tries": tries,
            })
            return run

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.addr, options=CHANNEL_OPTIONS) as ch:
                self.stub = ledger_pb2_grpc.LedgerStub(ch)
                gen = 0
                while not self.stop.is_set():
                    if self.rng.random() < 0.6:
                        run_id = f"own-{self.idx}-{gen}"
                    else:
                        run_id = self.rng.choice(SHARED)
                    if self.cycle(run_id) and run_id.startswith("own-"):
                        gen += 1
        except BaseException as exc:  # surfaced by the test
            self.failure = exc

    def cycle(self, run_id: str) -> bool:
        """One acquire..finish/release; True when the run was finished."""
        got = self.call("acquire", run_id, None, "Acquire",
                        pb.AcquireRequest(run_id=run_id, owner=self.owner, lease_ttl_ms=600))
        if isinstance(got, str):
            time.sleep(0.01)
            return got == "RUN_ALREADY_TERMINAL"
        tok = got.fencing_token
        for n in range(self.rng.randint(1, 4)):
            if self.rng.random() < 0.5:
                w = self.call("renew", run_id, tok, "Renew",
                              pb.RenewRequest(run_id=run_id, owner=self.owner, fencing_token=tok))
            else:
                w = self.call("checkpoint", run_id, tok, "RecordCheckpoint",
                              pb.RecordCheckpointRequest(run_id=run_id, owner=self.owner,
                                                         fencing_token=tok, key=f"k{n}",
                                                         snapshot_version=n))
            if isinstance(w, str):
                return False
        if run_id in SHARED or self.rng.random() < 0.3:
            self.call("release", run_id, tok, "Release",
                      pb.ReleaseRequest(run_id=run_id, owner=self.owner, fencing_token=tok))
            return False
        done = self.call("finish", run_id, tok, "Finish",
                         pb.FinishRequest(run_id=run_id, owner=self.owner, fencing_token=tok,
                                          status=rpb.RUN_STATUS_COMPLETED))
        return not isinstance(done, str)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_crash_under_load(tmp_path: Path) -> None:
    stop = threading.Event()
    clients: list[Client] = []
    kills: list[float] = []
    with running_server(tmp_path) as srv:
        try:
            clients = [Client(i, srv.address, stop) for i in range(CLIENTS)]
            for c in clients:
                c.start()
            for load_s in (2.0, 1.5):
                time.sleep(load_s)
                srv.kill()  # SIGKILL mid-load
                kills.append(time.monotonic())
                time.sleep(0.2)  # clients see UNAVAILABLE and keep retrying
                srv.restart()
            time.sleep(1.0)
        finally:
            stop.set()
            for c in clients:
                c.join(15)
        assert not any(c.is_alive() for c in clients), "a client thread hung"
        for c in clients:
            assert c.failure is None, f"{c.name} crashed: {c.failure!r}"
        # A last crash with the clients idle: the file as a crash leaves it.
        srv.kill()
        crashed = load(srv.db_path)
        srv.restart()
        served = _read_all_runs(srv.address, crashed.runs)
        rc = srv.stop()
        assert rc == 0, f"graceful stop exited {rc}:\n{srv.log_tail()}"
        log = srv.log_tail(20000)
    final = load(srv.db_path)

    acks = [a for c in clients for a in c.acks]
    errors = sum((c.errors for c in clients), Counter())
    retries = sum(c.retries for c in clients)
    unknown = sum(c.unknown for c in clients)
    # Retried calls answered from before the crash: the request-id replay path.
    starts = [int(m) for m in re.findall(r"serving on .* revision=(\d+)", log)]
    replayed = sum(
        1 for a in acks
        if a["tries"] > 1 and any(a["revision"] <= r for r in starts[1:3])
        and a["at"] > kills[0]
    )
    print(f"\nreplayed={replayed} acks={len(acks)} revisions={len(final.changes)} "
          f"runs={len(final.runs)} retries={retries} unknown={unknown} errors={dict(errors)}")

    problems: list[str] = []
    for name, snap in (("after SIGKILL", crashed), ("after graceful stop", final)):
        problems += [f"[{name}] {p}" for p in check_history(snap)]
        problems += [f"[{name}] {p}" for p in check_acks(snap, acks)]
    if final.changes[: len(crashed.changes)] != crashed.changes:
        problems.append("the history changed between the crash and the final stop")
    for run_id, row in crashed.runs.items():
        got = served.get(run_id)
        if got != (row["version"], row["fencing_token"], row["revision"]):
            problems.append(f"{run_id}: restarted server serves {got}, the file has "
                            f"{(row['version'], row['fencing_token'], row['revision'])}")
    # Retries carried the original request id, so every committed change was
    # answered to exactly one call: a retry whose first attempt had committed
    # before the crash got the original answer back, it did not apply again.
    # (a renewal answered from memory carries the revision of the write it renewed)
    acked = Counter(a["revision"] for a in acks if a["op"] != "renew")
    acked.update({a["revision"] for a in acks if a["op"] == "renew"} - acked.keys())
    twice = [r for r, n in acked.items() if n > 1]
    unacked = [c.revision for c in final.changes if c.revision not in acked]
    if twice:
        problems.append(f"revisions acknowledged to more than one call: {twice[:10]}")
    if len(unacked) > unknown:
        problems.append(f"{len(unacked)} committed changes nobody was answered for (only "
                        f"{unknown} calls were abandoned): revisions {unacked[:10]}")
    unexpected = set(errors) - {"RUN_LEASE_HELD", "RUN_LEASE_LOST", "RUN_ALREADY_TERMINAL"}
    if unexpected:
        problems.append(f"unexpected refusals: {dict(errors)}")
    assert "Traceback" not in log, log[-5000:]
    assert not problems, fmt(problems)

    # Not vacuous: the kills landed in the middle of acknowledged traffic.
    phases = Counter(sum(a["at"] > k for k in kills) for a in acks)
    assert all(phases[p] >= 50 for p in range(3)), f"acks per phase: {phases}"
    assert retries > 0, "no call ever saw the server down"
    assert len(final.runs) >= 20


def _read_all_runs(addr: str, runs: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    out = {}
    with grpc.insecure_channel(addr, options=CHANNEL_OPTIONS) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        for run_id in runs:
            r = stub.GetRun(pb.GetRunRequest(run_id=run_id), timeout=5).run
            out[run_id] = (r.version, r.fencing_token, r.revision)
    return out


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_lease_survives_crash(tmp_path: Path) -> None:
    run_id = "leased"
    with running_server(tmp_path) as srv, grpc.insecure_channel(
        srv.address, options=CHANNEL_OPTIONS
    ) as ch:
        stub = ledger_pb2_grpc.LedgerStub(ch)
        a = stub.Acquire(pb.AcquireRequest(run_id=run_id, owner="A", lease_ttl_ms=1000),
                         timeout=5).run
        t_acquire = ts_ms(a.lease.expires_at)
        time.sleep(0.2)
        r = stub.Renew(pb.RenewRequest(run_id=run_id, owner="A", fencing_token=a.fencing_token,
                                       lease_ttl_ms=4000), timeout=5).run
        t_until = ts_ms(r.lease.expires_at)  # acknowledged: A holds the run until T
        assert t_until >= t_acquire + 3000
        srv.kill()
        srv.restart()

        held = 0
        held_past_acquire = 0  # refusals the acquire's expiry alone would not explain
        taken: rpb.Run | None = None
        while now_ms() < t_until + 2000:
            sent = now_ms()
            try:
                taken = stub.Acquire(pb.AcquireRequest(run_id=run_id, owner="B",
                                                       lease_ttl_ms=5000), timeout=5).run
                break
            except grpc.RpcError as err:
                assert reason(err) == "RUN_LEASE_HELD", f"{reason(err)} at T{sent - t_until:+}ms"
                seen = error_record(err)
                assert seen is not None
                assert ts_ms(seen.lease.expires_at) == t_until, "the renewed expiry was lost"
                assert seen.lease.owner == "A" and seen.fencing_token == a.fencing_token
                held += 1
                held_past_acquire += sent > t_acquire
            time.sleep(0.05)
        assert taken is not None, f"B never got the run after T ({held} refusals)"
        acquired_at = ts_ms(taken.lease.acquired_at)
        assert acquired_at >= t_until, (
            f"B was granted the run at {acquired_at}, {t_until - acquired_at} ms before "
            f"A's acknowledged lease ran out"
        )
        assert held_past_acquire >= 10, (
            f"only {held_past_acquire} of {held} refusals came between the acquire's expiry "
            "and T"
        )
        assert taken.fencing_token == a.fencing_token + 1
        assert taken.attempt == 2
        with pytest.raises(grpc.RpcError) as lost:
            stub.Renew(pb.RenewRequest(run_id=run_id, owner="A", fencing_token=a.fencing_token),
                       timeout=5)
        assert reason(lost.value) == "RUN_LEASE_LOST"
        assert srv.stop() == 0
