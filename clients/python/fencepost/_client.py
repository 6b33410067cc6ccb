"""The async client, the lease handle a worker holds, the object
``Client.acquire`` returns (awaitable and an async context manager) and the
guard that cancels work when a lease is lost.

How a lease's state is kept (docs/SPEC.md §6.1, docs/STREAMS.md):

- *safe-until*: every answered renewal (the Acquire itself, a stream
  ``renewed``, a unary Renew or RecordCheckpoint) gives a deadline on this
  process's monotonic clock: the time the renewal was *sent* plus the ttl the
  server granted at the commit. Clock skew cannot stretch it; network delay
  only makes it earlier.
- *at risk*: past safe-until with no newer renewal answered, or after an
  ``expiring`` push. Not final: a later renewal that gets answered makes the
  lease safe again.
- *lost*: a ``lost`` push, or a fenced call refused with RUN_LEASE_LOST.
  Final for the handle.
"""

from __future__ import annotations

import asyncio
import builtins
import heapq
import inspect
import logging
import math
import os
import secrets
import socket
import time
from collections.abc import AsyncGenerator, Callable, Generator, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from types import TracebackType
from typing import TYPE_CHECKING, Any, Literal

import grpc

from ._connection import Connection, Transport
from ._endpoints import Endpoint, parse_endpoints
from ._errors import (
    ClientClosedError,
    EventLoopError,
    FencepostError,
    LeaseAtRiskError,
    LeaseLostError,
    OutcomeUnknownError,
    StreamTooSlowError,
    UnavailableError,
    UsageError,
    from_rpc_error,
)
from ._execute import check_window
from ._records import (
    DeleteResult,
    FenceStatus,
    LostReason,
    RunListing,
    RunRecord,
    RunStatus,
    WatchEvent,
    derive_lost_reason,
    parse_status,
    record_from_pb,
    status_from_pb,
    status_to_pb,
    watch_event_from_pb,
)
from ._renewal import NoRenewer, Renewer, RoutedRenewer, UnaryRenewer
from ._retry import RetryPolicy
from ._security import TLS, channel_credentials
from ._shards import ShardInfo, ShardMap, shard_info_from_pb, shard_map_from_pb, shard_of
from ._store import AsyncStore, fence_of, telling
from ._watch import WatchCursor, watch_by_shards
from .v1 import ledger_pb2, ledger_pb2_grpc, record_pb2, run_store_pb2_grpc

if TYPE_CHECKING:
    from ._transaction import StoreTransaction
    from .v1.ledger_pb2_grpc import LedgerAsyncStub
    from .v1.run_store_pb2_grpc import RunStoreAsyncStub

log = logging.getLogger("fencepost")

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEFAULT_TTL_MS = 60_000
DEFAULT_RETRY = RetryPolicy()
# Time a lease release gets when it runs as cleanup (block exit, cancellation).
CLEANUP_TIMEOUT_S = 5.0
# The retries of that release: they end (and say why) within the bound above;
# when the lease is at risk (this process is cut off from the coordinator) the
# release gets one second, since the lease will expire on the server anyway.
_CLEANUP_RETRY = RetryPolicy(total_timeout_s=CLEANUP_TIMEOUT_S - 1, attempt_timeout_s=2.0)
_AT_RISK_CLEANUP_RETRY = RetryPolicy(max_backoff_s=0.25, total_timeout_s=1.0,
                                     attempt_timeout_s=1.0)

def _ledger_rpc(method: str) -> Callable[[Endpoint], Callable[..., Any]]:
    """The Ledger RPC ``method`` (a unary multi-callable of the generated
    stub: ``rpc(request, timeout=...)``) on an endpoint."""
    return lambda endpoint: getattr(endpoint.stub(ledger_pb2_grpc.LedgerStub), method)


# What ``Client(on_lost=...)`` is called with: the lease and why it was lost.
# It runs on the client's event loop and must not block; when it returns an
# awaitable, the client runs that as a task (and awaits it on close).
OnLost = Callable[["Lease", LostReason], object]

Renewal = Literal["stream", "unary", "off"]

# Lease state changes told to listeners (the sync facade's threading events).
LOST, AT_RISK, SAFE = "lost", "at_risk", "safe"


