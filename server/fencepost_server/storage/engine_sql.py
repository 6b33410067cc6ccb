"""The engine store's SQL (SQLite and PostgreSQL alike): the writer's executors, and the read side.

Executors run in the writer thread, inside the batch's transaction and a
savepoint of their own (``Writer.register``): each reads the rows it needs,
calls the pure decision in ``core.engine``, and writes the outcome. Nothing
else writes these tables.

Reads go through ``EngineReader``: read-only connections (the storage's
``reader``) used from a thread pool of their own, never the writer's thread
and never the event loop. They read committed state while the writer
commits; a listing reads one snapshot (one read transaction) from its first
page to its last.

Artifacts are stored as the chunks they arrived in (``engine_chunks``, keyed
by an upload id), one writer command per chunk, so no artifact is ever held
whole in memory; a final command inserts the metadata pointing at the upload.
``engine_uploads`` lists uploads not (yet) adopted by an artifact: a stream
that fails discards its upload, and the start-up sweep removes any a crash
left behind. Deleting an artifact deletes its metadata and its upload's
chunks in one command; an upload id is never reused, so a reader still
walking the old chunks finds them whole or missing, never another's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from ..core import engine as E
from ..core import fence as F
from ..core.errors import validation
from ..core.shards import shard_of
from .sql import answering, broken

T = TypeVar("T")
P = TypeVar("P")

# -- rows <-> values ---------------------------------------------------------------------

RUN_COLS = (
    "id, agent, status, concurrency_key, input, output, error, metadata, "
    "claim_owner, claim_expires_at, created_at, updated_at"
)
STEP_COLS = "run_id, seq, name, status, input, output, error, metadata, created_at"
ARTIFACT_COLS = "id, run_id, name, content_type, size_bytes, sha256, metadata, created_at"


def _run(row: Sequence[Any]) -> E.Run:
    claim = E.Claim(row[8], row[9]) if row[8] is not None else None
    return E.Run(
        row[0], row[1], row[2], row[3], row[4], row[5], row[6], row[7], claim, row[10], row[11]
    )


def _step(row: Sequence[Any]) -> E.Step:
    return E.Step(*row)


def _artifact(row: Sequence[Any]) -> E.Artifact:
    return E.Artifact(*row)


def _get_run(db: Any, run_id: str) -> E.Run | None:
    row = db.execute(f"SELECT {RUN_COLS} FROM engine_runs WHERE id = ?", (run_id,)).fetchone()
    return None if row is None else _run(row)


def _put_run(db: Any, r: E.Run) -> None:
    db.execute(
        f"INSERT INTO engine_runs ({RUN_COLS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?) "
        "ON CONFLICT (id) DO UPDATE SET agent=excluded.agent, status=excluded.status, "
        "concurrency_key=excluded.concurrency_key, input=excluded.input, "
        "output=excluded.output, error=excluded.error, metadata=excluded.metadata, "
        "claim_owner=excluded.claim_owner, claim_expires_at=excluded.claim_expires_at, "
        "created_at=excluded.created_at, updated_at=excluded.updated_at",
        (
            r.id,
            r.agent,
            r.status,
            r.concurrency_key,
            r.input,
            r.output,
            r.error,
            r.metadata,
            r.claim.owner if r.claim else None,
            r.claim.expires_at if r.claim else None,
            r.created_at,
            r.updated_at,
        ),
    )


def _get_artifact(db: Any, art_id: str) -> E.Artifact | None:
    row = db.execute(
        f"SELECT {ARTIFACT_COLS} FROM engine_artifacts WHERE id = ?", (art_id,)
    ).fetchone()
    return None if row is None else _artifact(row)


# -- executors (writer thread) -------------------------------------------------------------


def create_run(db: Any, cmd: E.CreateRun, now: int) -> E.RunCreated:
    row, result = E.decide_create_run(_get_run(db, cmd.id), cmd, now)
    if row is not None:
        _put_run(db, row)
    return result


def update_run(db: Any, cmd: E.UpdateRun, now: int) -> E.Run:
    run = E.decide_update_run(_get_run(db, cmd.id), cmd, now)
    _put_run(db, run)
    return run


def claim_run(db: Any, cmd: E.ClaimRun, now: int) -> E.RunClaimed:
    row, result = E.decide_claim_run(_get_run(db, cmd.id), cmd, now)
    if row is not None:
        _put_run(db, row)
    return result


def renew_claim(db: Any, cmd: E.RenewClaim, now: int) -> E.RunClaimed:
    row, result = E.decide_renew_claim(_get_run(db, cmd.id), cmd, now)
    if row is not None:
        _put_run(db, row)
    return result


def append_step(db: Any, cmd: E.AppendStep, now: int) -> E.Step:
    (last,) = db.execute(
        "SELECT coalesce(max(seq), 0) FROM engine_steps WHERE run_id = ?", (cmd.run_id,)
    ).fetchone()
    step = E.decide_append_step(last, cmd, now)
    db.execute(
        f"INSERT INTO engine_steps ({STEP_COLS}) VALUES (?,?,?,?,?,?,?,?,?)",
        (
            step.run_id,
            step.seq,
            step.name,
            step.status,
            step.input,
            step.output,
            step.error,
            step.metadata,
            step.created_at,
        ),
    )
    return step


def save_checkpoint(db: Any, cmd: E.SaveCheckpoint, now: int) -> E.CheckpointSaved:
    row = db.execute(
        "SELECT run_id, step_index, state, saved_at FROM engine_checkpoints WHERE run_id = ?",
        (cmd.run_id,),
    ).fetchone()
    new, result = E.decide_save_checkpoint(E.Checkpoint(*row) if row else None, cmd, now)
    if new is not None:
        db.execute(
            "INSERT INTO engine_checkpoints (run_id, step_index, state, saved_at) "
            "VALUES (?,?,?,?) ON CONFLICT (run_id) DO UPDATE SET "
            "step_index=excluded.step_index, state=excluded.state, saved_at=excluded.saved_at",
            (new.run_id, new.step_index, new.state, new.saved_at),
        )
    return result


def claim_key(db: Any, cmd: E.ClaimKey, now: int) -> E.KeyClaimed:
    row = db.execute(
        "SELECT scope, key, run_id, expires_at FROM engine_keys WHERE scope = ? AND key = ?",
        (cmd.scope, cmd.key),
    ).fetchone()
    new, result = E.decide_claim_key(E.KeyHold(*row) if row else None, cmd, now)
    if new is not None:
        db.execute(
            "INSERT INTO engine_keys (scope, key, run_id, expires_at) VALUES (?,?,?,?) "
            "ON CONFLICT (scope, key) DO UPDATE SET run_id=excluded.run_id, "
            "expires_at=excluded.expires_at",
            (new.scope, new.key, new.run_id, new.expires_at),
        )
    return result


def _get_lock(db: Any, key: str) -> E.Lock | None:
    row = db.execute(
        "SELECT key, owner, fencing_token, expires_at FROM engine_locks WHERE key = ?", (key,)
    ).fetchone()
    return E.Lock(*row) if row else None


def _put_lock(db: Any, lock: E.Lock) -> None:
    db.execute(
        "INSERT INTO engine_locks (key, owner, fencing_token, expires_at) VALUES (?,?,?,?) "
        "ON CONFLICT (key) DO UPDATE SET owner=excluded.owner, "
        "fencing_token=excluded.fencing_token, expires_at=excluded.expires_at",
        (lock.key, lock.owner, lock.fencing_token, lock.expires_at),
    )


def acquire_lock(db: Any, cmd: E.AcquireLock, now: int) -> E.LockAnswer:
    new, result = E.decide_acquire_lock(_get_lock(db, cmd.key), cmd, now)
    if new is not None:
        _put_lock(db, new)
    return result


def release_lock(db: Any, cmd: E.ReleaseLock, now: int) -> E.Done:
    new, result = E.decide_release_lock(_get_lock(db, cmd.key), cmd, now)
    if new is not None:
        _put_lock(db, new)
    return result


def put_effect(db: Any, cmd: E.PutEffect, now: int) -> E.Done:
    db.execute(
        "INSERT INTO engine_effects (key, result, recorded_at) VALUES (?,?,?) "
        "ON CONFLICT (key) DO UPDATE SET result=excluded.result, "
        "recorded_at=excluded.recorded_at",
        (cmd.key, cmd.result, now),
    )
    return E.Done(True, now)


def kv_set(db: Any, cmd: E.KvSet, now: int) -> E.Done:
    db.execute(
        "INSERT INTO engine_kv (agent, key, value, updated_at) VALUES (?,?,?,?) "
        "ON CONFLICT (agent, key) DO UPDATE SET value=excluded.value, "
        "updated_at=excluded.updated_at",
        (cmd.agent, cmd.key, cmd.value, now),
    )
    return E.Done(True, now)


def doc_upsert(db: Any, cmd: E.DocUpsert, now: int) -> E.DocUpserted:
    row = db.execute(
        "SELECT id, doc, updated_at FROM engine_docs WHERE agent = ? AND collection = ? AND id = ?",
        (cmd.agent, cmd.collection, cmd.id),
    ).fetchone()
    doc, result = E.decide_doc_upsert(E.Doc(*row) if row else None, cmd, now)
    db.execute(
        "INSERT INTO engine_docs (agent, collection, id, doc, updated_at) VALUES (?,?,?,?,?) "
        "ON CONFLICT (agent, collection, id) DO UPDATE SET doc=excluded.doc, "
        "updated_at=excluded.updated_at",
        (cmd.agent, cmd.collection, doc.id, doc.doc, doc.updated_at),
    )
    return result


def doc_delete(db: Any, cmd: E.DocDelete, now: int) -> E.Done:
    cur = db.execute(
        "DELETE FROM engine_docs WHERE agent = ? AND collection = ? AND id = ?",
        (cmd.agent, cmd.collection, cmd.id),
    )
    return E.Done(cur.rowcount > 0, now)


def stage_chunk(db: Any, cmd: E.StageChunk, now: int) -> E.Staged:
    db.execute(
        "INSERT INTO engine_uploads (upload_id, started_at) VALUES (?, ?) "
        "ON CONFLICT (upload_id) DO NOTHING",
        (cmd.upload_id, now),
    )
    db.execute(
        "INSERT INTO engine_chunks (upload_id, seq, size, data) VALUES (?,?,?,?)",
        (cmd.upload_id, cmd.seq, len(cmd.data), cmd.data),
    )
    return E.Staged(cmd.upload_id, cmd.seq, len(cmd.data))


def _drop_upload(db: Any, upload_id: str) -> None:
    """Delete an upload's chunks unless an artifact points at them."""
    adopted = db.execute(
        "SELECT 1 FROM engine_artifacts WHERE upload_id = ?", (upload_id,)
    ).fetchone()
    if adopted is None:
        db.execute("DELETE FROM engine_chunks WHERE upload_id = ?", (upload_id,))
    db.execute("DELETE FROM engine_uploads WHERE upload_id = ?", (upload_id,))


