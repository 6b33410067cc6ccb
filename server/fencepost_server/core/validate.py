"""Input rules (docs/SPEC.md §10), pure. Every failure names the field it refers to."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from . import ledger as L
from .errors import validation
from .fence import Fence
from .records import MAX_INT64, MAX_SAFE, Record, Status

MAX_RUN_ID_BYTES = 512
MAX_OWNER_BYTES = 256
MAX_REQUEST_ID_BYTES = 128
MAX_STREAM_NAME_BYTES = 128
MAX_KEY_BYTES = 1024
MAX_CODE_BYTES = 128
MAX_MESSAGE_BYTES = 4096
MAX_APPROVAL_IDS = 1000
MAX_APPROVAL_ID_BYTES = 256
MAX_LOCK_DELAY_MS = L.MAX_TTL_MS
# A version, attempt or token a client writes must leave room for the
# server's next increment without passing MAX_SAFE (2^53 - 1).
MAX_COUNTER_IN = MAX_SAFE - 1
# The last millisecond a google.protobuf.Timestamp may hold: 9999-12-31T23:59:59.999Z.
MAX_TIME_MS = 253_402_300_799_999


_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _has_control(s: str) -> bool:
    """C0 and C1 control characters and DEL (Unicode category Cc)."""
    return _CONTROL.search(s) is not None


def text(field: str, value: str, max_bytes: int, *, min_bytes: int = 1) -> str:
    """A UTF-8 string of min..max bytes without control characters."""
    # The common case, decided in C: printable ASCII (in ASCII, exactly the
    # control characters are unprintable) is one byte per character.
    if value.isascii() and value.isprintable() and min_bytes <= len(value) <= max_bytes:
        return value
    n = len(value.encode("utf-8", "surrogatepass"))
    if n < min_bytes:
        raise validation(
            field, "must not be empty" if min_bytes == 1 else f"must be at least {min_bytes} bytes"
        )
    if n > max_bytes:
        raise validation(field, f"must be at most {max_bytes} bytes (got {n})")
    if _has_control(value):
        raise validation(field, "must not contain control characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise validation(field, "must be valid UTF-8") from None
    return value


def run_id(value: str, field: str = "run_id") -> str:
    return text(field, value, MAX_RUN_ID_BYTES)


def owner(value: str, field: str = "owner") -> str:
    return text(field, value, MAX_OWNER_BYTES)


def stream_name(value: str, field: str) -> str:
    """A KeepAlive stream's name (KeepAliveHello.stream_name, AcquireRequest.track_on)."""
    return text(field, value, MAX_STREAM_NAME_BYTES, min_bytes=0)


def request_id(value: str) -> str:
    if value:
        text("request_id", value, MAX_REQUEST_ID_BYTES)
    return value


def int_range(field: str, value: int, lo: int, hi: int = MAX_INT64) -> int:
    if not lo <= value <= hi:
        raise validation(field, f"must be between {lo} and {hi} (got {value})")
    return value


def ttl(value: int, field: str = "lease_ttl_ms") -> int:
    return int_range(field, value, L.MIN_TTL_MS, L.MAX_TTL_MS)


def fencing_token(value: int, field: str = "fencing_token") -> int:
    """A token naming one the server issued: 1..MAX_SAFE (none is ever larger)."""
    return int_range(field, value, 1, MAX_SAFE)


def counter(field: str, value: int) -> int:
    """A version, attempt or token a client writes (the raw seam): 1..2^53 - 2,
    so the server's next increment stays within what every client represents."""
    if not 1 <= value <= MAX_COUNTER_IN:
        raise validation(
            field,
            f"must be between 1 and {MAX_COUNTER_IN} (got {value}): the server moves it by "
            f"one, and {MAX_SAFE} (2^53 - 1) is the largest integer every client can "
            "represent exactly",
        )
    return value


def time_ms(field: str, value: int, lo: int = 0) -> int:
    """A time a client writes: lo..9999-12-31T23:59:59.999Z (a Timestamp's range)."""
    return int_range(field, value, lo, MAX_TIME_MS)


def approval_ids(ids: tuple[str, ...], field: str = "pending_approval_ids") -> tuple[str, ...]:
    if len(ids) > MAX_APPROVAL_IDS:
        raise validation(field, f"at most {MAX_APPROVAL_IDS} ids (got {len(ids)})")
    for i, v in enumerate(ids):
        text(f"{field}[{i}]", v, MAX_APPROVAL_ID_BYTES)
    return ids


