"""Pure decisions for the engine store (docs/SPEC.md §11), and its input rules.

Eight parts — runs (with claims), steps, checkpoints, idempotency keys,
locks, effects, state (key/value and documents), artifacts. For every
mutation there is a command (a frozen dataclass the writer queues) and a
``decide_*`` function that takes the current rows as plain values plus the
writer's ``now`` and returns what to write and the caller's answer, or raises
``LedgerError``. The executors in ``storage/engine_sql.py`` read the rows,
call these, and write. No I/O, no clock reads, no asyncio/grpc/sqlite3.

JSON values are carried as their text: validated here, stored and returned
byte for byte (``None`` in a field of this module means "absent"; the text
``"null"`` is a stored JSON null).

One expiry rule (docs/SPEC.md §4): a thing granted at T with ttl D is live while
``now < T + D`` and expired at exactly ``T + D`` (``is_live``).
"""

from __future__ import annotations

import itertools
import json
import re
from dataclasses import asdict, dataclass, field
from decimal import Decimal, DecimalException
from typing import Any

from . import codec, validate
from .errors import Code, LedgerError, validation
from .fence import Fence
from .records import MAX_SAFE

MAX_ID_BYTES = 512  # run, document and artifact ids
MAX_NAME_BYTES = 256  # agents, collections, owners, step names
MAX_STATUS_BYTES = 64
MAX_KEY_BYTES = 1024  # scopes and keys (idempotency, lock, effect, kv), concurrency keys
MAX_ARTIFACT_NAME_BYTES = 1024
MAX_CONTENT_TYPE_BYTES = 256
MIN_TTL_MS = 1
MAX_TTL_MS = 365 * 24 * 60 * 60 * 1000
MAX_FILTER_VALUES = 100
# JSON values nest at most this deep (arrays and objects; the top level is 1),
# checked at write time, so no stored value is too deep for a later query.
MAX_JSON_DEPTH = 100
# A number's exponent (scientific notation) must be smaller than this in magnitude.
MAX_JSON_EXPONENT = 10**18

RUN_CLEARABLE = ("concurrency_key", "input", "output", "error", "metadata", "claim")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


def is_live(expires_at: int, now: int) -> bool:
    """docs/SPEC.md §4: live while now < T + D, expired at exactly T + D."""
    return now < expires_at


# -- input rules ----------------------------------------------------------------------


def ident(field: str, value: str, max_bytes: int = MAX_ID_BYTES) -> str:
    return validate.text(field, value, max_bytes)


def optional_text(field: str, value: str, max_bytes: int) -> str:
    """A string that may be empty (0..max bytes, no control characters)."""
    return validate.text(field, value, max_bytes, min_bytes=0)


def ttl(value: int, field: str = "ttl_ms") -> int:
    if value < MIN_TTL_MS:
        raise validation(field, f"must be at least {MIN_TTL_MS} ms (got {value})")
    if value > MAX_TTL_MS:
        raise validation(field, f"must be at most {MAX_TTL_MS} ms (got {value})")
    return value


def non_negative(field: str, value: int) -> int:
    return validate.int_range(field, value, 0)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


# Python refuses to turn more than 4300 digits into an int (CVE-2020-10735's
# limit, sys.get_int_max_str_digits); Decimal parses any length exactly and
# compares equal to the int it denotes, so longer integers are read as one.
_INT_DIGITS = 4000


def _exact_int(text: str) -> int | Decimal:
    return int(text) if len(text) <= _INT_DIGITS else Decimal(text)


class _NumberOutOfRange(ValueError):
    pass