def commit_artifact(db: Any, cmd: E.CommitArtifact, now: int) -> E.ArtifactCommitted:
    staged, chunks = 0, 0
    if cmd.upload_id:
        staged, chunks = db.execute(
            "SELECT coalesce(sum(size), 0), count(*) FROM engine_chunks WHERE upload_id = ?",
            (cmd.upload_id,),
        ).fetchone()
    existing = _get_artifact(db, cmd.id)
    if existing is None and not cmd.upload_id:
        # the id existed when the stream began (its bytes were not kept) and
        # was deleted since
        raise validation(
            "header.id",
            f"artifact {cmd.id!r} was deleted while this upload of it was in flight, "
            "and its bytes were not kept; send it again",
        )
    new, result = E.decide_commit_artifact(existing, cmd, staged, now)
    if new is None:
        if cmd.upload_id:
            _drop_upload(db, cmd.upload_id)  # a lost race: keep the stored artifact
        return result
    db.execute(
        "INSERT INTO engine_artifacts (id, run_id, name, content_type, size_bytes, sha256, "
        "metadata, upload_id, chunks, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (
            new.id,
            new.run_id,
            new.name,
            new.content_type,
            new.size_bytes,
            new.sha256,
            new.metadata,
            cmd.upload_id,
            chunks,
            new.created_at,
        ),
    )
    db.execute("DELETE FROM engine_uploads WHERE upload_id = ?", (cmd.upload_id,))
    return result


