"""Worker processes for the stream system tests (test_stream_*.py).

Two sides live here:

- the **worker** (run as ``python _stream_worker.py MODE '<json config>'``):

  ``hold``: one SDK ``fencepost.Client`` (default stream renewal: one KeepAlive
  stream) acquires the leases of its config, keeps them alive in the
  background and obeys one-line JSON commands on stdin, answering with
  one-line JSON events on stdout (logs go to stderr):

      report            -> {"ev": "report", lost, at_risk, at_risk_now, ...}
      guard {run_id}    -> {"ev": "guard_entered"}, later {"ev": "guard_done", ...}
      finish            -> {"ev": "finished", ok, errors}
      exit              -> client.aclose(), then {"ev": "closed"} and exit 0
      crash             -> os._exit(3) at once (nothing closed)

  ``writer``: raw Ledger.Execute stream, rounds of acquire / renew / finish
  commands over its own run ids, each with a request id; when the stream
  drops (server restart) it reopens it and resends every unanswered command
  with the same request id. Ends with {"ev": "done", ok, errors, reconnects}.

- the **parent** handle, ``WorkerProc``: spawns one, sends commands, waits for
  events with a timeout, and always kills the process on ``close()``.

Times are ``time.monotonic()`` (CLOCK_MONOTONIC: comparable across processes
of one machine) or wall milliseconds (``*_ms``, the server's clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

SCRIPT = Path(__file__)


# =====================================================================================
# parent side
# =====================================================================================


class WorkerProc:
    """One worker process, driven over stdin/stdout JSON lines."""

    def __init__(self, mode: str, cfg: dict[str, Any], err_path: Path) -> None:
        self.name = cfg.get("owner", mode)
        self.err_path = err_path
        self._err: IO[bytes] = open(err_path, "wb")  # closed in close()
        self.proc = subprocess.Popen(
            [sys.executable, str(SCRIPT), mode, json.dumps(cfg)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )
        self.pid = self.proc.pid
        self._events: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True,
                                        name=f"worker-out-{self.pid}")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                self._events.put(json.loads(line))
            except ValueError:
                self._events.put({"ev": "garbage", "line": line.decode(errors="replace")})
        self._events.put(None)  # EOF

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.err_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def send(self, cmd: str, **args: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd, **args}) + "\n").encode())
        self.proc.stdin.flush()

    def expect(self, ev: str, timeout: float) -> dict[str, Any]:
        """The next event named ``ev`` (others before it are dropped)."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.name}: no {ev!r} within {timeout} s\n"
                                     + self.stderr_tail())
            try:
                got = self._events.get(timeout=left)
            except queue.Empty:
                continue
            if got is None:
                self._events.put(None)
                raise AssertionError(
                    f"{self.name}: exited ({self.proc.poll()}) before {ev!r}\n"
                    + self.stderr_tail())
            if got.get("ev") == "error":
                raise AssertionError(f"{self.name} failed: {got.get('error')}\n"
                                     + self.stderr_tail())
            if got.get("ev") == ev:
                return got

    def request(self, cmd: str, ev: str, timeout: float = 10.0, **args: Any) -> dict[str, Any]:
        self.send(cmd, **args)
        return self.expect(ev, timeout)

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def close(self) -> None:
        """Kill (SIGCONT first, in case it was stopped) and reap; idempotent."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGCONT)
                os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._reader.join(5)
        self._err.close()


@contextlib.contextmanager
def worker_pool() -> Iterator[list[WorkerProc]]:
    """A list to append WorkerProcs to; every one is killed when the block exits."""
    procs: list[WorkerProc] = []
    try:
        yield procs
    finally:
        for p in procs:
            p.close()


# =====================================================================================
# worker side
# =====================================================================================


def emit(ev: str, **fields: Any) -> None:
    sys.stdout.write(json.dumps({"ev": ev, **fields}) + "\n")
    sys.stdout.flush()


def _ms(dt: Any) -> int:
    return int(dt.timestamp() * 1000)


def _renews_in(msg: Any) -> list[Any]:
    """The renewals one KeepAliveRequest carries: its ``renew`` and, where the
    protocol has it, its repeated ``renews`` (handled after ``kind``)."""
    out = [msg.renew] if msg.WhichOneof("kind") == "renew" else []
    out.extend(getattr(msg, "renews", ()))
    return out


def _answers_in(resp: Any) -> list[Any]:
    """The messages one KeepAliveResponse carries (a ``batch`` or itself)."""
    batch = getattr(resp, "batch", None)
    return list(batch) if batch else [resp]


class _SpyCall:
    """Wraps the KeepAlive call the SDK opens: logs each renew written and each
    answer read, with this process's monotonic time (independent of the SDK's
    own bookkeeping). Taken just before the SDK's write goes out, so it is
    never earlier than the SDK's own send time."""

    def __init__(self, call: Any, wire: list[list[Any]]) -> None:
        self._call = call
        self._wire = wire

    async def write(self, msg: Any) -> None:
        now, wall = time.monotonic(), time.time()
        for r in _renews_in(msg):
            self._wire.append(["renew", r.run_id, now, wall])
        await self._call.write(msg)

    async def read(self) -> Any:
        import grpc

        resp = await self._call.read()
        if resp is grpc.aio.EOF:  # type: ignore[attr-defined]
            return resp
        now = time.monotonic()
        for one in _answers_in(resp):
            kind = one.WhichOneof("kind")
            if kind == "renewed":
                r = one.renewed
                exp = r.expires_at.seconds * 1000 + r.expires_at.nanos // 1_000_000
                self._wire.append(["renewed", r.run_id, now, r.ttl_remaining_ms, exp])
            elif kind is not None:
                self._wire.append([kind, getattr(one, kind).run_id, now])
        return resp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _LeaseWatch:
    """Counts a lease's at-risk episodes with the public API only."""

    def __init__(self, lease: Any) -> None:
        self.lease = lease
        self.at_risk: list[float] = []  # monotonic time each episode was seen
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        lease = self.lease
        while lease.is_active:
            await lease.at_risk_event.wait()
            if not lease.is_active:
                return  # lost (lost sets the event too) or given up
            self.at_risk.append(time.monotonic())
            # no public event for "safe again": poll while the episode lasts
            while lease.at_risk_event.is_set() and lease.is_active:  # noqa: ASYNC110
                await asyncio.sleep(0.02)