def _exact_decimal(text: str) -> Decimal:
    try:
        d = Decimal(text)
    except DecimalException:  # an exponent past what Decimal holds
        d = Decimal("Infinity")
    if not d.is_finite() or abs(d.adjusted()) >= MAX_JSON_EXPONENT:
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise _NumberOutOfRange(
            f"the number {shown} has an exponent of 10^18 or more in magnitude")
    return d


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_DEPTH_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def json_depth(text: str) -> int:
    """How deep a valid JSON text's arrays and objects nest (0: a scalar),
    read from the text (its strings left out) rather than a walk of the value."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    return max(itertools.accumulate(map(_DEPTH_STEP.__getitem__, brackets)), default=0)


def parse_json(field: str, text: str) -> Any:
    """Parse a JSON text exactly (integers of any size, decimals as Decimal);
    RUN_VALIDATION_ERROR naming ``field`` when it is not RFC 8259 JSON, nests
    deeper than MAX_JSON_DEPTH, or holds a number with a huge exponent."""
    try:
        value = json.loads(text, parse_float=_exact_decimal, parse_int=_exact_int,
                           parse_constant=_no_constants)
    except RecursionError:
        raise validation(field, f"nests deeper than {MAX_JSON_DEPTH} arrays and objects") from None
    except _NumberOutOfRange as exc:
        raise validation(field, str(exc)) from None
    except ValueError as exc:  # JSONDecodeError, NaN/Infinity, a huge exponent
        raise validation(field, f"is not valid JSON ({exc})") from None
    if text.count("[") + text.count("{") > MAX_JSON_DEPTH and json_depth(text) > MAX_JSON_DEPTH:
        raise validation(field, f"nests deeper than {MAX_JSON_DEPTH} arrays and objects")
    return value


def json_text(field: str, text: str) -> str:
    """A valid JSON text, returned unchanged (it is stored byte for byte)."""
    parse_json(field, text)
    return text


def json_object(field: str, text: str) -> str:
    if not isinstance(parse_json(field, text), dict):
        raise validation(field, "must be a JSON object")
    return text


def _is_operator_object(value: Any) -> bool:
    return isinstance(value, dict) and bool(value) and all(k.startswith("$") for k in value)


def parse_where(text: str | None, field: str = "where") -> dict[str, Any]:
    """DocList's filter: a JSON object of top-level field -> value. Anything
    that asks for more than top-level equality is refused rather than
    silently read as equality: a dotted path, an operator name ("$or"), or
    an operator object value ({"$gt": 1})."""
    if text is None:
        return {}
    where = parse_json(field, text)
    if not isinstance(where, dict):
        raise validation(field, "must be a JSON object of top-level field -> value")
    for name, value in where.items():
        if name.startswith("$") or "." in name:
            raise validation(
                f"{field}.{name}",
                "unknown field: only top-level field names are supported (no paths, no operators)",
            )
        if _is_operator_object(value):
            raise validation(
                f"{field}.{name}", "operators are not supported: `where` matches by equality"
            )
    return where


def json_equal(a: Any, b: Any) -> bool:
    """JSON equality: same type and value. Numbers compare by value (1 == 1.0)
    but never equal booleans; objects and arrays compare deeply."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, int | Decimal) and isinstance(b, int | Decimal):
        return a == b
    if isinstance(a, str) and isinstance(b, str):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    return False


def doc_matches(doc_text: str, where: dict[str, Any]) -> bool:
    """Whether a stored document's top-level fields equal every field of where."""
    if not where:
        return True
    try:
        doc = json.loads(doc_text, parse_float=Decimal, parse_int=_exact_int)
        if not isinstance(doc, dict):
            return False
        return all(k in doc and json_equal(doc[k], v) for k, v in where.items())
    except RecursionError:  # stored before MAX_JSON_DEPTH was checked: too deep to compare
        return False


def sha256_hex(field: str, value: str) -> str:
    if not _SHA256.fullmatch(value):
        raise validation(field, "must be 64 hexadecimal characters")
    return value.lower()


# -- rows (plain values; JSON fields hold text, None = absent) -------------------------


@dataclass(frozen=True, slots=True)
class Claim:
    owner: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class Run:
    id: str
    agent: str
    status: str
    concurrency_key: str | None
    input: str | None
    output: str | None
    error: str | None
    metadata: str | None
    claim: Claim | None
    created_at: int
    updated_at: int