def delete_artifact(db: Any, cmd: E.DeleteArtifact, now: int) -> E.Done:
    row = db.execute("SELECT upload_id FROM engine_artifacts WHERE id = ?", (cmd.id,)).fetchone()
    if row is None:
        return E.Done(False, now)
    db.execute("DELETE FROM engine_artifacts WHERE id = ?", (cmd.id,))
    _drop_upload(db, row[0])  # its chunks, unless another artifact points at them
    return E.Done(True, now)


def discard_upload(db: Any, cmd: E.DiscardUpload, now: int) -> E.Done:
    _drop_upload(db, cmd.upload_id)
    return E.Done(True, now)


def sweep_uploads(db: Any, cmd: E.SweepUploads, now: int) -> E.Done:
    if cmd.abandoned_only:  # PostgreSQL, --lead-shards: writers of coordinators gone
        ids = [r[0] for r in db.execute(
            "SELECT upload_id FROM engine_uploads WHERE started_by <> "
            "current_setting('application_name') AND started_by NOT IN (SELECT "
            "left('fencepost-writer ' || identity, 63) FROM fencepost_members WHERE "
            "expires_at > (extract(epoch FROM clock_timestamp()) * 1000)::bigint)")]
    else:
        ids = [r[0] for r in db.execute("SELECT upload_id FROM engine_uploads")]
    for upload_id in ids:
        _drop_upload(db, upload_id)
    return E.Done(bool(ids), len(ids))


