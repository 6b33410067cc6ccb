"""Store transactions: several writes that commit together or not at all.

    async with lease.transaction() as tx:
        await tx.save_checkpoint(run_id, 3, state)
        await tx.put_effect("charge-42", {"ok": True})
        await tx.append_step(run_id, "charge")
        await tx.record_checkpoint("cp/run-1", 3)   # a lease's transaction only
    tx.results  # each write's answer, in order

Inside the block a write is only queued (its call returns None); when the
block ends without an exception every queued write goes to the server in one
``Ledger.Transact`` (over the client's Execute stream when it is up), which
applies them in one step of its single writer, each after checking the
transaction's fence. Any refusal -- the fence moved (``LeaseLostError``,
``LockLostError``), a validation error, a guard -- raises out of the
``async with`` and nothing of the block was written. An exception raised in
the block sends nothing. The transaction is retried on UNAVAILABLE with one
request id, so a retry never applies it twice.

The write methods are the engine store's (``create_run``, ``update_run``,
``claim_run``, ``renew_claim``, ``append_step``, ``save_checkpoint``,
``claim_key``, ``acquire_lock``, ``release_lock``, ``put_effect``,
``kv_set``, ``doc_upsert``, ``doc_delete``) with the same signatures; the
results are what those methods return. Reads and artifact uploads are not
part of a transaction.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, Protocol, TypeVar

from ._errors import LeaseLostError, UsageError, ValidationError
from ._execute import KIND_OF_REQUEST
from ._records import RunRecord, record_from_pb
from ._store import AsyncStore, transact
from .v1 import engine_store_pb2 as pb
from .v1 import ledger_pb2


class TxLease(Protocol):
    """What a lease's transaction needs of the lease (``Lease.transaction``
    hands it in)."""

    @property
    def run_id(self) -> str: ...
    @property
    def owner(self) -> str: ...
    @property
    def fencing_token(self) -> int: ...
    @property
    def ttl_ms(self) -> int: ...
    @property
    def is_lost(self) -> bool: ...
    def saw(self, record: RunRecord) -> None: ...
    def lost_error(self) -> LeaseLostError: ...

T = TypeVar("T")

WRITES = frozenset({
    "create_run", "update_run", "claim_run", "renew_claim", "append_step", "save_checkpoint",
    "claim_key", "acquire_lock", "release_lock", "put_effect", "kv_set", "doc_upsert",
    "doc_delete",
})
MAX_WRITES = 100  # the server's limit per transaction


class _Recorder(AsyncStore):
    """An AsyncStore whose writes are recorded instead of sent; in replay mode
    it answers each with the transaction's response, so a result is converted
    by exactly the code the store's own method uses."""

    def __init__(self, tx: StoreTransaction) -> None:
        super().__init__(lambda: _no_channel())
        self._tx = tx
        self._replay: Any = None

    async def _unary(self, method: str, request: Any, *, mutation: bool) -> Any:
        if not mutation:
            raise ValidationError(f"{method}: reads are not part of a transaction; read before "
                                  "the block or after it", field="transaction")
        if self._replay is not None:
            return self._replay
        kind = KIND_OF_REQUEST[type(request)]
        self._tx._add(kind, request)
        return type(getattr(ledger_pb2.CommandResult(), kind))()  # a placeholder answer

    async def put_artifact(self, *args: Any, **kwargs: Any) -> Any:
        raise ValidationError("put_artifact: artifacts upload on their own stream and are not "
                              "part of a transaction", field="transaction")


def _no_channel() -> Any:
    raise ValidationError("reads and artifact streams are not part of a transaction",
                          field="transaction")