@dataclass(frozen=True, slots=True)
class Step:
    run_id: str
    seq: int
    name: str
    status: str | None
    input: str | None
    output: str | None
    error: str | None
    metadata: str | None
    created_at: int


@dataclass(frozen=True, slots=True)
class Checkpoint:
    run_id: str
    step_index: int
    state: str
    saved_at: int


@dataclass(frozen=True, slots=True)
class KeyHold:
    scope: str
    key: str
    run_id: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class Lock:
    key: str
    owner: str | None  # None: free (released); the token is kept
    fencing_token: int
    expires_at: int


@dataclass(frozen=True, slots=True)
class Doc:
    id: str
    doc: str
    updated_at: int


@dataclass(frozen=True, slots=True)
class Artifact:
    id: str
    run_id: str
    name: str
    content_type: str
    size_bytes: int
    sha256: str
    metadata: str | None
    created_at: int


# -- commands (frozen; `request_id` for docs/SPEC.md §5.5) --------------------------------------


@dataclass(frozen=True, slots=True)
class CreateRun:
    id: str
    agent: str
    status: str
    concurrency_key: str | None = None
    input: str | None = None
    output: str | None = None
    error: str | None = None
    metadata: str | None = None
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class RunPatch:
    status: str | None = None
    concurrency_key: str | None = None
    input: str | None = None
    output: str | None = None
    error: str | None = None
    metadata: str | None = None
    clear: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class UpdateRun:
    id: str
    patch: RunPatch
    expect_status: tuple[str, ...] = ()
    expect_owner: str | None = None
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class ClaimRun:
    id: str
    owner: str
    ttl_ms: int
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class RenewClaim:
    id: str
    owner: str
    ttl_ms: int
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class AppendStep:
    run_id: str
    name: str
    status: str | None = None
    input: str | None = None
    output: str | None = None
    error: str | None = None
    metadata: str | None = None
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class SaveCheckpoint:
    run_id: str
    step_index: int
    state: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class ClaimKey:
    scope: str
    key: str
    run_id: str
    ttl_ms: int
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class AcquireLock:
    key: str
    owner: str
    ttl_ms: int
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class ReleaseLock:
    key: str
    owner: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class PutEffect:
    key: str
    result: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class KvSet:
    agent: str
    key: str
    value: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class DocUpsert:
    agent: str
    collection: str
    id: str
    doc: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class DocDelete:
    agent: str
    collection: str
    id: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class StageChunk:
    """One chunk of an upload in progress, stored under its upload id."""

    upload_id: str
    seq: int
    data: bytes = field(repr=False)
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class CommitArtifact:
    """The end of a PutArtifact stream: insert the metadata pointing at the
    staged upload when the id is free, else drop the upload. The upload id and
    the chunking are not part of the request's identity (``repr=False``, so
    the request-id fingerprint ignores them): a retry stages its bytes under a
    new upload id and must still be recognised as the same request."""

    id: str
    run_id: str
    name: str
    content_type: str
    size_bytes: int
    sha256: str  # computed by the server from the bytes received
    metadata: str | None
    upload_id: str = field(default="", repr=False, compare=False)
    staged_bytes: int = field(default=0, repr=False, compare=False)
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class DeleteArtifact:
    """Delete an artifact's metadata and the chunks of its upload."""

    id: str
    request_id: str = ""
    fence: Fence | None = None


@dataclass(frozen=True, slots=True)
class DiscardUpload:
    """Delete a staged upload that will not become an artifact."""

    upload_id: str
    request_id: str = ""


@dataclass(frozen=True, slots=True)
class SweepUploads:
    """At start-up: delete every staged upload left by a stream that never
    finished (a crash or a stop mid-upload). ``abandoned_only`` (coordinators
    leading shards apart share the uploads): only those staged by a
    coordinator no longer taking part."""

    abandoned_only: bool = False
    request_id: str = ""


# -- results --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunCreated:
    created: bool
    run: Run


@dataclass(frozen=True, slots=True)
class RunClaimed:
    ok: bool
    run: Run | None