def record(rec: Record, prefix: str = "run") -> Record:
    """A well-formed record for the raw seam (field names prefixed, e.g. run.version)."""
    p = prefix + "."
    if rec.schema != 1:
        raise validation(p + "schema", "must be 1")
    run_id(rec.run_id, p + "run_id")
    counter(p + "version", rec.version)
    if not isinstance(rec.status, Status):
        raise validation(p + "status", "must be a known status")
    counter(p + "attempt", rec.attempt)
    counter(p + "fencing_token", rec.fencing_token)
    time_ms(p + "created_at", rec.created_at)
    time_ms(p + "updated_at", rec.updated_at, rec.created_at)
    if rec.lease is not None:
        owner(rec.lease.owner, p + "lease.owner")
        time_ms(p + "lease.acquired_at", rec.lease.acquired_at)
        time_ms(p + "lease.expires_at", rec.lease.expires_at, rec.lease.acquired_at)
        int_range(p + "lease.ttl_ms", rec.lease.ttl_ms, 0, L.MAX_TTL_MS)
        int_range(p + "lease.lock_delay_ms", rec.lease.lock_delay_ms, 0, MAX_LOCK_DELAY_MS)
    if rec.checkpoint_ref is not None:
        text(p + "checkpoint_ref.key", rec.checkpoint_ref.key, MAX_KEY_BYTES)
        int_range(p + "checkpoint_ref.snapshot_version", rec.checkpoint_ref.snapshot_version, 0)
        time_ms(p + "checkpoint_ref.saved_at", rec.checkpoint_ref.saved_at)
    if rec.outcome is not None:
        text(p + "outcome.code", rec.outcome.code, MAX_CODE_BYTES)
        if rec.outcome.message is not None:
            text(p + "outcome.message", rec.outcome.message, MAX_MESSAGE_BYTES, min_bytes=0)
    if rec.suspension is not None:
        time_ms(p + "suspension.suspended_at", rec.suspension.suspended_at)
        approval_ids(rec.suspension.pending_approval_ids, p + "suspension.pending_approval_ids")
    return rec


def command(cmd: L.Command) -> L.Command:
    """Check every field of a command; returns it unchanged or raises."""
    if cmd.request_id:
        request_id(cmd.request_id)
    _CHECKS[type(cmd)](cmd)
    return cmd


def _fenced(cmd: L.Renew | L.RecordCheckpoint | L.Suspend | L.Finish | L.Release) -> None:
    run_id(cmd.run_id)
    owner(cmd.owner)
    fencing_token(cmd.fencing_token)


def _acquire(cmd: L.Acquire) -> None:
    run_id(cmd.run_id)
    owner(cmd.owner)
    ttl(cmd.ttl_ms)
    int_range("lock_delay_ms", cmd.lock_delay_ms, 0, MAX_LOCK_DELAY_MS)


def _renew(cmd: L.Renew) -> None:
    _fenced(cmd)
    if cmd.ttl_ms is not None:
        ttl(cmd.ttl_ms)


def _record_checkpoint(cmd: L.RecordCheckpoint) -> None:
    _fenced(cmd)
    text("key", cmd.key, MAX_KEY_BYTES)
    int_range("snapshot_version", cmd.snapshot_version, 0)


def _suspend(cmd: L.Suspend) -> None:
    _fenced(cmd)
    approval_ids(cmd.pending_approval_ids)


def _finish(cmd: L.Finish) -> None:
    _fenced(cmd)
    if cmd.status not in (Status.COMPLETED, Status.FAILED, Status.CANCELLED):
        raise validation("status", "must be COMPLETED, FAILED or CANCELLED")
    if cmd.outcome is not None:
        text("outcome.code", cmd.outcome.code, MAX_CODE_BYTES)
        if cmd.outcome.message is not None:
            text("outcome.message", cmd.outcome.message, MAX_MESSAGE_BYTES, min_bytes=0)
    elif cmd.status is Status.FAILED:
        raise validation("outcome", "is required when status is FAILED")


def _cancel(cmd: L.Cancel) -> None:
    run_id(cmd.run_id)
    if cmd.message is not None:
        text("message", cmd.message, MAX_MESSAGE_BYTES, min_bytes=0)


def _run_id_only(cmd: L.RequestResume | L.DeleteRun | L.RawDelete) -> None:
    run_id(cmd.run_id)


def _raw_create(cmd: L.RawCreate) -> None:
    record(cmd.record, "run")
    if cmd.record.version != 1:
        raise validation("run.version", "must be 1 on create")


def _raw_cas(cmd: L.RawCompareAndSet) -> None:
    run_id(cmd.run_id)
    counter("expected_version", cmd.expected_version)
    record(cmd.next, "next")
    if cmd.next.run_id != cmd.run_id:
        raise validation("next.run_id", "must equal run_id")
    if cmd.next.version != cmd.expected_version + 1:
        raise validation("next.version", "must be expected_version + 1")


# One check per command type (a dict lookup, not a chain of isinstance tests).
_CHECKS: dict[type, Callable[[Any], None]] = {
    L.Acquire: _acquire,
    L.Renew: _renew,
    L.RecordCheckpoint: _record_checkpoint,
    L.Suspend: _suspend,
    L.Finish: _finish,
    L.Release: _fenced,
    L.Cancel: _cancel,
    L.RequestResume: _run_id_only,
    L.DeleteRun: _run_id_only,
    L.RawDelete: _run_id_only,
    L.RawCreate: _raw_create,
    L.RawCompareAndSet: _raw_cas,
}


def fence(run_id: str, token: int, lock_key: str, prefix: str = "fence") -> Fence:
    """A validated fence (RUN_VALIDATION_ERROR naming ``prefix.<field>``)."""
    if bool(run_id) == bool(lock_key):
        raise validation(f"{prefix}.run_id", "set exactly one of run_id and lock_key")
    if run_id:
        text(f"{prefix}.run_id", run_id, MAX_RUN_ID_BYTES)
    else:
        text(f"{prefix}.lock_key", lock_key, MAX_KEY_BYTES)
    fencing_token(token, f"{prefix}.fencing_token")
    return Fence(token, run_id, lock_key)
