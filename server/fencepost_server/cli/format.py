"""How the operator commands print: key/value lines for one record, tables
for ``ls``, one line per watched change (``cli/ops.py`` documents the output)."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from fencepost import RunRecord, WatchEvent
from fencepost._records import format_time


def event_text(ev: WatchEvent) -> str:
    if ev.record is None:
        return f"{ev.revision} {ev.kind.value} {ev.run_id}\n"
    r = ev.record
    owner = r.lease.owner if r.lease is not None else "-"
    return (
        f"{ev.revision} {ev.kind.value} {ev.run_id} {r.status.value} token={r.fencing_token} "
        f"attempt={r.attempt} owner={owner} version={r.version}\n"
    )

def flatten(doc: dict[str, Any], prefix: str = "") -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    for key, value in doc.items():
        name = prefix + key
        if isinstance(value, dict):
            rows += flatten(value, name + ".")
        elif isinstance(value, list):
            rows.append((name, ", ".join(map(str, value)) or "-"))
        else:
            rows.append((name, str(value)))
    return rows


def record_text(rec: RunRecord) -> str:
    """Key/value lines, nested fields as dotted keys (lease.owner ...); the
    lease's state (time left, EXPIRED, LOCK-DELAY) as ``lease.state``."""
    rows = flatten(rec.to_dict())
    if rec.lease is not None:
        rows.append(("lease.state", lease_state(rec, datetime.now(UTC))))
    width = max(len(k) for k, _ in rows)
    return "".join(f"{k:<{width}}  {v}\n" for k, v in rows)


COLUMNS = ("RUN_ID", "STATUS", "TOKEN", "ATTEMPT", "OWNER", "LEASE", "UPDATED")
ENGINE_COLUMNS = ("ID", "AGENT", "STATUS", "CLAIMED_BY", "CLAIM", "CREATED", "UPDATED")


def table(records: list[RunRecord], now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    rows: list[tuple[str, ...]] = [COLUMNS]
    for r in records:
        rows.append(
            (
                r.run_id,
                r.status.value,
                str(r.fencing_token),
                str(r.attempt),
                r.lease.owner if r.lease is not None else "-",
                lease_state(r, now),
                local_time(r.updated_at),
            )
        )
    return columns(rows)


def columns(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() + "\n"
        for row in rows
    )


def lease_state(rec: RunRecord, now: datetime) -> str:
    """``12s left``; past its expiry ``LOCK-DELAY 4s left`` while another owner
    must still wait, then ``EXPIRED 3m10s ago``; ``-`` without a lease."""
    lease = rec.lease
    if lease is None:
        return "-"
    left = (lease.expires_at - now).total_seconds()
    if left > 0:
        return f"{duration(left)} left"
    delay_left = left + lease.lock_delay_ms / 1000
    if delay_left > 0:
        return f"LOCK-DELAY {duration(delay_left)} left"
    return f"EXPIRED {duration(-left)} ago"


def duration(seconds: float) -> str:
    """850ms, 12s, 3m10s, 2h05m, 3d04h."""
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def local_time(t: datetime) -> str:
    """In the machine's time zone, to the second: ``2026-12-01 10:21:05``."""
    return t.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def engine_doc(run: Any) -> dict[str, Any]:
    claim = run.claim
    return {
        "id": run.id,
        "agent": run.agent,
        "status": run.status,
        "concurrency_key": run.concurrency_key,
        "claim": None
        if claim is None
        else {"owner": claim.owner, "expires_at": format_time(claim.expires_at)},
        "created_at": format_time(run.created_at),
        "updated_at": format_time(run.updated_at),
    }


def engine_table(runs: list[Any], now: datetime | None = None) -> str:
    now = now or datetime.now(UTC)
    rows: list[tuple[str, ...]] = [ENGINE_COLUMNS]
    for r in runs:
        claim = "-"
        if r.claim is not None:
            left = (r.claim.expires_at - now).total_seconds()
            claim = f"{duration(left)} left" if left > 0 else f"EXPIRED {duration(-left)} ago"
        rows.append(
            (
                r.id,
                r.agent,
                r.status,
                r.claim.owner if r.claim is not None else "-",
                claim,
                local_time(r.created_at),
                local_time(r.updated_at),
            )
        )
    return columns(rows)


SHARD_COLUMNS = ("SHARD", "OWNER", "ADDRESS", "EPOCH", "RUNS", "LEASES")


def shard_doc(shard: Any) -> dict[str, Any]:
    """One shard of ``fencepost shards --json``."""
    return {"shard": shard.index, "owner": shard.owner, "address": shard.address,
            "epoch": shard.epoch, "runs": shard.runs, "leases": shard.leases}


def shard_table(shards: Iterable[Any]) -> str:
    rows: list[tuple[str, ...]] = [SHARD_COLUMNS]
    rows += [(str(sh.index), sh.owner or "-", sh.address or "-", str(sh.epoch), str(sh.runs),
              str(sh.leases)) for sh in shards]
    return columns(rows)
