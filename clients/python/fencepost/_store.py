"""The engine store (docs/SPEC.md §11) from Python: ``AsyncStore`` and ``SyncStore``.

Python values in and out: JSON values are plain Python data (dict, list,
str, int of any size, float, bool, None), sent as JSON text and parsed back,
so every call takes a copy of what you pass and every answer is a fresh copy
nobody else holds. Times are timezone-aware ``datetime`` objects (UTC,
millisecond precision); artifact bytes are ``bytes``, or any (async) iterable
of bytes for uploads that should not sit in memory whole.

Absent is not null: a run's ``output`` is ``ABSENT`` when it has none and
``None`` when a JSON null was stored; ``get_effect`` and ``kv_get`` answer a
``Lookup`` whose ``found`` tells a stored null from nothing.

Errors are the SDK's (``fencepost._errors``): ``InvalidRunStateError`` (alias
``InvalidRunState``) when an ``update_run`` guard fails, ``RunNotFoundError``
(alias ``RunNotFound``) for an unknown run in ``update_run`` and an unknown
artifact in ``read_artifact``/``iter_artifact``, ``ValidationError`` for bad
input (also a value that is not JSON, raised before anything is sent).
Only UNAVAILABLE is retried, and every mutation carries one request id for
all its attempts, so a retry never applies it twice.

``client.store`` (a ``Client``'s store) sends its 13 unary mutations (create_run,
update_run, claim_run, renew_claim, append_step, save_checkpoint, claim_key,
acquire_lock, release_lock, put_effect, kv_set, doc_upsert, doc_delete) over
the client's ``Ledger.Execute`` stream when the client's transport is "stream"
(the default), exactly as the client's ledger mutations go (``_execute``):
same answers, same errors, same retries. Reads, listings and artifact
uploads, downloads and deletes stay unary, and so does everything of a store made
with ``AsyncStore.connect`` or ``AsyncStore(channel)``.

    async with AsyncStore.connect("127.0.0.1:50051") as store:
        await store.create_run("run-1", agent="billing", input={"amount": 10})
"""

from __future__ import annotations

import asyncio
import builtins
import copy
import json
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from types import TracebackType
from typing import TYPE_CHECKING, Any, Final, TypeVar

import grpc

from ._connect import until_connected
from ._connection import Connection
from ._endpoints import Endpoint, parse_endpoints
from ._errors import (
    FencepostError,
    InvalidRunStateError,
    LeaseLostError,
    LockLostError,
    RunNotFoundError,
    ValidationError,
    from_rpc_error,
)
from ._ids import new_request_id
from ._placement import first_key
from ._retry import RetryPolicy
from ._security import TLS, channel_credentials
from .v1 import engine_store_pb2 as pb
from .v1 import engine_store_pb2_grpc, ledger_pb2_grpc

if TYPE_CHECKING:
    from google.protobuf.timestamp_pb2 import Timestamp

    from ._transaction import StoreTransaction
    from .v1.engine_store_pb2_grpc import EngineStoreAsyncStub

__all__ = [
    "ABSENT",
    "AsyncStore",
    "CreateRunResult",
    "EngineArtifact",
    "EngineCheckpoint",
    "EngineDoc",
    "EngineRun",
    "EngineStep",
    "InvalidRunState",
    "KeyClaim",
    "LockGrant",
    "Lookup",
    "PutArtifactResult",
    "RunClaim",
    "RunList",
    "RunNotFound",
]

T = TypeVar("T")

InvalidRunState = InvalidRunStateError
RunNotFound = RunNotFoundError

# Upload chunk size: well under the default 4 MiB gRPC message limit.
CHUNK_BYTES: Final = 1 << 20
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)


class _Absent:
    """The type of ``ABSENT``: no value at all (unlike ``None``, a JSON null)."""

    _instance: _Absent | None = None

    def __new__(cls) -> _Absent:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False

    def __copy__(self) -> _Absent:
        return self

    def __deepcopy__(self, memo: Any) -> _Absent:
        return self

    def __reduce__(self) -> str:
        return "ABSENT"


ABSENT: Final = _Absent()
"""No value (a field never set, or an argument not passed). ``None`` is JSON null."""