def default_owner() -> str:
    """``{hostname}-{pid}-{random}``: two live processes never share one."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"



@dataclass(frozen=True, slots=True)
class ClientStatistics:
    """What a client has sent and keeps alive, at one moment
    (``Client.statistics()``): for tests, benchmarks and dashboards. Counts
    run from the client's creation. Clients that share an Execute stream
    (``Client``'s docs) report the shared stream's counts."""

    endpoints: tuple[str, ...]  # every endpoint known: those given, then leaders learned
    leases_kept: int  # leases the renewer keeps alive (0 with renewal="off")
    keepalive_streams_opened: int
    keepalive_messages_sent: int
    keepalive_stream_name: str  # the open KeepAlive stream's name; "" while none is
    renewal_passes: int  # the stream renewer's passes over the leases due
    execute_stream_open: bool  # mutations travel on the Execute stream right now
    execute_streams_opened: int
    execute_messages_sent: int
    execute_commands_sent: int  # commands those messages carried


@dataclass(frozen=True, slots=True)
class Stubs:
    """The raw generated async stubs on the client's channel (escape hatch)."""

    ledger: LedgerAsyncStub
    run_store: RunStoreAsyncStub


class Lease:
    """A worker's handle on a run: ``(run_id, owner, fencing_token)``.

    Fenced calls (``renew``, ``record_checkpoint``, ``suspend``, ``finish``,
    ``release``) carry the token. While active, the lease is renewed in the
    background at a third of its ttl (over the client's one KeepAlive stream,
    or by unary Renew calls with ``renewal="unary"``); ``suspend``, ``finish``,
    ``release`` and closing the client stop that.

    Loss is surfaced three ways: the ``lost`` event (set on a ``lost`` push
    from the server, with ``lost_reason``), a ``LeaseLostError`` from the next
    fenced call (raised locally at once when the loss is already known), and
    ``guard()``, which cancels the guarded block. The client's ``on_lost``
    callback is called too. Before a loss is known, ``safe_until`` and
    ``at_risk`` tell whether this process may still assume it holds the lease.
    """

    def __init__(
        self, client: Client, record: RunRecord, ttl_ms: int, *, sent_at: float | None = None
    ) -> None:
        assert record.lease is not None, "an acquired run has a lease"
        self._client = client
        self._record = record
        self._run_id = record.run_id
        self._owner = record.lease.owner
        self._token = record.fencing_token
        self._ttl_ms = ttl_ms
        self._lost = asyncio.Event()
        self._lost_reason: LostReason | None = None
        self._done = False  # suspended, finished or released by this handle
        # safe-until: (sent, answered, safe_until) of the answered renewals that
        # may have been the last committed (see _renewed)
        self._renewals: builtins.list[tuple[float, float, float]] = []
        self._safe_until = -math.inf
        self._expiring_at: datetime | None = None  # an `expiring` push not yet superseded
        self._at_risk_event = asyncio.Event()  # at risk or lost
        self._risk_epoch = 0  # how many times the lease became at risk or lost
        self._risk_timer: asyncio.TimerHandle | None = None
        self._risk_at = -math.inf  # the safe-until the timer was set for
        self._listeners: builtins.list[Callable[[str], None]] = []
        self._guards: set[_Guard] = set()
        self._kept = _Kept(self)  # what the renewer sees of this lease
        if sent_at is not None:
            self._note_renewal(sent_at, record)

    def __repr__(self) -> str:
        if self.is_lost:
            state = f"lost ({self._lost_reason})"
        elif not self.is_active:
            state = "done"
        else:
            state = "at risk" if self.at_risk else "active"
        return f"<Lease {self._run_id!r} owner={self._owner!r} token={self._token} {state}>"

    # -- state ---------------------------------------------------------------------

    @property
    def run_id(self) -> str:
        return self._run_id

    @property
    def owner(self) -> str:
        return self._owner

    @property
    def fencing_token(self) -> int:
        """The token to pass to downstream writes (see ``validate_fence``)."""
        return self._token

    @property
    def ttl_ms(self) -> int:
        """The ttl background renewals ask for (the last one given)."""
        return self._ttl_ms

    @property
    def record(self) -> RunRecord:
        """The latest record this handle has seen."""
        return self._record

    @property
    def lost(self) -> asyncio.Event:
        """Set once the fence moved: a ``lost`` push on the KeepAlive stream, or
        a fenced call refused with RUN_LEASE_LOST. Final."""
        return self._lost

    @property
    def is_lost(self) -> bool:
        return self._lost.is_set()

    @property
    def lost_reason(self) -> LostReason | None:
        """Why the lease was lost (``taken_over``, ``cancelled``, ``deleted``,
        ``fence_moved``, ``finished``); None while not lost."""
        return self._lost_reason

    @property
    def is_active(self) -> bool:
        """Neither lost nor given up (suspended, finished, released)."""
        return not self._done and not self.is_lost

    @property
    def safe_until(self) -> float:
        """Until when this process may assume it holds the lease, as a
        ``time.monotonic()`` reading (seconds; compare with ``time.monotonic()``,
        never with wall time): the send time of the latest answered renewal
        plus the ttl the server granted. Past it, another owner may already
        hold the run. ``-inf`` once the lease is lost or given up."""
        return self._safe_until if self.is_active else -math.inf

    @property
    def at_risk(self) -> bool:
        """True when this process can no longer assume it holds the lease: it
        is lost, safe-until has passed with no newer renewal answered, or the
        server reported the lease ``expiring``. False once given up. Not final
        while not lost: a renewal answered later makes it False again."""
        if self._done:
            return False
        if self.is_lost:
            return True
        return self._expiring_at is not None or time.monotonic() >= self._safe_until

    @property
    def at_risk_event(self) -> asyncio.Event:
        """Set when the lease becomes at risk or lost (``guard()`` cancels its
        block at that moment); cleared if a later renewal makes it safe again
        (never once lost)."""
        return self._at_risk_event

    def check(self) -> None:
        """Raise ``LeaseLostError`` if the lease is lost, ``LeaseAtRiskError``
        (not a kind of it) if it is at risk; return None otherwise. A cheap local
        check, for loops that do side effects between awaits."""
        if self.is_lost:
            raise self._lost_error()
        if self.at_risk:
            raise self._at_risk_error()

    def guard(self) -> _Guard:
        """``async with lease.guard():`` -- cancel the block the moment the lease
        is lost (the fence moved) or becomes at risk (safe-until passed, or
        ``expiring``), and raise ``LeaseLostError`` (``LeaseAtRiskError`` for
        at-risk) out of the ``async with`` instead of ``CancelledError``.

        Entering raises at once when the lease is already lost or at risk. A
        cancellation from outside still propagates as ``CancelledError``. The
        block runs in the current task, which is the one cancelled."""
        return _Guard(self)

    # -- fenced writes to the engine store -----------------------------------------

    def fenced(self) -> AsyncStore:
        """The client's engine store with every write fenced by this lease:
        each commits only while this lease's token is the run's current one,
        checked by the server in the same step as the write. After a takeover
        (or cancel, delete, finish) a write raises ``LeaseLostError``, writes
        nothing, and marks this lease lost. Reads are unchanged."""
        view = self._client.store.fenced(run_id=self._run_id, fencing_token=self._token)
        return telling(view, self._fence_refused)

    def transaction(self) -> StoreTransaction:
        """``async with lease.transaction() as tx:`` -- the store writes made on
        ``tx`` (and ``tx.renew()``, ``tx.record_checkpoint()``) commit together,
        under this lease's fence, or not at all: a stale fence raises
        ``LeaseLostError`` and nothing of the block is written (see
        ``fencepost.StoreTransaction``)."""
        from ._transaction import StoreTransaction

        view = self.fenced()
        return StoreTransaction(view, fence_of(view), lease=self._kept)

    def _fence_refused(self, exc: FencepostError) -> None:
        """A fenced write was refused RUN_LEASE_LOST: the lease is lost unless the
        refusal was about another run, or this handle gave the lease up itself."""
        if not isinstance(exc, LeaseLostError) or not self.is_active:
            return
        rec = exc.record
        if rec is not None and rec.run_id != self._run_id:
            return
        exc.reason = derive_lost_reason(rec, self._token)
        self._mark_lost(rec, exc.reason)

    # -- fenced calls --------------------------------------------------------------

    async def renew(self, ttl_ms: int | None = None) -> RunRecord:
        """Extend the lease to server-now + ttl (default: ``ttl_ms``, the ttl
        of the acquire or of the last renew that gave one). A ttl given here
        is also used by later background renewals."""
        ttl = self._ttl_ms if ttl_ms is None else ttl_ms
        req = ledger_pb2.RenewRequest(run_id=self._run_id, owner=self._owner,
                                      fencing_token=self._token, lease_ttl_ms=ttl)
        rec = await self._fenced("Renew", req)
        self._ttl_ms = ttl
        return rec

    async def record_checkpoint(self, key: str, snapshot_version: int) -> RunRecord:
        """Point the record at a durable checkpoint; renews the lease too."""
        req = ledger_pb2.RecordCheckpointRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token, key=key,
            snapshot_version=snapshot_version,
        )
        return await self._fenced("RecordCheckpoint", req)

    async def suspend(self, pending_approval_ids: Sequence[str] = ()) -> RunRecord:
        """Park the run (-> suspended) and give up the lease."""
        req = ledger_pb2.SuspendRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token,
            pending_approval_ids=builtins.list(pending_approval_ids),
        )
        return await self._fenced("Suspend", req, drops_lease=True)

    async def finish(
        self,
        status: RunStatus | str = RunStatus.COMPLETED,
        outcome_code: str | None = None,
        message: str | None = None,
    ) -> RunRecord:
        """End the run as completed, failed or cancelled and give up the lease.
        ``outcome_code`` defaults to "ok" (completed) or "cancelled"; a failed
        run needs one."""
        st = parse_status(status)
        req = ledger_pb2.FinishRequest(
            run_id=self._run_id, owner=self._owner, fencing_token=self._token,
            status=status_to_pb(st),  # type: ignore[arg-type]
        )
        if outcome_code is not None or message is not None:
            code = outcome_code
            if code is None:
                code = {RunStatus.COMPLETED: "ok", RunStatus.CANCELLED: "cancelled"}.get(st, "")
            outcome = record_pb2.Outcome(code=code)
            if message is not None:
                outcome.message = message
            req.outcome.CopyFrom(outcome)
        return await self._fenced("Finish", req, drops_lease=True)

    async def release(self) -> RunRecord:
        """Give the run back unfinished (-> queued); it is acquirable at once."""
        req = ledger_pb2.ReleaseRequest(run_id=self._run_id, owner=self._owner,
                                        fencing_token=self._token)
        return await self._fenced("Release", req, drops_lease=True)

    # -- internals: state ------------------------------------------------------------

    def _add_listener(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(LOST | AT_RISK | SAFE)`` on the client's loop at
        each change of state (call on the loop thread)."""
        self._listeners.append(listener)

    def _tell(self, change: str) -> None:
        for listener in builtins.list(self._listeners):
            try:
                listener(change)
            except Exception:
                log.exception("lease listener failed")

    def _lost_error(self) -> LeaseLostError:
        reason = self._lost_reason
        return LeaseLostError(
            f"the lease on {self._run_id!r} at token {self._token} was lost"
            + (f" ({reason.value})" if reason is not None else ""),
            record=self._record,
            reason=reason,
        )

    def _at_risk_error(self) -> LeaseAtRiskError:
        why = "the server reported it expiring" if self._expiring_at is not None else (
            "safe-until passed with no renewal answered")
        return LeaseAtRiskError(
            f"the lease on {self._run_id!r} at token {self._token} is at risk: {why}",
            record=self._record,
            reason=LostReason.AT_RISK,
        )

    def _note_renewal(self, sent_at: float, record: RunRecord) -> None:
        """A write under this handle that set the lease's expiry was answered
        (acquire, renew, checkpoint): the server granted expires_at - updated_at."""
        lease = record.lease
        if (lease is None or record.fencing_token != self._token
                or record.status is not RunStatus.RUNNING):
            return
        granted_ms = (lease.expires_at - record.updated_at).total_seconds() * 1000
        self._renewed(sent_at, granted_ms, lease.expires_at)

    def _renewed(self, sent_at: float, ttl_remaining_ms: float, expires_at: datetime) -> None:
        """A renewal sent at ``sent_at`` (monotonic) was answered with
        ``ttl_remaining_ms`` left at its commit.

        With one ttl, a later commit always gives a later expiry, so the
        latest deadline would do. But a RecordCheckpoint extends by the
        acquire's ttl while a renew may have asked for another, so the deadline
        is the earliest among the renewals that may have been committed last:
        a renewal answered before another was sent cannot be the last.
        """
        if not self.is_active:
            return
        now = time.monotonic()
        until = sent_at + max(0.0, ttl_remaining_ms) / 1000
        kept = [r for r in self._renewals if r[1] >= sent_at]
        kept.append((sent_at, now, until))
        self._renewals = kept
        self._safe_until = min(r[2] for r in kept)
        if self._expiring_at is not None and expires_at > self._expiring_at:
            self._expiring_at = None  # renewed after the expiry it warned of
        self._arm_risk_timer()
        self._update_risk()

    def _expiring(self, expires_at: datetime) -> None:
        """The server says the lease passed ``expires_at`` with no renewal."""
        if not self.is_active:
            return
        if self._record.lease is not None and expires_at < self._record.lease.expires_at:
            return  # an expiry this handle has already seen superseded
        self._expiring_at = expires_at
        log.warning("lease on %r (token %d) is expiring: no renewal reached the server "
                    "in time", self._run_id, self._token)
        self._update_risk()

    def _arm_risk_timer(self) -> None:
        """Have ``_risk_due`` run by safe-until. A renewal usually moves safe-until
        later: the timer already set then stays (when it fires early it sets
        another), so a renewal costs no timer of its own."""
        armable = self.is_active and self._safe_until != -math.inf
        if armable and self._risk_timer is not None and self._risk_at <= self._safe_until:
            return
        if self._risk_timer is not None:
            self._risk_timer.cancel()
            self._risk_timer = None
        if not armable:
            return
        delay = self._safe_until - time.monotonic()
        if delay > 0:
            self._risk_at = self._safe_until
            self._risk_timer = asyncio.get_running_loop().call_later(delay, self._risk_due)

    def _risk_due(self) -> None:
        self._risk_timer = None
        if self.is_active and time.monotonic() < self._safe_until:
            self._arm_risk_timer()  # safe-until moved on, or the timer fired a hair early
        else:
            self._update_risk()

    def _update_risk(self) -> None:
        """Move the at-risk event to match ``at_risk``; cancel guards on the way in."""
        if self.is_lost:
            return
        if self.at_risk:
            if not self._at_risk_event.is_set():
                if self._expiring_at is None:
                    log.warning("lease on %r (token %d) is at risk: safe-until passed with no "
                                "renewal answered", self._run_id, self._token)
                self._at_risk_event.set()
                self._risk_epoch += 1
                self._fire_guards(self._at_risk_error())
                self._tell(AT_RISK)
        elif self._at_risk_event.is_set():
            log.info("lease on %r (token %d) is safe again", self._run_id, self._token)
            self._at_risk_event.clear()
            self._tell(SAFE)

    def _fire_guards(self, error: LeaseLostError | LeaseAtRiskError) -> None:
        for guard in builtins.list(self._guards):
            guard._fire(error)

    def _mark_lost(self, record: RunRecord | None, reason: LostReason | None = None) -> None:
        if record is not None:
            self._record = record
        if self.is_lost:
            return
        self._lost_reason = reason if reason is not None else derive_lost_reason(
            record, self._token)
        self._lost.set()
        if self._risk_timer is not None:
            self._risk_timer.cancel()
            self._risk_timer = None
        if not self._at_risk_event.is_set():
            self._at_risk_event.set()
            self._risk_epoch += 1
        log.warning("lease on %r (token %d) lost: %s", self._run_id, self._token,
                    self._lost_reason.value)
        self._fire_guards(self._lost_error())
        self._tell(LOST)
        self._client._lease_lost(self, self._lost_reason)

    def _mark_done(self) -> None:
        self._done = True
        if self._risk_timer is not None:
            self._risk_timer.cancel()
            self._risk_timer = None

    # -- internals: calls -------------------------------------------------------------

    async def _fenced(
        self,
        method: str,
        request: Any,
        *,
        drops_lease: bool = False,
        policy: RetryPolicy | None = None,
    ) -> RunRecord:
        if self.is_lost:
            raise self._lost_error()  # known already: fail fast, no round trip
        renewer = self._client._renewer
        if drops_lease:
            # No renewal may race the command that drops the lease: it would
            # be refused with RUN_LEASE_LOST and flag a lease we gave up. The
            # command's commit also ends the server's tracking of it.
            await renewer.stop(self._kept, untrack=False)
        sent_at = time.monotonic()
        try:
            resp = await self._client._call(method, request, mutation=True, policy=policy)
        except LeaseLostError as exc:
            exc.reason = derive_lost_reason(exc.record, self._token)
            self._mark_lost(exc.record, exc.reason)
            raise
        except OutcomeUnknownError:
            raise  # may have been applied: do not renew a lease we may have dropped
        except FencepostError:
            if drops_lease and self.is_active:
                renewer.start(self._kept)  # refused: we still hold it
            raise
        rec = record_from_pb(resp.run)
        self._record = rec
        if drops_lease:
            self._mark_done()
        else:
            self._note_renewal(sent_at, rec)
        return rec

    async def _renew_once(self, policy: RetryPolicy) -> None:
        req = ledger_pb2.RenewRequest(run_id=self._run_id, owner=self._owner,
                                      fencing_token=self._token, lease_ttl_ms=self._ttl_ms)
        await self._fenced("Renew", req, policy=policy)

    async def _exit_block(self, failed: bool) -> None:
        """Leaving ``async with client.acquire(...)``: release unless finished,
        suspended, released or lost. Never masks the block's exception."""
        if not self.is_active or self._client.closed:
            await self._client._renewer.stop(self._kept)
            return
        policy = _AT_RISK_CLEANUP_RETRY if self.at_risk else _CLEANUP_RETRY
        req = ledger_pb2.ReleaseRequest(run_id=self._run_id, owner=self._owner,
                                        fencing_token=self._token)
        release = self._fenced("Release", req, drops_lease=True,
                               policy=policy)
        try:
            await self._client._cleanup(release, CLEANUP_TIMEOUT_S)
        except LeaseLostError:
            pass  # nothing of ours to release; ``lost`` is set
        except (FencepostError, TimeoutError) as exc:
            if not failed:
                raise
            why = str(exc) or f"no answer within {CLEANUP_TIMEOUT_S:g} s"
            log.warning(
                "could not release %r while leaving a failed block (%s): the lease stays "
                "with owner %r until it expires on the server (ttl %d ms); another worker "
                "can take the run over then", self._run_id, why, self._owner, self._ttl_ms)
        finally:
            await self._client._renewer.stop(self._kept)


def hooks_of(lease: Lease) -> _Kept:
    """The seam of ``lease`` for its renewer (``_renewal.KeptLease``) and its
    blocking twin (``_sync.LeaseHooks``)."""
    return lease._kept


class _Kept:
    """A lease as its renewer (``_renewal.KeptLease``), its transactions
    (``_transaction.TxLease``) and its blocking twin (``_sync.LeaseHooks``)
    see it: what they read of it and tell it."""

    __slots__ = ("_lease",)

    def __init__(self, lease: Lease) -> None:
        self._lease = lease

    @property
    def run_id(self) -> str:
        return self._lease._run_id

    @property
    def fencing_token(self) -> int:
        return self._lease._token

    @property
    def owner(self) -> str:
        return self._lease._owner

    @property
    def ttl_ms(self) -> int:
        return self._lease._ttl_ms

    @property
    def is_active(self) -> bool:
        return self._lease.is_active

    @property
    def is_lost(self) -> bool:
        return self._lease.is_lost

    @property
    def safe_until(self) -> float:
        return self._lease.safe_until

    def renewed(self, sent_at: float, ttl_remaining_ms: float, expires_at: datetime) -> None:
        self._lease._renewed(sent_at, ttl_remaining_ms, expires_at)

    def expiring(self, expires_at: datetime) -> None:
        self._lease._expiring(expires_at)

    def mark_lost(self, record: RunRecord | None, reason: LostReason | None) -> None:
        self._lease._mark_lost(record, reason)

    async def renew_once(self, policy: RetryPolicy) -> None:
        await self._lease._renew_once(policy)

    @property
    def risk_epoch(self) -> int:
        """How many times the lease became at risk or lost."""
        return self._lease._risk_epoch

    def add_listener(self, listener: Callable[[str], None]) -> None:
        self._lease._add_listener(listener)

    def lost_error(self) -> LeaseLostError:
        return self._lease._lost_error()

    def at_risk_error(self) -> LeaseAtRiskError:
        return self._lease._at_risk_error()

    def saw(self, record: RunRecord) -> None:
        """A write under this lease (in a transaction) answered ``record``."""
        self._lease._record = record

    async def exit_block(self, failed: bool) -> None:
        await self._lease._exit_block(failed)


class _Guard:
    """What ``Lease.guard()`` returns (see there). Modelled on
    ``asyncio.timeout``: the lease cancels the guarded task, and the exit turns
    that one cancellation into ``LeaseLostError``, counting cancellation
    requests so that one from outside still propagates."""

    def __init__(self, lease: Lease) -> None:
        self._lease = lease
        self._task: asyncio.Task[Any] | None = None
        self._error: LeaseLostError | LeaseAtRiskError | None = None

    async def __aenter__(self) -> Lease:
        if self._task is not None:
            raise UsageError("this guard() is already in use")
        task = asyncio.current_task()
        if task is None:
            raise EventLoopError("guard() must be used inside a task")
        self._lease.check()
        self._task = task
        self._lease._guards.add(self)
        return self._lease

    def _fire(self, error: LeaseLostError | LeaseAtRiskError) -> None:
        if self._error is None and self._task is not None:
            self._error = error
            self._task.cancel(msg=f"fencepost: {error}")

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._lease._guards.discard(self)
        error, task = self._error, self._task
        if error is None or task is None:
            return
        if exc_type is not asyncio.CancelledError:
            # Our cancellation may still be pending (the block ended before its
            # next await): take delivery here rather than at the caller's next
            # await. (Python 3.13's uncancel() would rescind it.)
            try:
                await asyncio.sleep(0)
            except asyncio.CancelledError:
                pass
        if task.uncancel() > 0:
            # cancelled from outside too: that cancellation wins
            if exc_type is asyncio.CancelledError:
                return
            raise asyncio.CancelledError
        if exc_type is None or exc_type is asyncio.CancelledError:
            raise error from exc
        # the block raised something else (perhaps LeaseLostError from a fenced
        # call): let it propagate


class AcquireContext:
    """What ``Client.acquire`` returns: ``await`` it for a ``Lease``, or use
    ``async with`` to release the lease when the block ends without finishing."""

    def __init__(self, client: Client, run_id: str, ttl_ms: int | None,
                 lock_delay_ms: int) -> None:
        self._client = client
        self._run_id = run_id
        self._ttl_ms = ttl_ms
        self._lock_delay_ms = lock_delay_ms
        self._lease: Lease | None = None

    def __await__(self) -> Generator[Any, None, Lease]:
        return self._client._acquire(self._run_id, self._ttl_ms, self._lock_delay_ms).__await__()

    async def __aenter__(self) -> Lease:
        if self._lease is not None:
            raise UsageError("this acquire() context is already in use")
        self._lease = await self._client._acquire(self._run_id, self._ttl_ms,
                                                  self._lock_delay_ms)
        return self._lease

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        lease, self._lease = self._lease, None
        if lease is not None:
            await lease._exit_block(failed=exc_type is not None)


class Client:
    """Async client for a fencepost coordinator.

    Use as ``async with Client(...) as client`` or call ``aclose()``. The
    channel is opened on first use and binds the client to that event loop.

    ``address`` is one coordinator (``"10.0.0.1:50051"``) or several, of
    which one leads (``["10.0.0.1:50051", "10.0.0.2:50051"]``, or
    ``"10.0.0.1:50051,10.0.0.2:50051"``). With several, the client keeps one
    channel per endpoint (each opened on first use) and follows the leader:
    a standby's NOT_LEADER sends the call to the leader it names, an endpoint
    that cannot be reached to the next one, and the KeepAlive, Execute and
    watch streams reconnect there (leases re-tracked, commands resent with
    their request ids, the watch resumed from its last revision + 1). A call
    waits for a new leader as long as ``retry`` retries (``total_timeout_s``,
    10 s by default: a 5 s leader lease expiring and a standby taking over),
    then raises ``UnavailableError`` naming the endpoints tried and the last
    leader hint (docs/SDK.md).

    Coordinators that lead different shards: the first ``NOT_OWNER`` makes
    the client fetch the shard map and send each call to its shard's owner
    from then on, over a channel, an Execute stream and a KeepAlive stream
    per coordinator (docs/SDK.md, "Shards"); until then it costs nothing.

    ``renewal="stream"`` (default) keeps every lease of the client alive over
    one KeepAlive stream (renewals at a third of each ttl; ``lost`` and
    ``expiring`` pushed by the server; reconnects with jittered backoff and
    re-tracks every lease). ``renewal="unary"`` renews each lease with unary
    Renew calls instead (loss is then learned from a refused renewal).
    ``renewal="off"`` renews nothing: for callers that renew by themselves
    (``lease.renew()``, or a transaction's ``tx.renew()``); a lease then
    expires at its ttl unless they do. ``on_lost(lease, reason)`` is called
    on the client's loop whenever one of its leases is lost.

    ``client.statistics()`` tells what the client has sent and keeps alive
    (``ClientStatistics``): for tests, benchmarks and dashboards.

    ``transport="stream"`` (default) sends every ledger mutation (acquire,
    the fenced calls, cancel, request_resume, delete), and every engine-store
    mutation of ``client.store`` (create_run ... doc_delete), over one
    ``Ledger.Execute`` stream: the commands issued in the same event-loop turn
    travel in one message. ``command_window_ms`` (0 to 1) makes the stream
    wait that much longer for more commands to join a message. While the
    stream is not (yet) open or is down, mutations go unary and it reconnects
    in the background; behaviour, errors and retries are the same either way.
    ``transport="unary"`` never opens the stream. Reads are always unary.
    The Clients of one event loop that name the same single address with the
    same ``tls``, ``token``, ``channel_options``, ``retry`` and
    ``command_window_ms`` (and no ``interceptors``) share one Execute stream:
    the commands of many workers in one process, each a Client of its own
    owner, travel in shared messages. Each command is still its own owner's;
    closing a Client waits for its own commands and leaves the stream to the
    others (the last one closes it).

    ``owner`` names one live process: the server takes two processes with the
    same owner for one holder, so the second one's acquire takes over (and
    fences) the first one's lease. Left out, it is ``{hostname}-{pid}-{random}``,
    unique to this client; pass one only if no other live process uses it.
    """

    def __init__(
        self,
        address: str | Sequence[str] = DEFAULT_ADDRESS,
        *,
        owner: str | None = None,
        default_ttl_ms: int = DEFAULT_TTL_MS,
        retry: RetryPolicy = DEFAULT_RETRY,
        channel_options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        on_lost: OnLost | None = None,
        renewal: Renewal = "stream",
        transport: Transport = "stream",
        command_window_ms: float = 0.0,
        tls: TLS | None = None,
        token: str | None = None,
    ) -> None:
        window_s = check_window(command_window_ms)
        addresses = parse_endpoints(address)
        for one in addresses:
            channel_credentials(one, tls, token)  # refuse bad combinations now
        if transport not in ("stream", "unary"):
            raise ValueError(f"transport must be 'stream' or 'unary', not {transport!r}")
        if renewal not in ("stream", "unary", "off"):
            raise ValueError(f"renewal must be 'stream', 'unary' or 'off', not {renewal!r}")
        self._owner = owner if owner is not None else default_owner()
        self._default_ttl_ms = default_ttl_ms
        self._retry = retry
        self._store: AsyncStore | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # the one way to the coordinators, handed to the store and the renewer
        self._connection = Connection.open(
            addresses, retry=retry, tls=tls, token=token, options=channel_options,
            interceptors=interceptors, transport=transport, window_s=window_s,
            before_open=self._bound,
        )
        self._renewer: Renewer
        if renewal == "stream":
            self._renewer = RoutedRenewer(self._connection, self._owner, retry)
        elif renewal == "unary":
            self._renewer = UnaryRenewer(retry)
        else:
            self._renewer = NoRenewer()
        self._renewal: Renewal = renewal
        self._on_lost = on_lost
        self._cleanups: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._shard_count: int | None = None  # the database's, once shards() asked

    def __repr__(self) -> str:
        return f"<Client {','.join(self._connection.endpoints.listed)} owner={self._owner!r}>"

    async def __aenter__(self) -> Client:
        self.stubs  # noqa: B018 - open the channel on this loop
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop background renewals, wait for pending cleanups and ``on_lost``
        tasks, close the Execute stream (every command it carries answered, or
        failed after a bounded wait), close the channel. Closing revokes
        nothing: leases not released stay with their owner until their ttl
        runs out."""
        if self._closed:
            return
        self._closed = True
        await self._renewer.aclose()
        if self._cleanups:
            await asyncio.wait(builtins.list(self._cleanups))
        await self._connection.aclose()

    # -- configuration ---------------------------------------------------------------

    @property
    def address(self) -> str:
        """The endpoint calls go to now: the one believed to lead (the first
        one given, until a standby or a failure says otherwise)."""
        return self._connection.current.address

    @property
    def endpoints(self) -> tuple[str, ...]:
        """The endpoints given, in order (``address`` is one of them, or a
        leader a standby named)."""
        return self._connection.endpoints.listed

    @property
    def owner(self) -> str:
        """The identity this client acquires leases as."""
        return self._owner

    @property
    def default_ttl_ms(self) -> int:
        return self._default_ttl_ms

    @property
    def retry(self) -> RetryPolicy:
        return self._retry

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def renewal(self) -> Renewal:
        """How leases are kept alive: "stream" (KeepAlive), "unary" (Renew) or
        "off" (by the caller)."""
        return self._renewal

    def statistics(self) -> ClientStatistics:
        """What this client has sent and keeps alive now (``ClientStatistics``)."""
        streams, messages, passes, kept = self._renewer.statistics()
        is_open, opened, sent, commands = self._connection.statistics()
        return ClientStatistics(
            endpoints=self._connection.endpoints.addresses,
            leases_kept=kept,
            keepalive_streams_opened=streams,
            keepalive_messages_sent=messages,
            keepalive_stream_name=self._renewer.stream_name(),
            renewal_passes=passes,
            execute_stream_open=is_open,
            execute_streams_opened=opened,
            execute_messages_sent=sent,
            execute_commands_sent=commands,
        )

    @property
    def store(self) -> AsyncStore:
        """The engine store (docs/SPEC.md §11) on this client's channels. Its mutations
        share this client's Execute stream (``transport``); the rest is unary.
        It follows the leader with the client."""
        if self._store is None:
            self._store = AsyncStore(self._connection)
        return self._store

    @property
    def stubs(self) -> Stubs:
        """The raw generated stubs on the channel of the endpoint believed to
        lead (no retries, no error mapping, no following). Opens the channel
        on first use."""
        endpoint = self._endpoint()
        return Stubs(
            ledger=endpoint.stub(ledger_pb2_grpc.LedgerStub),
            run_store=endpoint.stub(run_store_pb2_grpc.RunStoreStub),
        )

    def _endpoint(self) -> Endpoint:
        """The current endpoint, its channel open (on this loop)."""
        self._bound()
        endpoint = self._connection.current
        endpoint.channel  # noqa: B018 - opens it
        return endpoint

    def _bound(self) -> None:
        """Refuse a closed client, or a loop other than the one it was first used on."""
        if self._closed:
            raise ClientClosedError("the client is closed")
        loop = asyncio.get_running_loop()
        if self._loop is None:
            self._loop = loop
        elif loop is not self._loop:
            raise EventLoopError("a fencepost Client is bound to the event loop it was first "
                               "used on")

    # -- worker calls ------------------------------------------------------------------

    def acquire(
        self, run_id: str, *, ttl_ms: int | None = None, lock_delay_ms: int = 0
    ) -> AcquireContext:
        """Become the run's single owner (creating it when new).

        ``lease = await client.acquire(...)``, or ``async with
        client.acquire(...) as lease:`` to have the lease released when the
        block ends (also on error) unless it was finished, suspended,
        released or lost. Raises ``LeaseHeldError``, ``RunSuspendedError``,
        ``AlreadyTerminalError``, ``ValidationError``.
        """
        return AcquireContext(self, run_id, ttl_ms, lock_delay_ms)

    # -- operator calls ----------------------------------------------------------------

    async def get(self, run_id: str) -> RunRecord:
        """The run's record; ``RunNotFoundError`` when there is none."""
        resp = await self._call("GetRun", ledger_pb2.GetRunRequest(run_id=run_id),
                                mutation=False)
        return record_from_pb(resp.run)

    async def list(
        self,
        *,
        statuses: Iterable[RunStatus | str] = (),
        owner: str | None = None,
        page_size: int = 100,
    ) -> AsyncGenerator[RunRecord, None]:
        """Every run (ordered by run_id) matching the filters, fetching pages of
        ``page_size`` as the iteration proceeds. Where coordinators lead
        different shards, each owner's runs are read and merged in that order."""
        wanted = tuple(parse_status(s) for s in statuses)
        owners = await self._connection.owners()
        if owners is not None:
            async for rec in self._gathered(owners, wanted, owner, page_size):
                yield rec
            return
        token = ""
        while True:
            records, token, _ = await self._list_page(wanted, owner, page_size, token)
            for rec in records:
                yield rec
            if not token:
                return

    async def list_all(
        self,
        *,
        statuses: Iterable[RunStatus | str] = (),
        owner: str | None = None,
        page_size: int = 1000,
    ) -> RunListing:
        """Every matching run, read to the end, with the revision the listing
        began at: the start of "list, then ``watch(from_revision=revision +
        1)``" (see ``RunListing``). Where coordinators lead different shards,
        every owner's runs are read (in run id order) and the revision is the
        given endpoint's."""
        wanted = tuple(parse_status(s) for s in statuses)
        if await self._connection.owners() is not None:
            revision = await self._current_revision()
            gathered = [rec async for rec in self.list(statuses=wanted, owner=owner,
                                                       page_size=page_size)]
            return RunListing(tuple(gathered), revision)
        runs: builtins.list[RunRecord] = []
        records, token, revision = await self._list_page(wanted, owner, page_size, "")
        runs.extend(records)
        while token:
            records, token, _ = await self._list_page(wanted, owner, page_size, token)
            runs.extend(records)
        return RunListing(tuple(runs), revision)

    async def cancel(self, run_id: str, message: str | None = None) -> RunRecord:
        """Operator cancel: moves the fencing token (fencing the worker). An
        already cancelled run is returned unchanged."""
        req = ledger_pb2.CancelRequest(run_id=run_id)
        if message is not None:
            req.message = message
        resp = await self._call("Cancel", req, mutation=True)
        return record_from_pb(resp.run)

    async def request_resume(self, run_id: str) -> RunRecord:
        """Make a suspended run (or one whose lease expired) queued again."""
        resp = await self._call("RequestResume",
                                ledger_pb2.RequestResumeRequest(run_id=run_id), mutation=True)
        return record_from_pb(resp.run)

    async def delete(self, run_id: str) -> DeleteResult:
        """Hard-delete a run, fencing any holder."""
        resp = await self._call("DeleteRun",
                                ledger_pb2.DeleteRunRequest(run_id=run_id), mutation=True)
        return DeleteResult(fencing_token=resp.fencing_token, revision=resp.revision)

    async def watch(
        self, run_ids: Iterable[str] = (), from_revision: int = 0, *,
        cursor: WatchCursor | None = None,
    ) -> AsyncGenerator[WatchEvent, None]:
        """Every committed change to the runs ``run_ids`` (empty: all runs), in
        revision order, as ``WatchEvent``s, for as long as the iteration goes.

        Where coordinators lead shards apart, revisions order changes only
        within a shard: the watch is then *by shards*, in revision order per
        shard, and follows each shard to its new owner by itself. Pass a
        ``WatchCursor`` to resume exactly where one left off (it is kept
        current as events are yielded; save ``cursor.encode()`` after
        handling an event); this works on every deployment, and
        ``from_revision`` must then be 0.

        ``from_revision=0`` starts with the changes committed after the call;
        ``from_revision=N`` first replays every retained change with revision
        >= N. The iterator reconnects by itself when the stream ends with
        UNAVAILABLE (server restart) or STREAM_TOO_SLOW, resuming from the last
        revision received + 1: no change is missed or repeated. It raises
        ``RevisionCompactedError`` when the revision to resume from is older
        than the server's retained history (re-list, then watch from the
        list's revision + 1: ``list_all`` gives it), and ``UnavailableError`` when the server stays
        unreachable for longer than the client's retry policy allows. With
        several endpoints it resumes on the new leader the same way: revisions
        continue across leaders.
        """
        ids = builtins.list(run_ids)
        if from_revision < 0:
            raise ValueError(f"from_revision must be >= 0 (got {from_revision})")
        if cursor is not None and from_revision:
            raise ValueError("from_revision: must be 0 with a cursor (it says where each "
                             "shard resumes)")
        if cursor is not None or (not from_revision and await self._connection.owners()):
            count = (await self._call("Shards", ledger_pb2.ShardsRequest(owners_only=True),
                                      mutation=False)).shard_count
            async for event in watch_by_shards(
                    self._connection, count, ids, WatchCursor() if cursor is None else cursor,
                    self._retry.total_timeout_s):
                yield event
            return
        next_rev = from_revision
        backoff = self._retry.backoffs()
        first = True
        while True:
            if not first:
                await asyncio.sleep(backoff.next())
            first = False
            # Reachability (bounded by the retry policy) and, for a watch
            # "from now", the revision that "now" is: resuming from it after a
            # drop then loses nothing even before the first event.
            current = await self._current_revision()
            if next_rev == 0:
                next_rev = current + 1
            # on the endpoint the revision came from: the leader, as far as
            # anyone knows (a standby refusing the stream moves it)
            endpoint = self._endpoint()
            try:
                await self._connection.endpoints.reachable(endpoint, None)
            except UnavailableError as unreachable:
                self._connection.endpoints.after_failure(endpoint, unreachable)
                continue
            call = endpoint.stub(ledger_pb2_grpc.LedgerStub).WatchRuns(
                ledger_pb2.WatchRunsRequest(run_ids=ids, from_revision=next_rev)
            )
            try:
                async for resp in call:
                    if resp.revision < next_rev:
                        continue  # never yield a revision twice
                    next_rev = resp.revision + 1
                    backoff = self._retry.backoffs()
                    yield watch_event_from_pb(resp)
            except grpc.RpcError as err:
                exc = from_rpc_error(err, mutation=False)
                if not (exc.grpc_code is grpc.StatusCode.UNAVAILABLE
                        or isinstance(exc, StreamTooSlowError)):
                    raise exc from err
                self._connection.endpoints.after_failure(endpoint, exc)
                log.info("watch stream ended (%s); resuming from revision %d", exc, next_rev)
            else:
                log.info("watch stream closed by the server; resuming from revision %d",
                         next_rev)
            finally:
                call.cancel()

    async def validate_fence(self, run_id: str, fencing_token: int) -> FenceStatus:
        """Whether ``fencing_token`` is still the run's current one (for a
        downstream resource that must refuse stale writers)."""
        req = ledger_pb2.ValidateFenceRequest(run_id=run_id, fencing_token=fencing_token)
        resp = await self._call("ValidateFence", req, mutation=False)
        return FenceStatus(
            current=resp.current,
            found=resp.found,
            fencing_token=resp.fencing_token,
            status=status_from_pb(resp.status),
            revision=resp.revision,
        )

    async def shards(self) -> ShardMap:
        """The shard map (docs/SPEC.md §13): the database's shard count and,
        per shard, the coordinator that leads it, its epoch, and its runs and
        live leases. A coordinator answers only for the shards it leads: the
        others' rows are asked of their owners. The count is kept for
        ``shard_of``."""
        resp = await self._call("Shards", ledger_pb2.ShardsRequest(), mutation=False)
        for address in sorted({s.address for s in resp.shards if not s.owner and s.address}):
            theirs = await self._connection.ask_at(address, _ledger_rpc("Shards"),
                                                   ledger_pb2.ShardsRequest())
            for info in theirs.shards if theirs is not None else ():
                if info.owner and info.address == address and 0 <= info.index < len(resp.shards):
                    resp.shards[info.index].CopyFrom(info)
        shard_map = shard_map_from_pb(resp)
        self._shard_count = shard_map.shard_count
        return shard_map

    async def move_shard(self, shard: int, to: str) -> ShardInfo:
        """Move ``shard`` to the coordinator advertised at ``to``, where the
        coordinators lead shards apart (docs/SPEC.md §13): returns who led it
        when the move was stored; ``shards()`` shows it arrive. Needs the
        operator role; ``ValidationError`` naming ``shard`` or ``to``."""
        resp = await self._call("MoveShard", ledger_pb2.MoveShardRequest(shard=shard, to=to),
                                mutation=False)
        return shard_info_from_pb(resp.before)

    async def shard_of(self, key: str) -> int:
        """The shard ``key`` belongs to, by the database's shard count (asked
        with ``shards()`` once, then kept: a database's count never changes)."""
        if self._shard_count is None:
            await self.shards()
        assert self._shard_count is not None
        return shard_of(key, self._shard_count)

    # -- internals (shared with SyncClient) ----------------------------------------------

    async def _acquire(self, run_id: str, ttl_ms: int | None, lock_delay_ms: int) -> Lease:
        ttl = self._default_ttl_ms if ttl_ms is None else ttl_ms
        # Ask the server to track the lease on our KeepAlive stream at the
        # acquire's commit, which saves the `track` message after the answer.
        req = ledger_pb2.AcquireRequest(run_id=run_id, owner=self._owner, lease_ttl_ms=ttl,
                                        lock_delay_ms=lock_delay_ms,
                                        track_on=self._renewer.stream_name(run_id))
        sent_at = time.monotonic()  # before the first attempt: a retry only makes it safer
        resp = await self._call("Acquire", req, mutation=True)
        lease = Lease(self, record_from_pb(resp.run), ttl, sent_at=sent_at)
        self._renewer.start(lease._kept, tracked_on=req.track_on if resp.tracked else "")
        return lease

    async def _current_revision(self) -> int:
        resp = await self._call("ListRuns", ledger_pb2.ListRunsRequest(page_size=1),
                                mutation=False)
        return int(resp.revision)

    def _lease_lost(self, lease: Lease, reason: LostReason) -> None:
        """Call ``on_lost``; an awaitable it returns runs as a task of the client."""
        if self._on_lost is None:
            return
        try:
            result = self._on_lost(lease, reason)
        except Exception:
            log.exception("on_lost callback failed")
            return
        if inspect.isawaitable(result):
            task: asyncio.Task[Any] = asyncio.ensure_future(result)
            self._cleanups.add(task)
            task.add_done_callback(self._callback_done)

    def _callback_done(self, task: asyncio.Task[Any]) -> None:
        self._cleanups.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("on_lost callback failed", exc_info=task.exception())

    async def _gathered(
        self, addresses: builtins.list[str], statuses: tuple[RunStatus, ...],
        owner: str | None, page_size: int,
    ) -> AsyncGenerator[RunRecord, None]:
        """Each owner's listing, paged at that owner, merged by run id."""

        async def pages(address: str) -> AsyncGenerator[RunRecord, None]:
            token = ""
            while True:
                req = ledger_pb2.ListRunsRequest(
                    statuses=[status_to_pb(s) for s in statuses],  # type: ignore[misc]
                    owner=owner or "", page_size=page_size, page_token=token)
                resp = await self._connection.ask_at(address, _ledger_rpc("ListRuns"), req)
                if resp is None:
                    return
                for r in resp.runs:
                    yield record_from_pb(r)
                token = resp.next_page_token
                if not token:
                    return

        streams = [pages(a) for a in addresses]
        heads: builtins.list[tuple[str, int, RunRecord]] = []
        for i, stream in enumerate(streams):
            if (rec := await anext(stream, None)) is not None:
                heapq.heappush(heads, (rec.run_id, i, rec))
        while heads:  # run ids compare as the servers sort them (code points: UTF-8 bytes)
            _, i, rec = heapq.heappop(heads)
            yield rec
            if (nxt := await anext(streams[i], None)) is not None:
                heapq.heappush(heads, (nxt.run_id, i, nxt))

    async def _list_page(
        self,
        statuses: tuple[RunStatus, ...],
        owner: str | None,
        page_size: int,
        page_token: str,
    ) -> tuple[builtins.list[RunRecord], str, int]:
        req = ledger_pb2.ListRunsRequest(
            statuses=[status_to_pb(s) for s in statuses],  # type: ignore[misc]
            owner=owner or "",
            page_size=page_size,
            page_token=page_token,
        )
        resp = await self._call("ListRuns", req, mutation=False)
        return [record_from_pb(r) for r in resp.runs], resp.next_page_token, resp.revision

    async def _call(
        self,
        method: str,
        request: Any,
        *,
        mutation: bool,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """One logical call of the Ledger RPC ``method`` (``Connection.call``:
        one request id for a mutation's attempts, each on the endpoint believed
        to lead, over the Execute stream when it is up; errors mapped once)."""
        self._bound()
        return await self._connection.call(_ledger_rpc(method), request, mutation=mutation,
                                           policy=policy)

    async def _cleanup(self, coro: Any, limit_s: float) -> Any:
        """Run cleanup work shielded from the caller's cancellation and bounded
        in time. The client owns the task and awaits it on close."""
        task: asyncio.Task[Any] = asyncio.create_task(self._bounded(coro, limit_s))
        self._cleanups.add(task)
        task.add_done_callback(self._cleanup_done)
        return await asyncio.shield(task)

    @staticmethod
    async def _bounded(coro: Any, limit_s: float) -> Any:
        async with asyncio.timeout(limit_s):
            return await coro

    def _cleanup_done(self, task: asyncio.Task[Any]) -> None:
        self._cleanups.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("cleanup finished with %r", task.exception())