EXECUTORS: dict[type, Callable[[Any, Any, int], Any]] = {
    E.CreateRun: create_run,
    E.UpdateRun: update_run,
    E.ClaimRun: claim_run,
    E.RenewClaim: renew_claim,
    E.AppendStep: append_step,
    E.SaveCheckpoint: save_checkpoint,
    E.ClaimKey: claim_key,
    E.AcquireLock: acquire_lock,
    E.ReleaseLock: release_lock,
    E.PutEffect: put_effect,
    E.KvSet: kv_set,
    E.DocUpsert: doc_upsert,
    E.DocDelete: doc_delete,
    E.StageChunk: stage_chunk,
    E.CommitArtifact: commit_artifact,
    E.DeleteArtifact: delete_artifact,
    E.DiscardUpload: discard_upload,
    E.SweepUploads: sweep_uploads,
}


def check_lock_fence(db: Any, fence: F.Fence) -> None:
    """A lock fence against the lock's row as the writer's transaction sees it."""
    E.check_lock_fence(fence, _get_lock(db, fence.lock_key))


def extend_leases(db: Any, by_ms: int, alive_at: int,
                  shards: tuple[frozenset[int], int] | None = None) -> int:
    """A new leader's extension (core.ledger.ExtendLeases) of every claim and
    keyed lock still live at ``alive_at``, by ``by_ms``; how many. ``shards``
    (the shards, the count): only the claims and locks keyed in those."""
    if shards is not None:
        return _extend_in_shards(db, by_ms, alive_at, *shards)
    claims = db.execute(
        "UPDATE engine_runs SET claim_expires_at = claim_expires_at + ? "
        "WHERE claim_owner IS NOT NULL AND claim_expires_at > ?",
        (by_ms, alive_at),
    ).rowcount
    locks = db.execute(
        "UPDATE engine_locks SET expires_at = expires_at + ? "
        "WHERE owner IS NOT NULL AND expires_at > ?",
        (by_ms, alive_at),
    ).rowcount
    return int(claims) + int(locks)


def _extend_in_shards(db: Any, by_ms: int, alive_at: int, shards: frozenset[int],
                      n: int) -> int:
    """``extend_leases`` for the claims and locks keyed in ``shards`` alone
    (a coordinator taking shards: storage/shared.py)."""
    done = 0
    for table, key, owner, expiry in (("engine_runs", "id", "claim_owner", "claim_expires_at"),
                                      ("engine_locks", "key", "owner", "expires_at")):
        keys = [k for (k,) in db.execute(
            f"SELECT {key} FROM {table} WHERE {owner} IS NOT NULL AND {expiry} > ?",
            (alive_at,)) if shard_of(k, n) in shards]
        if keys:
            db.executemany(f"UPDATE {table} SET {expiry} = {expiry} + ? WHERE {key} = ?",
                           [(by_ms, k) for k in keys])
            done += len(keys)
    return done