# -- values ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunClaim:
    owner: str
    expires_at: datetime  # live while the server's now < expires_at


@dataclass(frozen=True, slots=True)
class EngineRun:
    id: str
    agent: str
    status: str
    concurrency_key: str | None
    input: Any  # ABSENT when the run has none
    output: Any
    error: Any
    metadata: Any
    claim: RunClaim | None
    created_at: datetime
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class CreateRunResult:
    created: bool  # False: the id existed, and ``run`` is the stored one, unchanged
    run: EngineRun


@dataclass(frozen=True, slots=True)
class RunList:
    runs: builtins.list[EngineRun]
    total: int  # every match, ignoring limit and offset


@dataclass(frozen=True, slots=True)
class EngineStep:
    run_id: str
    seq: int  # 1 for the run's first step
    name: str
    status: str | None
    input: Any
    output: Any
    error: Any
    metadata: Any
    created_at: datetime


@dataclass(frozen=True, slots=True)
class EngineCheckpoint:
    run_id: str
    step_index: int
    state: Any
    saved_at: datetime


@dataclass(frozen=True, slots=True)
class KeyClaim:
    created: bool  # True: this caller won the key
    run_id: str  # the winner's run id
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class LockGrant:
    acquired: bool
    fencing_token: int  # the caller's when acquired, else the holder's
    owner: str  # the current holder
    expires_at: datetime


@dataclass(frozen=True, slots=True)
class Lookup:
    """A read that may find nothing: ``found`` tells a stored null from absence."""

    found: bool
    value: Any = None
    at: datetime | None = None  # when the value was written


@dataclass(frozen=True, slots=True)
class EngineDoc:
    id: str
    doc: dict[str, Any]
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class EngineArtifact:
    id: str
    run_id: str
    name: str
    content_type: str
    size_bytes: int
    sha256: str
    metadata: Any
    created_at: datetime


@dataclass(frozen=True, slots=True)
class PutArtifactResult:
    created: bool  # False: the id existed; its artifact (metadata and bytes) was kept
    artifact: EngineArtifact


# -- conversions -----------------------------------------------------------------------------


# Python refuses to convert an int of more than 4300 digits to or from text
# (sys.get_int_max_str_digits), which json.dumps and json.loads do; Decimal
# converts any length exactly, so integers longer than this go through it.
_INT_DIGITS = 4000
_INT_BITS = 13_000  # fewer decimal digits than _INT_DIGITS (13 000 * log10(2) < 3 914)


def _dumps(field: str, value: Any) -> str:
    try:
        try:
            return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except ValueError:
            return _dumps_long_ints(value)  # integers of any length; NaN still refused
    except (TypeError, ValueError, RecursionError) as exc:
        raise ValidationError(f"{field}: not a JSON value ({exc})", field=field) from None