class Holder:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.lost: dict[str, list[Any]] = {}
        self.leases: dict[str, Any] = {}
        self.watches: dict[str, _LeaseWatch] = {}
        self.wire: list[list[Any]] = []
        self.min_margin = float("inf")
        self.min_margin_at = 0.0
        self.guards: set[asyncio.Task[None]] = set()
        self.client: Any = None

    def on_lost(self, lease: Any, reason: Any) -> None:
        self.lost[lease.run_id] = [reason.value, time.monotonic()]

    async def run(self) -> None:
        import fencepost

        cfg = self.cfg
        client = fencepost.Client(
            cfg["addr"], owner=cfg["owner"], on_lost=self.on_lost,
            channel_options=[tuple(o) for o in cfg.get("channel_options", [])],
        )
        self.client = client
        commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def read_stdin() -> None:
            for line in sys.stdin:
                loop.call_soon_threadsafe(commands.put_nowait, json.loads(line))
            loop.call_soon_threadsafe(commands.put_nowait, None)

        threading.Thread(target=read_stdin, daemon=True).start()
        async with client:
            if cfg.get("spy"):  # this process's KeepAlive streams, seen on the wire
                from fencepost import _renewal

                opened = _renewal.open_keepalive
                _renewal.open_keepalive = (  # type: ignore[assignment]
                    lambda endpoint: _SpyCall(opened(endpoint), self.wire))
            t0 = time.monotonic()
            for prefix, count, ttl_ms in cfg["groups"]:
                ids = [f"{prefix}{i:04d}" for i in range(count)]
                for k in range(0, len(ids), 50):
                    got = await asyncio.gather(
                        *(client.acquire(r, ttl_ms=ttl_ms) for r in ids[k:k + 50]))
                    for lease in got:
                        self.leases[lease.run_id] = lease
                        self.watches[lease.run_id] = _LeaseWatch(lease)
            sampler = asyncio.create_task(self._sample())
            emit("ready", acquire_s=time.monotonic() - t0, leases={
                r: {"token": le.fencing_token, "ttl_ms": le.ttl_ms,
                    "expires_at_ms": _ms(le.record.lease.expires_at)}
                for r, le in self.leases.items()})
            try:
                while (cmd := await commands.get()) is not None:
                    name = cmd["cmd"]
                    if name == "report":
                        emit("report", **self.report(cmd.get("detail", False)))
                    elif name == "guard":
                        task = asyncio.create_task(self.guarded(self.leases[cmd["run_id"]]))
                        self.guards.add(task)
                    elif name == "finish":
                        emit("finished", **await self.finish_all())
                    elif name == "crash":
                        os._exit(3)
                    elif name == "exit":
                        break
            finally:
                sampler.cancel()
                for t in self.guards:
                    t.cancel()
        emit("closed")

    async def _sample(self) -> None:
        """The smallest margin (safe_until - now) seen over the active leases."""
        while True:
            await asyncio.sleep(0.1)
            now = time.monotonic()
            for lease in self.leases.values():
                if lease.is_active and lease.safe_until - now < self.min_margin:
                    self.min_margin = lease.safe_until - now
                    self.min_margin_at = now

    def report(self, detail: bool) -> dict[str, Any]:
        out: dict[str, Any] = {
            "lost": self.lost,
            "at_risk": {r: len(w.at_risk) for r, w in self.watches.items() if w.at_risk},
            "at_risk_now": sorted(r for r, le in self.leases.items()
                                  if le.is_active and le.at_risk),
            "active": sum(le.is_active for le in self.leases.values()),
            "sessions": self.sessions(),
            "min_margin_s": self.min_margin,
            "min_margin_at": self.min_margin_at,
            "now": time.monotonic(),
        }
        if detail:
            out["safe_until"] = {r: le.safe_until for r, le in self.leases.items()
                                 if le.is_active}
            out["at_risk_times"] = {r: w.at_risk for r, w in self.watches.items()}
            out["wire"] = self.wire
        return out

    def sessions(self) -> int | None:
        """The KeepAlive streams the client opened (None before it exists)."""
        client = self.client
        return None if client is None else client.statistics().keepalive_streams_opened

    async def finish_all(self) -> dict[str, Any]:
        ok = 0
        errors: dict[str, str] = {}
        active = [le for le in self.leases.values() if le.is_active]
        for k in range(0, len(active), 50):
            chunk = active[k:k + 50]
            got = await asyncio.gather(*(le.finish() for le in chunk), return_exceptions=True)
            for le, res in zip(chunk, got, strict=True):
                if isinstance(res, BaseException):
                    errors[le.run_id] = repr(res)
                else:
                    ok += 1
        return {"ok": ok, "errors": errors}

    async def guarded(self, lease: Any) -> None:
        """Work inside ``lease.guard()`` until the guard cancels it."""
        from fencepost import LeaseAtRiskError, LeaseLostError

        out: dict[str, Any] = {"run_id": lease.run_id, "iterations": 0}
        try:
            async with lease.guard():
                emit("guard_entered", t=time.monotonic())
                try:
                    while True:
                        await asyncio.sleep(0.005)
                        out["iterations"] += 1
                        out["last_iteration"] = time.monotonic()
                except asyncio.CancelledError:
                    out["cancelled_at"] = time.monotonic()
                    out["cancelled_wall_ms"] = time.time() * 1000
                    out["safe_until_at_cancel"] = lease.safe_until
                    raise
        except (LeaseLostError, LeaseAtRiskError) as exc:
            out["error"] = type(exc).__name__
            out["reason"] = exc.reason.value if exc.reason is not None else None
        except asyncio.CancelledError:
            out["error"] = "CancelledError"
        except Exception as exc:
            out["error"] = repr(exc)
        out["exited_at"] = time.monotonic()
        emit("guard_done", **out)