@dataclass(frozen=True, slots=True)
class CheckpointSaved:
    saved: bool
    checkpoint: Checkpoint


@dataclass(frozen=True, slots=True)
class KeyClaimed:
    created: bool
    run_id: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class LockAnswer:
    acquired: bool
    fencing_token: int
    owner: str
    expires_at: int


@dataclass(frozen=True, slots=True)
class Done:
    """A yes/no answer (ReleaseLock, DocDelete, DeleteArtifact) or a write time (PutEffect,
    KvSet; ``ok`` True)."""

    ok: bool
    at: int = 0


@dataclass(frozen=True, slots=True)
class DocUpserted:
    created: bool
    doc: Doc


@dataclass(frozen=True, slots=True)
class ArtifactCommitted:
    created: bool
    artifact: Artifact
    upload_id: str  # the upload the stored artifact points at


@dataclass(frozen=True, slots=True)
class Staged:
    upload_id: str
    seq: int
    size: int


# -- decisions: runs --------------------------------------------------------------------


def decide_create_run(
    existing: Run | None, cmd: CreateRun, now: int
) -> tuple[Run | None, RunCreated]:
    """Insert-if-absent: an existing run is kept unchanged."""
    if existing is not None:
        return None, RunCreated(False, existing)
    run = Run(
        id=cmd.id,
        agent=cmd.agent,
        status=cmd.status,
        concurrency_key=cmd.concurrency_key,
        input=cmd.input,
        output=cmd.output,
        error=cmd.error,
        metadata=cmd.metadata,
        claim=None,
        created_at=now,
        updated_at=now,
    )
    return run, RunCreated(True, run)


def decide_update_run(current: Run | None, cmd: UpdateRun, now: int) -> Run:
    """The guards, then the patch. Expiry of the claim is not checked."""
    if current is None:
        raise LedgerError(Code.RUN_NOT_FOUND, f"run {cmd.id!r} not found", field="id")
    if cmd.expect_status and current.status not in cmd.expect_status:
        raise LedgerError(
            Code.INVALID_RUN_STATE,
            f"run {cmd.id!r} is {current.status!r}, expected one of {list(cmd.expect_status)}",
            field="expect_status",
        )
    if cmd.expect_owner is not None:
        if current.claim is None:
            raise LedgerError(
                Code.INVALID_RUN_STATE,
                f"run {cmd.id!r} is not claimed, expected owner {cmd.expect_owner!r}",
                field="expect_owner",
            )
        if current.claim.owner != cmd.expect_owner:
            raise LedgerError(
                Code.INVALID_RUN_STATE,
                f"run {cmd.id!r} is claimed by {current.claim.owner!r}, expected "
                f"{cmd.expect_owner!r}",
                field="expect_owner",
            )
    p = cmd.patch
    cleared = set(p.clear)

    def pick(name: str, new: Any, old: Any) -> Any:
        if name in cleared:
            return None
        return old if new is None else new

    return Run(
        id=current.id,
        agent=current.agent,
        status=current.status if p.status is None else p.status,
        concurrency_key=pick("concurrency_key", p.concurrency_key, current.concurrency_key),
        input=pick("input", p.input, current.input),
        output=pick("output", p.output, current.output),
        error=pick("error", p.error, current.error),
        metadata=pick("metadata", p.metadata, current.metadata),
        claim=None if "claim" in cleared else current.claim,
        created_at=current.created_at,
        updated_at=now,
    )


def _with_claim(run: Run, owner: str, expires_at: int, now: int) -> Run:
    return Run(
        id=run.id,
        agent=run.agent,
        status=run.status,
        concurrency_key=run.concurrency_key,
        input=run.input,
        output=run.output,
        error=run.error,
        metadata=run.metadata,
        claim=Claim(owner, expires_at),
        created_at=run.created_at,
        updated_at=now,
    )


