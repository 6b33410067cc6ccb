"""What the dashboard reads, as the JSON its pages take: a run's record, its
retained changes as a timeline, an engine-store run. Times are ms since the
epoch by the server's clock; nothing here touches HTTP."""

from __future__ import annotations

from typing import Any

from ..core.records import KIND_DELETE, Record, Status


def record_doc(rec: Record) -> dict[str, Any]:
    """A record for the page: times in ms since the epoch (server clock)."""
    d: dict[str, Any] = {
        "run_id": rec.run_id,
        "status": rec.status.name.lower(),
        "attempt": rec.attempt,
        "fencing_token": rec.fencing_token,
        "version": rec.version,
        "revision": rec.revision,
        "created_at": rec.created_at,
        "updated_at": rec.updated_at,
        "lease": None,
        "checkpoint_ref": None,
        "outcome": None,
        "suspension": None,
    }
    if rec.lease is not None:
        le = rec.lease
        d["lease"] = {
            "owner": le.owner,
            "acquired_at": le.acquired_at,
            "expires_at": le.expires_at,
            "ttl_ms": le.ttl_ms,
            "lock_delay_ms": le.lock_delay_ms,
        }
    if rec.checkpoint_ref is not None:
        c = rec.checkpoint_ref
        d["checkpoint_ref"] = {"key": c.key, "snapshot_version": c.snapshot_version,
                               "saved_at": c.saved_at}
    if rec.outcome is not None:
        d["outcome"] = {"code": rec.outcome.code, "message": rec.outcome.message}
    if rec.suspension is not None:
        d["suspension"] = {"suspended_at": rec.suspension.suspended_at,
                           "pending_approval_ids": list(rec.suspension.pending_approval_ids)}
    return d


def timeline(changes: list[tuple[int, int, Record | None]]) -> list[dict[str, Any]]:
    """Retained changes of one run (oldest first) as timeline entries: what
    happened, who, when. Consecutive renewals are folded into one entry."""
    out: list[dict[str, Any]] = []
    prev: Record | None = None
    for i, (revision, kind, rec) in enumerate(changes):
        entry = _describe(prev, rec, kind, first=i == 0)
        entry["revision"] = revision
        entry["at"] = rec.updated_at if rec is not None else None
        if entry["event"] == "renewed" and out and out[-1]["event"] == "renewed":
            last = out[-1]
            last["count"] += 1
            last["until_revision"], last["last_at"] = revision, entry["at"]
            last["detail"] = entry["detail"]
        else:
            entry["count"] = 1
            out.append(entry)
        prev = rec
    return out


def _owner(rec: Record | None) -> str | None:
    return rec.lease.owner if rec is not None and rec.lease is not None else None


def _describe(prev: Record | None, rec: Record | None, kind: int, *, first: bool) -> dict[str, Any]:
    def ev(event: str, detail: str = "", who: str | None = None) -> dict[str, Any]:
        return {"event": event, "detail": detail, "who": who, "status":
                rec.status.name.lower() if rec is not None else None,
                "fencing_token": rec.fencing_token if rec is not None else None}

    if kind == KIND_DELETE or rec is None:
        return ev("deleted", "hard-deleted; its last fencing token is kept", _owner(prev))
    status = rec.status
    if prev is None:
        if not first or rec.version == 1:
            if rec.lease is not None:
                return ev("acquired", f"token {rec.fencing_token}, ttl {rec.lease.ttl_ms} ms",
                          rec.lease.owner)
            return ev("created", status.name.lower())
        return ev("earlier history compacted", f"first retained change: {status.name.lower()}",
                  _owner(rec))
    if status is not prev.status:
        if status is Status.CANCELLED:
            msg = rec.outcome.message if rec.outcome and rec.outcome.message else ""
            return ev("cancelled", msg, _owner(prev))
        if status in (Status.COMPLETED, Status.FAILED):
            code = rec.outcome.code if rec.outcome else ""
            return ev("finished", f"{status.name.lower()} {code}".strip(), _owner(prev))
        if status is Status.SUSPENDED:
            ids = rec.suspension.pending_approval_ids if rec.suspension else ()
            return ev("suspended", ", ".join(ids), _owner(prev))
        if status is Status.QUEUED and prev.status is Status.SUSPENDED:
            return ev("resumed", "queued again")
        if status is Status.QUEUED:
            if prev.lease is not None and prev.lease.expires_at <= rec.updated_at:
                return ev("resumed", "expired lease cleared; queued again", _owner(prev))
            return ev("released", "given back unfinished", _owner(prev))
    if rec.lease is not None and rec.fencing_token != prev.fencing_token:
        if prev.lease is not None:
            return ev("taken over", f"from {prev.lease.owner} (token {prev.fencing_token} -> "
                      f"{rec.fencing_token})", rec.lease.owner)
        return ev("acquired", f"token {rec.fencing_token}, attempt {rec.attempt}", rec.lease.owner)
    if rec.checkpoint_ref is not None and rec.checkpoint_ref != prev.checkpoint_ref:
        c = rec.checkpoint_ref
        return ev("checkpointed", f"{c.key} v{c.snapshot_version}", _owner(rec))
    if rec.lease is not None and prev.lease is not None and rec.lease.owner == prev.lease.owner:
        return ev("renewed", f"ttl {rec.lease.ttl_ms} ms", rec.lease.owner)
    return ev("updated", f"version {rec.version}", _owner(rec))


def engine_doc(run: Any) -> dict[str, Any]:
    return {
        "id": run.id,
        "agent": run.agent,
        "status": run.status,
        "concurrency_key": run.concurrency_key,
        "claim": None if run.claim is None else {"owner": run.claim.owner,
                                                 "expires_at": run.claim.expires_at},
        "created_at": run.created_at,
        "updated_at": run.updated_at,
    }