# -- writer ---------------------------------------------------------------------------


class Executor:
    """Commands over one Ledger.Execute stream, reopened when it drops."""

    def __init__(self, addr: str) -> None:
        import grpc
        from _proc import CHANNEL_OPTIONS

        from fencepost.v1 import ledger_pb2_grpc

        self.channel = grpc.insecure_channel(addr, options=CHANNEL_OPTIONS)
        self.stub = ledger_pb2_grpc.LedgerStub(self.channel)
        self.reconnects = 0
        self._open()

    def _open(self) -> None:
        self.requests: queue.Queue[Any] = queue.Queue()

        def feed(q: queue.Queue[Any]) -> Iterator[Any]:
            while (item := q.get()) is not None:
                yield item

        self.responses = self.stub.Execute(feed(self.requests))

    def run(self, commands: list[Any], deadline_s: float = 30.0) -> dict[int, Any]:
        """Send every command (one ExecuteRequest); return each one's result.
        After a dropped stream, resend the unanswered ones (same request ids)."""
        import grpc

        from fencepost.v1 import ledger_pb2 as pb

        results: dict[int, Any] = {}
        pending = {c.id: c for c in commands}
        deadline = time.monotonic() + deadline_s
        self.requests.put(pb.ExecuteRequest(commands=commands))
        while pending:
            try:
                resp = next(self.responses)
            except (grpc.RpcError, StopIteration):
                if time.monotonic() > deadline:
                    raise
                self.requests.put(None)
                self.responses.cancel()
                time.sleep(0.05)
                self.reconnects += 1
                self._open()
                self.requests.put(pb.ExecuteRequest(commands=list(pending.values())))
                continue
            for result in resp.results:
                if result.id in pending:
                    del pending[result.id]
                    results[result.id] = result
        return results

    def close(self) -> None:
        self.requests.put(None)
        self.responses.cancel()
        self.channel.close()