def decide_claim_run(current: Run | None, cmd: ClaimRun, now: int) -> tuple[Run | None, RunClaimed]:
    """Succeeds only when unclaimed or the claim expired (docs/SPEC.md §11, §4)."""
    if current is None:
        return None, RunClaimed(False, None)
    if current.claim is not None and is_live(current.claim.expires_at, now):
        return None, RunClaimed(False, current)
    run = _with_claim(current, cmd.owner, now + cmd.ttl_ms, now)
    return run, RunClaimed(True, run)


def decide_renew_claim(
    current: Run | None, cmd: RenewClaim, now: int
) -> tuple[Run | None, RunClaimed]:
    """Only the current, unexpired owner may renew."""
    if current is None:
        return None, RunClaimed(False, None)
    claim = current.claim
    if claim is None or claim.owner != cmd.owner or not is_live(claim.expires_at, now):
        return None, RunClaimed(False, current)
    run = _with_claim(current, cmd.owner, now + cmd.ttl_ms, now)
    return run, RunClaimed(True, run)


# -- decisions: steps and checkpoints -----------------------------------------------------


def decide_append_step(last_seq: int, cmd: AppendStep, now: int) -> Step:
    """Append-only: the next position in the run's log."""
    if last_seq >= MAX_SAFE:
        raise validation("step.seq", f"run {cmd.run_id!r} has no step position left below 2^53")
    return Step(
        run_id=cmd.run_id,
        seq=last_seq + 1,
        name=cmd.name,
        status=cmd.status,
        input=cmd.input,
        output=cmd.output,
        error=cmd.error,
        metadata=cmd.metadata,
        created_at=now,
    )


def decide_save_checkpoint(
    current: Checkpoint | None, cmd: SaveCheckpoint, now: int
) -> tuple[Checkpoint | None, CheckpointSaved]:
    """Keep the highest step index; an equal one replaces; a lower one is ignored."""
    if current is not None and cmd.step_index < current.step_index:
        return None, CheckpointSaved(False, current)
    cp = Checkpoint(cmd.run_id, cmd.step_index, cmd.state, now)
    return cp, CheckpointSaved(True, cp)


# -- decisions: idempotency keys and locks --------------------------------------------------


def decide_claim_key(
    current: KeyHold | None, cmd: ClaimKey, now: int
) -> tuple[KeyHold | None, KeyClaimed]:
    """The first caller per (scope, key) wins until the key expires."""
    if current is not None and is_live(current.expires_at, now):
        return None, KeyClaimed(False, current.run_id, current.expires_at)
    hold = KeyHold(cmd.scope, cmd.key, cmd.run_id, now + cmd.ttl_ms)
    return hold, KeyClaimed(True, hold.run_id, hold.expires_at)


def decide_acquire_lock(
    current: Lock | None, cmd: AcquireLock, now: int
) -> tuple[Lock | None, LockAnswer]:
    """Free (never held, released, expired) or held by the caller: granted.
    Extending one's own live lock keeps the token; every other grant moves
    it, so the token increases whenever the holder changes."""
    held = current is not None and current.owner is not None and is_live(current.expires_at, now)
    if held:
        assert current is not None and current.owner is not None
        if current.owner != cmd.owner:
            return None, LockAnswer(False, current.fencing_token, current.owner, current.expires_at)
        lock = Lock(cmd.key, cmd.owner, current.fencing_token, now + cmd.ttl_ms)
    else:
        token = (current.fencing_token if current is not None else 0) + 1
        if token > MAX_SAFE:
            raise validation(
                "key", f"lock {cmd.key!r} is at token {token - 1}: it cannot move past 2^53 - 1")
        lock = Lock(cmd.key, cmd.owner, token, now + cmd.ttl_ms)
    return lock, LockAnswer(True, lock.fencing_token, cmd.owner, lock.expires_at)


def decide_release_lock(
    current: Lock | None, cmd: ReleaseLock, now: int
) -> tuple[Lock | None, Done]:
    """Only the holder releases (also after expiry, while nobody took it over);
    the key keeps its token so the next holder's is higher."""
    if current is None or current.owner != cmd.owner:
        return None, Done(False)
    return Lock(cmd.key, None, current.fencing_token, now), Done(True)