class WriterHooks:
    """What the writer needs of the engine store (its ``EngineHooks``): every
    command's executor, the lock fence check, a takeover's lease extension."""

    executors = EXECUTORS
    check_lock_fence = staticmethod(check_lock_fence)
    extend_leases = staticmethod(extend_leases)


# -- reads (reader threads, read-only connections) -------------------------------------------

PAGE_ITEMS = 1000
NO_LIMIT = 2**62  # LIMIT for "all" in both dialects
PAGE_BYTES = 1 << 20


def _weight(row: Sequence[Any]) -> int:
    return 64 + sum(len(v) for v in row if isinstance(v, str | bytes))


def _pages(
    rows: Iterable[Sequence[Any]],
    to_item: Callable[[Sequence[Any]], T],
    make_page: Callable[[list[T]], P],
    keep: Callable[[T], bool] | None = None,
    limit: int | None = None,
) -> Iterator[P]:
    """Group rows into pages of at most PAGE_ITEMS items and about PAGE_BYTES;
    always at least one (possibly empty) page."""
    page: list[T] = []
    size = 0
    sent = 0
    emitted = False
    for row in rows:
        if limit is not None and sent >= limit:
            break
        item = to_item(row)
        if keep is not None and not keep(item):
            continue
        w = _weight(row)
        if page and (len(page) >= PAGE_ITEMS or size + w > PAGE_BYTES):
            yield make_page(page)
            emitted = True
            page, size = [], 0
        page.append(item)
        size += w
        sent += 1
    if page or not emitted:
        yield make_page(page)


def get_run(db: Any, run_id: str) -> E.Run | None:
    return _get_run(db, run_id)


def list_runs(
    db: Any,
    make_page: Callable[[list[E.Run], int], P],
    *,
    agent: str | None,
    statuses: Sequence[str],
    concurrency_key: str | None,
    limit: int | None,
    offset: int,
) -> Iterator[P]:
    conds: list[str] = []
    params: list[Any] = []
    if agent is not None:
        conds.append("agent = ?")
        params.append(agent)
    if statuses:
        conds.append(f"status IN ({','.join('?' * len(statuses))})")
        params.extend(statuses)
    if concurrency_key is not None:
        conds.append("concurrency_key = ?")
        params.append(concurrency_key)
    where = f"WHERE {' AND '.join(conds)}" if conds else ""
    (total,) = db.execute(f"SELECT count(*) FROM engine_runs {where}", params).fetchone()
    cur = db.execute(
        f"SELECT {RUN_COLS} FROM engine_runs {where} ORDER BY created_at, id LIMIT ? OFFSET ?",
        (*params, NO_LIMIT if limit is None else limit, offset),
    )
    return _pages(cur, _run, lambda items: make_page(items, total))


def list_steps(
    db: Any, make_page: Callable[[list[E.Step]], P], run_id: str
) -> Iterator[P]:
    cur = db.execute(
        f"SELECT {STEP_COLS} FROM engine_steps WHERE run_id = ? ORDER BY seq", (run_id,)
    )
    return _pages(cur, _step, make_page)


def latest_checkpoint(db: Any, run_id: str) -> E.Checkpoint | None:
    row = db.execute(
        "SELECT run_id, step_index, state, saved_at FROM engine_checkpoints WHERE run_id = ?",
        (run_id,),
    ).fetchone()
    return E.Checkpoint(*row) if row else None


def get_effect(db: Any, key: str) -> tuple[str, int] | None:
    row = db.execute(
        "SELECT result, recorded_at FROM engine_effects WHERE key = ?", (key,)
    ).fetchone()
    return (row[0], row[1]) if row else None


def kv_get(db: Any, agent: str, key: str) -> tuple[str, int] | None:
    row = db.execute(
        "SELECT value, updated_at FROM engine_kv WHERE agent = ? AND key = ?", (agent, key)
    ).fetchone()
    return (row[0], row[1]) if row else None


def doc_list(
    db: Any,
    make_page: Callable[[list[E.Doc]], P],
    *,
    agent: str,
    collection: str,
    where: dict[str, Any],
    limit: int | None,
) -> Iterator[P]:
    cur = db.execute(
        "SELECT id, doc, updated_at FROM engine_docs WHERE agent = ? AND collection = ? "
        "ORDER BY id",
        (agent, collection),
    )
    return _pages(
        cur,
        lambda row: E.Doc(*row),
        make_page,
        keep=(lambda d: E.doc_matches(d.doc, where)) if where else None,
        limit=limit,
    )