def writer(cfg: dict[str, Any]) -> None:
    """Rounds over this writer's runs: acquire all, renew all ``renews`` times
    (or, with ``checkpoints``, record a checkpoint: a write, where a renewal
    is answered from memory), finish all; ``chunk`` commands per message,
    ``pause_s`` between them."""
    from fencepost.v1 import ledger_pb2 as pb
    from fencepost.v1 import record_pb2 as rpb

    owner = cfg["owner"]
    ids = [f"{owner}-{i:04d}" for i in range(cfg["runs"])]
    ex = Executor(cfg["addr"])
    seq = iter(range(1, 1 << 62))
    ok = 0
    errors: dict[str, int] = {}
    tokens: dict[str, int] = {}
    middle = "record_checkpoint" if cfg.get("checkpoints") else "renew"
    rounds = ["acquire", *[middle] * cfg["renews"], "finish"]
    t0 = time.monotonic()
    for kind in rounds:
        for k in range(0, len(ids), cfg["chunk"]):
            cmds = []
            for run_id in ids[k:k + cfg["chunk"]]:
                rid = uuid.uuid4().hex
                if kind == "acquire":
                    req: Any = pb.AcquireRequest(run_id=run_id, owner=owner,
                                                 lease_ttl_ms=60_000, request_id=rid)
                elif kind == "renew":
                    req = pb.RenewRequest(run_id=run_id, owner=owner,
                                          fencing_token=tokens.get(run_id, 0), request_id=rid)
                elif kind == "record_checkpoint":
                    req = pb.RecordCheckpointRequest(run_id=run_id, owner=owner,
                                                     fencing_token=tokens.get(run_id, 0),
                                                     key="k", request_id=rid)
                else:
                    req = pb.FinishRequest(run_id=run_id, owner=owner,
                                           fencing_token=tokens.get(run_id, 0),
                                           status=rpb.RUN_STATUS_COMPLETED, request_id=rid)
                cmds.append(pb.Command(id=next(seq), **{kind: req}))
            by_id = {c.id: c for c in cmds}
            for cid, res in ex.run(cmds).items():
                which = res.WhichOneof("kind")
                if which == "error":
                    errors[res.error.message[:80]] = errors.get(res.error.message[:80], 0) + 1
                    continue
                ok += 1
                if which == "acquire":
                    tokens[by_id[cid].acquire.run_id] = res.acquire.run.fencing_token
            if cfg["pause_s"]:
                time.sleep(cfg["pause_s"])
    ex.close()
    emit("done", ok=ok, errors=errors, reconnects=ex.reconnects,
         seconds=time.monotonic() - t0)


def main() -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    mode, cfg = sys.argv[1], json.loads(sys.argv[2])
    try:
        if mode == "hold":
            asyncio.run(Holder(cfg).run())
        elif mode == "writer":
            writer(cfg)
        else:
            raise SystemExit(f"unknown mode {mode!r}")
    except Exception as exc:
        emit("error", error=repr(exc))
        raise


if __name__ == "__main__":
    main()