def check_lock_fence(fence: Fence, current: Lock | None) -> None:
    """A lock fence holds while the lock is held (live or expired, not taken
    over nor released) under the fence's token: a new grant moves the token
    and a release clears the owner, and either refuses the write (LOCK_LOST;
    RUN_NOT_FOUND naming ``fence.lock_key`` for a lock never acquired)."""
    if current is None:
        raise LedgerError(
            Code.RUN_NOT_FOUND,
            f"fence.lock_key: lock {fence.lock_key!r} was never acquired",
            field="fence.lock_key",
        )
    if current.fencing_token != fence.fencing_token or current.owner is None:
        held = f"held by {current.owner!r}" if current.owner is not None else "released"
        raise LedgerError(
            Code.LOCK_LOST,
            f"fence: lock {fence.lock_key!r} is at token {current.fencing_token} ({held}); "
            f"token {fence.fencing_token} no longer fences writes",
            metadata={
                "lock_key": current.key,
                "fencing_token": str(current.fencing_token),
                "owner": current.owner or "",
            },
        )


# -- decisions: state --------------------------------------------------------------------


def decide_doc_upsert(existing: Doc | None, cmd: DocUpsert, now: int) -> tuple[Doc, DocUpserted]:
    doc = Doc(cmd.id, cmd.doc, now)
    return doc, DocUpserted(existing is None, doc)


# -- decisions: artifacts ------------------------------------------------------------------


def decide_commit_artifact(
    existing: Artifact | None, cmd: CommitArtifact, staged_bytes: int, now: int
) -> tuple[Artifact | None, ArtifactCommitted]:
    """Insert-if-absent: an existing artifact keeps its metadata and bytes (the
    caller drops the upload). The staged upload must hold exactly the bytes
    the header declared."""
    if existing is not None:
        return None, ArtifactCommitted(False, existing, "")
    if staged_bytes != cmd.size_bytes:
        raise validation(
            "header.size_bytes",
            f"declared {cmd.size_bytes} bytes but {staged_bytes} were stored",
        )
    art = Artifact(
        id=cmd.id,
        run_id=cmd.run_id,
        name=cmd.name,
        content_type=cmd.content_type,
        size_bytes=cmd.size_bytes,
        sha256=cmd.sha256,
        metadata=cmd.metadata,
        created_at=now,
    )
    return art, ArtifactCommitted(True, art, cmd.upload_id)


# -- request-id cache codecs (docs/SPEC.md §5.5) -------------------------------------------


def _claimed(d: dict[str, Any]) -> dict[str, Any]:
    claim = d["claim"]
    return {**d, "claim": Claim(**claim) if claim is not None else None}


def _run_from(d: dict[str, Any] | None) -> Run | None:
    return None if d is None else Run(**_claimed(d))


def _reg(name: str, cls: type, from_dict: Any) -> None:
    codec.register(f"engine.{name}", cls, asdict, from_dict)


_reg("run", Run, _run_from)
_reg("run_created", RunCreated, lambda d: RunCreated(d["created"], Run(**_claimed(d["run"]))))
_reg("run_claimed", RunClaimed, lambda d: RunClaimed(d["ok"], _run_from(d["run"])))
_reg("step", Step, lambda d: Step(**d))
_reg(
    "checkpoint_saved",
    CheckpointSaved,
    lambda d: CheckpointSaved(d["saved"], Checkpoint(**d["checkpoint"])),
)
_reg("key_claimed", KeyClaimed, lambda d: KeyClaimed(**d))
_reg("lock", LockAnswer, lambda d: LockAnswer(**d))
_reg("done", Done, lambda d: Done(**d))
_reg("doc_upserted", DocUpserted, lambda d: DocUpserted(d["created"], Doc(**d["doc"])))
_reg(
    "artifact_committed",
    ArtifactCommitted,
    lambda d: ArtifactCommitted(d["created"], Artifact(**d["artifact"]), d["upload_id"]),
)
_reg("staged", Staged, lambda d: Staged(**d))