def get_artifact(db: Any, art_id: str) -> E.Artifact | None:
    return _get_artifact(db, art_id)


def artifact_exists(db: Any, art_id: str) -> bool:
    row = db.execute("SELECT 1 FROM engine_artifacts WHERE id = ?", (art_id,)).fetchone()
    return row is not None


def artifact_layout(db: Any, art_id: str) -> tuple[E.Artifact, str, int] | None:
    """The metadata, the upload holding the bytes, and its chunk count."""
    row = db.execute(
        f"SELECT {ARTIFACT_COLS}, upload_id, chunks FROM engine_artifacts WHERE id = ?",
        (art_id,),
    ).fetchone()
    if row is None:
        return None
    return _artifact(row[:8]), row[8], row[9]


def read_chunk(db: Any, upload_id: str, seq: int) -> bytes | None:
    """One stored chunk; None once the artifact holding it was deleted."""
    row = db.execute(
        "SELECT data FROM engine_chunks WHERE upload_id = ? AND seq = ?", (upload_id, seq)
    ).fetchone()
    return None if row is None else bytes(row[0])


def list_artifacts(
    db: Any, make_page: Callable[[list[E.Artifact]], P], run_id: str
) -> Iterator[P]:
    cur = db.execute(
        f"SELECT {ARTIFACT_COLS} FROM engine_artifacts WHERE run_id = ? ORDER BY created_at, id",
        (run_id,),
    )
    return _pages(cur, _artifact, make_page)


def count_rows(db: Any, table: str) -> int:
    """For tests and operators: rows in one of the engine tables."""
    if not table.startswith("engine_") or not table.replace("_", "").isalnum():
        raise ValueError(f"not an engine table: {table}")
    (n,) = db.execute(f"SELECT count(*) FROM {table}").fetchone()
    return int(n)