def _dumps_long_ints(value: Any) -> str:
    """``json.dumps`` (same output) for values holding integers too long for it."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > _INT_BITS:
        return str(Decimal(int(value)))
    if isinstance(value, dict):
        return "{" + ",".join(
            _dumps_key(key) + ":" + _dumps_long_ints(item) for key, item in value.items()
        ) + "}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_dumps_long_ints(item) for item in value) + "]"
    return json.dumps(value, ensure_ascii=False, allow_nan=False)


def _dumps_key(key: Any) -> str:
    if isinstance(key, str):
        return json.dumps(key, ensure_ascii=False)
    # an int, float, bool or None key, coerced to a string as json.dumps does
    return json.dumps({key: 0}, ensure_ascii=False, allow_nan=False)[1:-4]


def _exact_int(text: str) -> int:
    return int(text) if len(text) <= _INT_DIGITS else int(Decimal(text))


def _json(text: str) -> Any:
    """A stored JSON text as Python data, integers of any length exactly."""
    return json.loads(text, parse_int=_exact_int)


def _json_value(field: str, value: Any) -> pb.JsonValue:
    return pb.JsonValue(json=_dumps(field, value))


def _set_json(msg: Any, name: str, value: Any, field: str | None = None) -> None:
    if value is not ABSENT:
        getattr(msg, name).json = _dumps(field or name, value)


def _loads(msg: Any, name: str) -> Any:
    return _json(getattr(msg, name).json) if msg.HasField(name) else ABSENT


def _dt(ts: Timestamp) -> datetime:
    return _EPOCH + timedelta(milliseconds=ts.seconds * 1000 + ts.nanos // 1_000_000)


def _opt_dt(msg: Any, name: str) -> datetime | None:
    return _dt(getattr(msg, name)) if msg.HasField(name) else None


def _run(m: pb.EngineRun) -> EngineRun:
    claim = RunClaim(m.claim.owner, _dt(m.claim.expires_at)) if m.HasField("claim") else None
    return EngineRun(
        id=m.id,
        agent=m.agent,
        status=m.status,
        concurrency_key=m.concurrency_key if m.HasField("concurrency_key") else None,
        input=_loads(m, "input"),
        output=_loads(m, "output"),
        error=_loads(m, "error"),
        metadata=_loads(m, "metadata"),
        claim=claim,
        created_at=_dt(m.created_at),
        updated_at=_dt(m.updated_at),
    )


def _step(m: pb.EngineStep) -> EngineStep:
    return EngineStep(
        run_id=m.run_id,
        seq=m.seq,
        name=m.name,
        status=m.status if m.HasField("status") else None,
        input=_loads(m, "input"),
        output=_loads(m, "output"),
        error=_loads(m, "error"),
        metadata=_loads(m, "metadata"),
        created_at=_dt(m.created_at),
    )


def _checkpoint(m: pb.EngineCheckpoint) -> EngineCheckpoint:
    return EngineCheckpoint(m.run_id, m.step_index, _json(m.state.json), _dt(m.saved_at))


def _doc(m: pb.EngineDoc) -> EngineDoc:
    return EngineDoc(m.id, _json(m.doc.json), _dt(m.updated_at))


def _artifact(m: pb.EngineArtifact) -> EngineArtifact:
    return EngineArtifact(
        id=m.id,
        run_id=m.run_id,
        name=m.name,
        content_type=m.content_type,
        size_bytes=m.size_bytes,
        sha256=m.sha256,
        metadata=_loads(m, "metadata"),
        created_at=_dt(m.created_at),
    )


def make_fence(
    fencing_token: int | None, run_id: str | None, lock_key: str | None
) -> pb.Fence:
    """The wire form of a fence: exactly one of ``run_id`` and ``lock_key``."""
    if (run_id is None) == (lock_key is None):
        raise ValidationError(
            "fence.run_id: give exactly one of run_id and lock_key", field="fence.run_id"
        )
    if isinstance(fencing_token, bool) or not isinstance(fencing_token, int):
        raise ValidationError(
            f"fence.fencing_token: must be an int (got {fencing_token!r})",
            field="fence.fencing_token",
        )
    return pb.Fence(run_id=run_id or "", lock_key=lock_key or "", fencing_token=fencing_token)


def status_list(value: str | Iterable[str] | None) -> builtins.list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return builtins.list(value)



async def _rechunk(data: Iterable[bytes] | AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """Pieces of at most CHUNK_BYTES from any (async) iterable of bytes-likes.
    A sync iterable that is not an in-memory sequence is advanced in a thread,
    so a blocking source (a file, a socket) never stalls the event loop."""
    if isinstance(data, AsyncIterable):
        async for piece in data:
            for out in _split(piece):
                yield out
        return
    if isinstance(data, builtins.list | tuple):
        for piece in data:
            for out in _split(piece):
                yield out
        return
    it = iter(data)

    def advance() -> bytes | None:
        return next(it, None)

    while True:
        got = await asyncio.to_thread(advance)
        if got is None:
            return
        for out in _split(got):
            yield out


def _split(piece: bytes | bytearray | memoryview) -> Iterator[bytes]:
    view = memoryview(piece).cast("B")
    for i in range(0, len(view), CHUNK_BYTES):
        yield bytes(view[i : i + CHUNK_BYTES])


# -- the async store ------------------------------------------------------------------------


def _engine_stub(endpoint: Endpoint) -> EngineStoreAsyncStub:
    return endpoint.stub(engine_store_pb2_grpc.EngineStoreStub)  # type: ignore[return-value]


class AsyncStore:
    """The engine store over a ``grpc.aio`` channel.

    ``channel`` is a ``grpc.aio.Channel`` or a zero-argument callable that
    returns one (called on every use; lets a client open its channel lazily),
    or a client's connection (``client.store`` is made so: it follows the
    leader with its client, and its mutations share the client's Execute
    stream). ``AsyncStore.connect(address)`` opens (and on ``aclose`` closes)
    a channel of its own per endpoint, and follows the leader when given
    several (``Client``'s docs).
    """

    def __init__(
        self,
        channel: grpc.aio.Channel | Callable[[], grpc.aio.Channel] | Connection,
        *,
        retry: RetryPolicy | None = None,
    ) -> None:
        if isinstance(channel, Connection):
            self._connection = channel
        else:
            self._connection = Connection.of_channel(channel, retry=retry or RetryPolicy())
        self._retry = retry or self._connection.retry
        self._owns = False  # aclose closes the connection (``connect``)
        # A fenced view's precondition, sent with every write (``fenced``),
        # and who to tell when the server refuses it (a Lease marks itself lost).
        self._fence: pb.Fence | None = None
        self._on_fence_refused: Callable[[FencepostError], None] | None = None

    @classmethod
    def connect(
        cls,
        address: str | Sequence[str],
        *,
        retry: RetryPolicy | None = None,
        channel_options: Iterable[tuple[str, Any]] = (),
        tls: TLS | None = None,
        token: str | None = None,
    ) -> AsyncStore:
        """A store with channels of its own (closed by ``aclose``): one
        endpoint, or several of which one leads (a list, or "a,b"), as for
        ``Client``; ``tls`` and ``token`` as for ``Client``."""
        addresses = parse_endpoints(address)
        options = builtins.list(channel_options)
        for one in addresses:
            channel_credentials(one, tls, token)  # refuse bad combinations now
        connection = Connection.open(addresses, retry=retry or RetryPolicy(), tls=tls,
                                     token=token, options=options)
        store = cls(connection)
        store._owns = True
        return store

    async def aclose(self) -> None:
        if self._owns:
            await self._connection.aclose()

    async def __aenter__(self) -> AsyncStore:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()

    @property
    def stub(self) -> EngineStoreAsyncStub:
        """The raw generated stub (no retries, no conversions, no following),
        on the endpoint believed to lead: the escape hatch."""
        return _engine_stub(self._connection.current)

    async def _retried(
        self, attempt: Callable[[Endpoint, float | None], Awaitable[T]], *, mutation: bool,
        policy: RetryPolicy | None = None, key: str | None = None,
    ) -> T:
        """``attempt`` retried, on the owner of ``key``'s shard (``Connection``)."""
        return await self._connection.retried(attempt, mutation=mutation,
                                              policy=policy or self._retry, key=key)

    async def _unary(self, method: str, request: Any, *, mutation: bool) -> Any:
        """One logical call of a unary RPC: a mutation gets one request id for
        all its attempts; with a dispatcher, its attempts go over the Execute
        stream while that is up (one lost with a broken stream is retried like
        UNAVAILABLE), else unary. ``call_with_retry`` maps the errors of both
        through the same function."""
        if mutation and self._fence is not None and not request.HasField("fence"):
            request.fence.CopyFrom(self._fence)
        rpc_of = lambda endpoint: getattr(_engine_stub(endpoint), method)  # noqa: E731
        return await self._reported(
            self._connection.call(rpc_of, request, mutation=mutation, policy=self._retry))

    async def _fenced_call(
        self, attempt: Any, *, mutation: bool, policy: RetryPolicy | None = None,
        key: str | None = None,
    ) -> Any:
        """``call_with_retry``; a refused fence is also reported to the view's owner."""
        return await self._reported(self._retried(attempt, mutation=mutation, policy=policy,
                                                  key=key))

    async def _reported(self, call: Awaitable[T]) -> T:
        """``call``'s answer; a refused fence is also told to the view's owner."""
        try:
            return await call
        except (LeaseLostError, LockLostError) as exc:
            if self._on_fence_refused is not None:
                self._on_fence_refused(exc)
            raise

    # -- fenced writes ------------------------------------------------------------------

    def fenced(
        self,
        *,
        fencing_token: int,
        run_id: str | None = None,
        lock_key: str | None = None,
    ) -> AsyncStore:
        """A view of this store whose every write carries a fence: it commits
        only while the ledger run ``run_id`` is still at ``fencing_token``
        (a lease's token), or the keyed lock ``lock_key`` still at its token
        (``acquire_lock(...).fencing_token``), checked by the server in the
        same step as the write. A stale fence raises ``LeaseLostError``
        (``LockLostError`` for a lock) and writes nothing. Reads are
        unchanged. The view shares this store's channel and transport
        (``lease.fenced()`` makes one for a lease)."""
        view = copy.copy(self)
        view._owns = False  # closing the view closes nothing
        view._fence = make_fence(fencing_token, run_id, lock_key)
        view._on_fence_refused = None
        return view

    def transaction(
        self,
        *,
        fencing_token: int | None = None,
        run_id: str | None = None,
        lock_key: str | None = None,
    ) -> StoreTransaction:
        """``async with store.transaction(...) as tx:`` -- the writes made on
        ``tx`` inside the block are sent together when it ends and commit
        all together or not at all (``Ledger.Transact``), under the fence
        given here (or this view's, for a ``fenced`` view; none without
        either). A refusal of any write or of the fence raises, and nothing
        of the block was written; an exception inside the block sends
        nothing. ``tx.results`` then holds each write's answer, in order."""
        from ._transaction import StoreTransaction

        fence = (
            self._fence
            if fencing_token is None and run_id is None and lock_key is None
            else make_fence(fencing_token, run_id, lock_key)
        )
        return StoreTransaction(self, fence)

    async def _transact(self, request: Any) -> Any:
        """One Ledger.Transact (over the Execute stream when the client's is up)."""
        rpc_of = lambda endpoint: endpoint.stub(ledger_pb2_grpc.LedgerStub).Transact  # noqa: E731
        return await self._reported(
            self._connection.call(rpc_of, request, mutation=True, policy=self._retry))

    async def _collect(self, method: str, request: Any) -> builtins.list[Any]:
        """Every message of a paged listing (retried from the start when the
        server is unavailable). Listings have no per-attempt deadline."""

        async def attempt(endpoint: Endpoint, deadline_s: float | None) -> builtins.list[Any]:
            return [msg async for msg in getattr(_engine_stub(endpoint), method)(request)]

        return await self._retried(attempt, mutation=False, key=first_key(request))

    # -- runs ---------------------------------------------------------------------------

    async def create_run(
        self,
        id: str,
        *,
        agent: str,
        status: str = "queued",
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
        concurrency_key: str | None = None,
    ) -> CreateRunResult:
        """Insert the run unless its id exists (then the stored run is kept
        and returned with ``created=False``)."""
        run = pb.EngineRun(id=id, agent=agent, status=status)
        if concurrency_key is not None:
            run.concurrency_key = concurrency_key
        _set_json(run, "input", input)
        _set_json(run, "output", output)
        _set_json(run, "error", error)
        _set_json(run, "metadata", metadata)
        resp = await self._unary("CreateRun", pb.EngineCreateRunRequest(run=run), mutation=True)
        return CreateRunResult(resp.created, _run(resp.run))

    async def get_run(self, id: str) -> EngineRun | None:
        resp = await self._unary("GetRun", pb.EngineGetRunRequest(id=id), mutation=False)
        return _run(resp.run) if resp.found else None

    async def update_run(
        self,
        id: str,
        *,
        status: str | None = None,
        concurrency_key: str | None = None,
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
        clear: Iterable[str] = (),
        expect_status: str | Iterable[str] | None = None,
        expect_owner: str | None = None,
    ) -> EngineRun:
        """Patch a run: arguments left out are unchanged (pass ``None`` for a
        JSON null); ``clear`` names fields to remove ("concurrency_key",
        "input", "output", "error", "metadata", or "claim" to release the
        claim). Guards: ``expect_status`` (the current status must be one of
        them) and ``expect_owner`` (the claim must be held by this owner,
        expired or not) raise ``InvalidRunStateError``; an unknown id raises
        ``RunNotFoundError``."""
        patch = pb.EngineRunPatch(clear=builtins.list(clear))
        if status is not None:
            patch.status = status
        if concurrency_key is not None:
            patch.concurrency_key = concurrency_key
        _set_json(patch, "input", input)
        _set_json(patch, "output", output)
        _set_json(patch, "error", error)
        _set_json(patch, "metadata", metadata)
        req = pb.EngineUpdateRunRequest(id=id, patch=patch,
                                        expect_status=status_list(expect_status))
        if expect_owner is not None:
            req.expect_owner = expect_owner
        resp = await self._unary("UpdateRun", req, mutation=True)
        return _run(resp.run)

    async def list_runs(
        self,
        *,
        agent: str | None = None,
        statuses: str | Iterable[str] | None = None,
        concurrency_key: str | None = None,
        limit: int | None = None,
        offset: int = 0,
    ) -> RunList:
        """Runs ordered by created_at then id; ``total`` counts every match.
        Without a limit, every match (the server streams them in pages)."""
        req = pb.EngineListRunsRequest(statuses=status_list(statuses), offset=offset)
        if agent is not None:
            req.agent = agent
        if concurrency_key is not None:
            req.concurrency_key = concurrency_key
        if limit is not None:
            req.limit = limit
        pages = await self._collect("ListRuns", req)
        runs = [_run(r) for page in pages for r in page.runs]
        return RunList(runs, pages[0].total if pages else 0)

    async def claim_run(self, id: str, owner: str, ttl_ms: int) -> bool:
        """Claim the run until server-now + ttl_ms; False when it has a live
        claim (even ``owner``'s own: use ``renew_claim``) or does not exist."""
        req = pb.EngineClaimRunRequest(id=id, owner=owner, ttl_ms=ttl_ms)
        return bool((await self._unary("ClaimRun", req, mutation=True)).claimed)

    async def renew_claim(self, id: str, owner: str, ttl_ms: int) -> bool:
        """Extend ``owner``'s live claim; False when it is not the current,
        unexpired owner."""
        req = pb.EngineRenewClaimRequest(id=id, owner=owner, ttl_ms=ttl_ms)
        return bool((await self._unary("RenewClaim", req, mutation=True)).renewed)

    # -- steps and checkpoints ------------------------------------------------------------

    async def append_step(
        self,
        run_id: str,
        name: str,
        *,
        status: str | None = None,
        input: Any = ABSENT,
        output: Any = ABSENT,
        error: Any = ABSENT,
        metadata: Any = ABSENT,
    ) -> EngineStep:
        step = pb.EngineStep(run_id=run_id, name=name)
        if status is not None:
            step.status = status
        _set_json(step, "input", input)
        _set_json(step, "output", output)
        _set_json(step, "error", error)
        _set_json(step, "metadata", metadata)
        resp = await self._unary("AppendStep", pb.EngineAppendStepRequest(step=step), mutation=True)
        return _step(resp.step)

    async def list_steps(self, run_id: str) -> builtins.list[EngineStep]:
        """The run's steps in append order."""
        pages = await self._collect("ListSteps", pb.EngineListStepsRequest(run_id=run_id))
        return [_step(s) for page in pages for s in page.steps]

    async def save_checkpoint(self, run_id: str, step_index: int, state: Any) -> bool:
        """Keep this checkpoint unless one with a higher step index is stored
        (an equal index replaces). Returns whether it was kept."""
        cp = pb.EngineCheckpoint(
            run_id=run_id, step_index=step_index, state=_json_value("state", state)
        )
        req = pb.EngineSaveCheckpointRequest(checkpoint=cp)
        return bool((await self._unary("SaveCheckpoint", req, mutation=True)).saved)

    async def latest_checkpoint(self, run_id: str) -> EngineCheckpoint | None:
        req = pb.EngineLatestCheckpointRequest(run_id=run_id)
        resp = await self._unary("LatestCheckpoint", req, mutation=False)
        return _checkpoint(resp.checkpoint) if resp.found else None

    # -- idempotency and locks ----------------------------------------------------------------

    async def claim_key(self, scope: str, key: str, run_id: str, ttl_ms: int) -> KeyClaim:
        """First caller per (scope, key) wins until the key expires; the
        others learn the winner's run id."""
        req = pb.EngineClaimKeyRequest(scope=scope, key=key, run_id=run_id, ttl_ms=ttl_ms)
        resp = await self._unary("ClaimKey", req, mutation=True)
        return KeyClaim(resp.created, resp.run_id, _dt(resp.expires_at))

    async def acquire_lock(self, key: str, owner: str, ttl_ms: int) -> LockGrant:
        """Acquire (or, as its holder, extend) the lock until server-now + ttl_ms."""
        req = pb.EngineAcquireLockRequest(key=key, owner=owner, ttl_ms=ttl_ms)
        resp = await self._unary("AcquireLock", req, mutation=True)
        return LockGrant(resp.acquired, resp.fencing_token, resp.owner, _dt(resp.expires_at))

    async def release_lock(self, key: str, owner: str) -> bool:
        """Release the lock if ``owner`` holds it; False (nothing changed) otherwise."""
        req = pb.EngineReleaseLockRequest(key=key, owner=owner)
        return bool((await self._unary("ReleaseLock", req, mutation=True)).released)

    # -- effects and state --------------------------------------------------------------------

    async def get_effect(self, key: str) -> Lookup:
        resp = await self._unary("GetEffect", pb.EngineGetEffectRequest(key=key), mutation=False)
        if not resp.found:
            return Lookup(False)
        return Lookup(True, _json(resp.result.json), _opt_dt(resp, "recorded_at"))

    async def put_effect(self, key: str, result: Any) -> None:
        req = pb.EnginePutEffectRequest(key=key, result=_json_value("result", result))
        await self._unary("PutEffect", req, mutation=True)

    async def kv_get(self, agent: str, key: str) -> Lookup:
        req = pb.EngineKvGetRequest(agent=agent, key=key)
        resp = await self._unary("KvGet", req, mutation=False)
        if not resp.found:
            return Lookup(False)
        return Lookup(True, _json(resp.value.json), _opt_dt(resp, "updated_at"))

    async def kv_set(self, agent: str, key: str, value: Any) -> None:
        req = pb.EngineKvSetRequest(agent=agent, key=key, value=_json_value("value", value))
        await self._unary("KvSet", req, mutation=True)

    async def doc_list(
        self,
        agent: str,
        collection: str,
        *,
        where: dict[str, Any] | None = None,
        limit: int | None = None,
    ) -> builtins.list[EngineDoc]:
        """Documents ordered by id whose top-level fields equal ``where``'s."""
        req = pb.EngineDocListRequest(agent=agent, collection=collection)
        if where is not None:
            req.where.json = _dumps("where", where)
        if limit is not None:
            req.limit = limit
        pages = await self._collect("DocList", req)
        return [_doc(d) for page in pages for d in page.docs]

    async def doc_upsert(self, agent: str, collection: str, id: str, doc: dict[str, Any]) -> bool:
        """Insert or replace a document (a dict); True when it was new."""
        req = pb.EngineDocUpsertRequest(
            agent=agent, collection=collection, id=id, doc=_json_value("doc", doc)
        )
        return bool((await self._unary("DocUpsert", req, mutation=True)).created)

    async def doc_delete(self, agent: str, collection: str, id: str) -> bool:
        req = pb.EngineDocDeleteRequest(agent=agent, collection=collection, id=id)
        return bool((await self._unary("DocDelete", req, mutation=True)).deleted)

    # -- artifacts ------------------------------------------------------------------------------

    async def put_artifact(
        self,
        id: str,
        data: bytes | bytearray | memoryview | Iterable[bytes] | AsyncIterable[bytes],
        *,
        run_id: str,
        size_bytes: int | None = None,
        name: str = "",
        content_type: str = "",
        metadata: Any = ABSENT,
        sha256: str | None = None,
    ) -> PutArtifactResult:
        """Upload an artifact unless its id exists (the stored one is then
        kept, bytes and metadata, and ``created`` is False).

        ``data`` is bytes (retried on UNAVAILABLE like any call), or an
        iterable or async iterable of bytes streamed as it is read (sent once:
        not retried), which needs ``size_bytes``."""
        source: Callable[[], Iterable[bytes] | AsyncIterable[bytes]]
        if isinstance(data, bytes | bytearray | memoryview):
            blob = bytes(data)  # a copy: later changes to ``data`` are not sent
            size = len(blob)
            source = lambda: (blob,)  # noqa: E731
            policy = self._retry
        else:
            if size_bytes is None:
                raise ValidationError(
                    "size_bytes: required when data is an iterable", field="size_bytes"
                )
            size = size_bytes
            once = data
            source = lambda: once  # noqa: E731
            policy = RetryPolicy.no_retry(attempt_timeout_s=None)
        header = pb.EngineArtifactHeader(
            id=id,
            run_id=run_id,
            name=name,
            content_type=content_type,
            size_bytes=size,
            request_id=new_request_id(),
        )
        if sha256 is not None:
            header.sha256 = sha256
        if self._fence is not None:
            header.fence.CopyFrom(self._fence)
        _set_json(header, "metadata", metadata, "header.metadata")

        async def messages() -> AsyncIterator[pb.EnginePutArtifactRequest]:
            yield pb.EnginePutArtifactRequest(header=header)
            async for piece in _rechunk(source()):
                yield pb.EnginePutArtifactRequest(chunk=piece)

        async def attempt(endpoint: Endpoint, deadline_s: float | None) -> Any:
            stub = _engine_stub(endpoint)
            await until_connected(endpoint.channel, deadline_s)  # else: nothing was sent
            return await stub.PutArtifact(messages())

        resp = await self._fenced_call(attempt, mutation=True, policy=policy, key=run_id)
        return PutArtifactResult(resp.created, _artifact(resp.artifact))

    async def get_artifact(self, id: str) -> EngineArtifact | None:
        """The artifact's metadata, or None."""
        req = pb.EngineGetArtifactRequest(id=id)
        resp = await self._unary("GetArtifact", req, mutation=False)
        return _artifact(resp.artifact) if resp.found else None

    async def read_artifact(self, id: str) -> bytes:
        """The whole artifact in memory (see ``iter_artifact`` for large ones).
        ``RunNotFoundError`` for an unknown id."""

        async def attempt(endpoint: Endpoint, deadline_s: float | None) -> bytes:
            buf = bytearray()
            request = pb.EngineReadArtifactRequest(id=id)
            async for msg in _engine_stub(endpoint).ReadArtifact(request):
                buf += msg.chunk
            return bytes(buf)

        return await self._retried(attempt, mutation=False)

    async def iter_artifact(self, id: str) -> AsyncIterator[bytes]:
        """The artifact's bytes, chunk by chunk, as they arrive (not retried).
        ``RunNotFoundError`` for an unknown id."""
        call = self.stub.ReadArtifact(pb.EngineReadArtifactRequest(id=id))
        try:
            async for msg in call:
                if msg.chunk:
                    yield msg.chunk
        except grpc.RpcError as err:
            raise from_rpc_error(err, mutation=False) from err
        finally:
            call.cancel()

    async def list_artifacts(self, run_id: str) -> builtins.list[EngineArtifact]:
        """The run's artifacts' metadata, ordered by created_at then id."""
        req = pb.EngineListArtifactsRequest(run_id=run_id)
        pages = await self._collect("ListArtifacts", req)
        return [_artifact(a) for page in pages for a in page.artifacts]

    async def delete_artifact(self, id: str) -> bool:
        """Delete an artifact, its metadata and bytes; False when there was
        none. A read of it under way ends with every byte or ``RunNotFoundError``.
        Always unary (not carried by Execute, nor part of a transaction)."""
        req = pb.EngineDeleteArtifactRequest(id=id)
        return bool((await self._unary("DeleteArtifact", req, mutation=True)).deleted)


# -- the seams a lease and a transaction use (nobody else sets a store's attributes) ----------


def telling(view: AsyncStore, on_refused: Callable[[FencepostError], None]) -> AsyncStore:
    """``view`` (a fenced view), telling ``on_refused`` of every refusal of its
    fence: a Lease marks itself lost."""
    view._on_fence_refused = on_refused
    return view


def fence_of(store: AsyncStore) -> pb.Fence | None:
    """The fence every write of ``store`` carries (a ``fenced`` view's), or None."""
    return store._fence


async def transact(store: AsyncStore, request: Any) -> Any:
    """One ``Ledger.Transact`` on ``store``'s connection, its fence refusal told."""
    return await store._transact(request)