class StoreTransaction:
    """Writes that commit together or not at all (see the module docs). Made
    by ``AsyncStore.transaction()`` or ``Lease.transaction()``; usable once."""

    def __init__(
        self, store: AsyncStore, fence: pb.Fence | None, *, lease: TxLease | None = None
    ) -> None:
        self._store = store
        self._fence = fence
        self._lease = lease
        self._recorder = _Recorder(self)
        self._commands: builtins.list[ledger_pb2.Command] = []
        # how to turn each command's answer into its result
        self._answers: builtins.list[Callable[[Any], Coroutine[Any, Any, Any]]] = []
        self._state = "new"  # -> "open" -> "committed" | "failed" | "abandoned"
        self._results: builtins.list[Any] | None = None

    def __repr__(self) -> str:
        return f"<StoreTransaction {self._state} writes={len(self._commands)}>"

    async def __aenter__(self) -> StoreTransaction:
        if self._state != "new":
            raise UsageError("a transaction is used once: start a new one")
        self._state = "open"
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None:
            self._state = "abandoned"  # nothing was sent
            return
        await self._commit()

    @property
    def results(self) -> builtins.list[Any]:
        """Each write's answer, in the order made (after the block committed)."""
        if self._results is None:
            raise UsageError(f"the transaction is {self._state}: no results")
        return self._results

    def __getattr__(self, name: str) -> Any:
        if name not in WRITES:
            raise AttributeError(
                f"{name!r}: a transaction offers the store's writes only "
                f"({', '.join(sorted(WRITES))}); read before the block or after it"
            )
        method = getattr(self._recorder, name)

        async def queue(*args: Any, **kwargs: Any) -> None:
            self._check_open()
            n = len(self._commands)
            await method(*args, **kwargs)  # records the request (validated as the store does)
            assert len(self._commands) == n + 1

            async def answer(response: Any) -> Any:
                self._recorder._replay = response
                try:
                    return await method(*args, **kwargs)
                finally:
                    self._recorder._replay = None

            self._answers.append(answer)

        queue.__name__ = name
        return queue

    # -- a lease's ledger commands ---------------------------------------------------------

    async def renew(self, ttl_ms: int | None = None) -> None:
        """Queue a renewal of the lease (to server-now + ttl; default the lease's)."""
        lease = self._lease_only("renew")
        ttl = lease.ttl_ms if ttl_ms is None else ttl_ms
        req = ledger_pb2.RenewRequest(run_id=lease.run_id, owner=lease.owner,
                                      fencing_token=lease.fencing_token, lease_ttl_ms=ttl)
        self._add("renew", req)
        self._answers.append(self._record_answer)

    async def record_checkpoint(self, key: str, snapshot_version: int) -> None:
        """Queue pointing the run's record at a checkpoint (renews the lease too)."""
        lease = self._lease_only("record_checkpoint")
        req = ledger_pb2.RecordCheckpointRequest(
            run_id=lease.run_id, owner=lease.owner, fencing_token=lease.fencing_token,
            key=key, snapshot_version=snapshot_version,
        )
        self._add("record_checkpoint", req)
        self._answers.append(self._record_answer)

    async def _record_answer(self, response: Any) -> RunRecord:
        rec = record_from_pb(response.run)
        if self._lease is not None:
            self._lease.saw(rec)
        return rec

    def _lease_only(self, name: str) -> TxLease:
        self._check_open()
        if self._lease is None:
            raise UsageError(f"{name}: only a lease's transaction (lease.transaction()) "
                               "carries ledger commands")
        return self._lease

    # -- internals ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._state != "open":
            raise UsageError(f"the transaction is {self._state}: write inside "
                               "`async with ... as tx:`")
        if len(self._commands) >= MAX_WRITES:
            raise ValidationError(f"transaction: at most {MAX_WRITES} writes",
                                  field="commands")

    def _add(self, kind: str, request: Any) -> None:
        cmd = ledger_pb2.Command(id=len(self._commands) + 1)
        getattr(cmd, kind).CopyFrom(request)
        self._commands.append(cmd)

    async def _commit(self) -> None:
        self._state = "failed"
        if not self._commands:
            self._results = []
            self._state = "committed"
            return
        if self._lease is not None and self._lease.is_lost:
            raise self._lease.lost_error()  # known already: no round trip
        req = ledger_pb2.TransactionRequest(commands=self._commands)
        if self._fence is not None:
            req.fence.CopyFrom(self._fence)
        resp = await transact(self._store, req)  # a lease's view marks it lost when refused
        results = []
        for answer, result in zip(self._answers, resp.results, strict=True):
            results.append(await answer(getattr(result, result.WhichOneof("kind"))))
        self._results = results
        self._state = "committed"