class EngineReader:
    """Read-only connections used from a thread pool of their own.

    ``run(fn, ...)`` calls ``fn(conn, ...)`` in a reader thread with a pooled
    connection. ``pages(fn, ...)`` opens a read transaction, calls
    ``fn(conn, ...)`` for an iterator of pages, and yields the pages one at a
    time (each ``next`` in a reader thread), so a listing of any size is one
    snapshot and never sits whole in memory.
    """

    def __init__(self, connect: Callable[[], Any], threads: int = 4, keep_idle: int = 8) -> None:
        self._connect = connect  # the storage's ``reader``
        self.keep_idle = keep_idle
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="fencepost-engine-read")
        self._idle: list[Any] = []
        self._lock = threading.Lock()
        self._closed = False

    # -- what the EngineStore service reads (its ``EngineReads``) ---------------------------

    async def get_run(self, run_id: str) -> E.Run | None:
        return await self.run(get_run, run_id)

    def list_runs(
        self, make_page: Callable[[list[E.Run], int], P], *, agent: str | None,
        statuses: Sequence[str], concurrency_key: str | None, limit: int | None, offset: int,
    ) -> AsyncIterator[P]:
        return self.pages(list_runs, make_page, agent=agent, statuses=statuses,
                          concurrency_key=concurrency_key, limit=limit, offset=offset)

    def list_steps(self, make_page: Callable[[list[E.Step]], P], run_id: str) -> AsyncIterator[P]:
        return self.pages(list_steps, make_page, run_id)

    async def latest_checkpoint(self, run_id: str) -> E.Checkpoint | None:
        return await self.run(latest_checkpoint, run_id)

    async def get_effect(self, key: str) -> tuple[str, int] | None:
        return await self.run(get_effect, key)

    async def kv_get(self, agent: str, key: str) -> tuple[str, int] | None:
        return await self.run(kv_get, agent, key)

    def doc_list(
        self, make_page: Callable[[list[E.Doc]], P], *, agent: str, collection: str,
        where: dict[str, Any], limit: int | None,
    ) -> AsyncIterator[P]:
        return self.pages(doc_list, make_page, agent=agent, collection=collection, where=where,
                          limit=limit)

    async def get_artifact(self, art_id: str) -> E.Artifact | None:
        return await self.run(get_artifact, art_id)

    async def artifact_exists(self, art_id: str) -> bool:
        return await self.run(artifact_exists, art_id)

    async def artifact_layout(self, art_id: str) -> tuple[E.Artifact, str, int] | None:
        return await self.run(artifact_layout, art_id)

    async def read_chunk(self, upload_id: str, seq: int) -> bytes | None:
        return await self.run(read_chunk, upload_id, seq)

    def list_artifacts(
        self, make_page: Callable[[list[E.Artifact]], P], run_id: str
    ) -> AsyncIterator[P]:
        return self.pages(list_artifacts, make_page, run_id)

    async def runs_page(self, *, agent: str | None, statuses: Sequence[str], limit: int,
                        offset: int) -> tuple[list[E.Run], int]:
        """One page of runs (created_at, id order) and the match count (the dashboard)."""

        def read(conn: Any) -> tuple[list[E.Run], int]:
            pages = list(list_runs(
                conn, lambda items, total: (items, total), agent=agent, statuses=statuses,
                concurrency_key=None, limit=limit, offset=offset))
            return [r for items, _ in pages for r in items], pages[0][1] if pages else 0

        return await self.run(read)

    def _checkout(self) -> Any:
        with self._lock:
            if self._closed:
                raise RuntimeError("the engine reader is closed")
            if self._idle:
                return self._idle.pop()
        return self._connect()

    def _checkin(self, conn: Any) -> None:
        try:
            if broken(conn):  # PostgreSQL restarted or ended the session
                raise ConnectionError
            if conn.in_transaction:
                conn.rollback()
        except Exception:  # a broken connection: drop it
            conn.close()
            return
        with self._lock:
            if not self._closed and len(self._idle) < self.keep_idle:
                self._idle.append(conn)
                return
        conn.close()

    def _call(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        conn = self._checkout()
        try:
            return fn(conn, *args, **kwargs)
        finally:
            self._checkin(conn)

    async def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        loop = asyncio.get_running_loop()
        with answering():
            return await loop.run_in_executor(self._pool, self._call, fn, args, kwargs)

    def _open(
        self, fn: Callable[..., Iterator[P]], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[Any, Iterator[P]]:
        conn = self._checkout()
        try:
            conn.execute("BEGIN")  # one snapshot for the whole listing
            return conn, fn(conn, *args, **kwargs)
        except BaseException:
            self._checkin(conn)
            raise

    def _finish(self, conn: Any, it: Iterator[Any]) -> None:
        with contextlib.suppress(Exception):
            close = getattr(it, "close", None)
            if close is not None:
                close()
        self._checkin(conn)

    async def pages(
        self, fn: Callable[..., Iterator[P]], *args: Any, **kwargs: Any
    ) -> AsyncIterator[P]:
        opened = self._pool.submit(self._open, fn, args, kwargs)
        try:
            with answering():
                conn, it = await asyncio.wrap_future(opened)
        except BaseException:
            # cancelled while opening: give the connection back once it is open
            opened.add_done_callback(self._finish_opened)
            raise
        step: concurrent.futures.Future[Any] | None = None
        done = object()
        try:
            while True:
                step = self._pool.submit(next, it, done)
                with answering():
                    page = await asyncio.wrap_future(step)
                if page is done:
                    return
                yield page
        finally:
            # Never awaited, and only once no page is being read on a reader
            # thread: a cancelled stream still ends its read transaction and
            # returns its connection, and never while it is still in use.
            def finish(_: object = None) -> None:
                self._submit_finish(conn, it)

            if step is None:
                finish()
            else:
                step.add_done_callback(finish)

    def _submit_finish(self, conn: Any, it: Iterator[Any]) -> None:
        try:
            self._pool.submit(self._finish, conn, it)
        except RuntimeError:  # the reader is closing: finish here
            self._finish(conn, it)

    def _finish_opened(self, fut: concurrent.futures.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is None:
            self._submit_finish(*fut.result())

    def close(self) -> None:
        """Close every idle connection and stop the threads (after in-flight reads)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        self._pool.shutdown(wait=True)
        for conn in idle:
            conn.close()
