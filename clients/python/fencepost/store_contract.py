"""A reusable contract suite for any ``fencepost.v1.EngineStore`` endpoint.

It checks an endpoint, over the wire with the generated stubs, against every
rule of docs/SPEC.md §11 (the engine store) and the expiry rule of docs/SPEC.md §4. Run it
against fencepost behind a proxy, a new storage backend, or another
implementation of the API. Each test works in a namespace of its own (fresh
ids, agents, scopes and keys), so a shared deployment is fine.

Import the tests and provide the fixtures, in a test module of your own::

    import pytest
    from fencepost.store_contract import *  # noqa: F403

    @pytest.fixture(scope="module")
    def store_endpoint() -> str:
        return "127.0.0.1:50051"

    # Optional: move the server's clock forward by ``ms`` (a test clock).
    @pytest.fixture
    def advance_clock():
        return my_server.clock.advance

Fixtures you may provide:

``store_endpoint`` (required)
    The ``host:port`` of the endpoint.
``advance_clock`` (optional)
    A callable ``advance(ms)`` that moves the server's clock forward by ``ms``
    milliseconds, or None. With it, the expiry tests check the exact instant
    (a claim, key or lock granted at T with ttl D is live at T + D - 1 ms and
    taken over at exactly T + D). Without it, those tests are skipped with a
    reason, and the other expiry tests wait in real time with short ttls.
    The server's clock must not move by itself while a test runs when this
    hook is given (fencepost's ``ManualClock``).
``store_real_time_ttl_ms`` (optional)
    The ttl of the real-time expiry tests (default 1000 ms): each test
    assumes its calls reach the server well within it.
``store_channel_credentials`` (optional)
    ``grpc.ChannelCredentials`` for a TLS endpoint; absent: plaintext.

The suite needs the endpoint to be writable and keeps what it writes.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from .v1 import engine_store_pb2 as pb
from .v1 import engine_store_pb2_grpc

__all__ = [
    "engine_store",
    "store_clock",
    "store_ns",
    "test_artifact_bad_streams_store_nothing",
    "test_artifact_bytes_are_exact_and_listed_like_runs",
    "test_artifact_delete_frees_the_id_and_is_idempotent",
    "test_artifact_insert_if_absent_keeps_metadata_and_bytes",
    "test_artifact_unknown_ids",
    "test_bad_input_is_invalid_argument_and_stores_nothing",
    "test_checkpoints_keep_the_highest_step_index",
    "test_claim_run_only_when_unclaimed_or_expired",
    "test_claim_run_takeover_after_ttl",
    "test_claims_keys_and_locks_expire_at_exactly_t_plus_ttl",
    "test_create_run_is_insert_if_absent",
    "test_doc_list_orders_by_id_and_filters_by_top_level_equality",
    "test_doc_list_refuses_where_it_cannot_honour",
    "test_effects_a_recorded_null_is_found",
    "test_idempotency_first_caller_wins_until_expiry",
    "test_idempotency_takeover_after_ttl",
    "test_integers_longer_than_pythons_conversion_limit_are_stored_exactly",
    "test_json_values_round_trip_exactly",
    "test_kv_state_null_is_distinct_from_absent",
    "test_list_runs_filters",
    "test_list_runs_order_total_limit_offset",
    "test_list_runs_without_limit_returns_every_match_across_pages",
    "test_lock_takeover_after_ttl",
    "test_locks_one_holder_and_fencing_tokens_increase",
    "test_renew_claim_only_for_the_live_owner",
    "test_request_ids_replay_the_original_answer",
    "test_steps_are_append_only_in_order",
    "test_update_run_guards",
    "test_update_run_patch_and_clear",
]

INVALID = grpc.StatusCode.INVALID_ARGUMENT
REAL_TIME_TTL_MS = 1000  # default ttl of the expiry tests without a test clock


# -- fixtures -------------------------------------------------------------------------------


def _optional_fixture(request: pytest.FixtureRequest, name: str) -> Any:
    try:
        return request.getfixturevalue(name)
    except pytest.FixtureLookupError:
        return None


@pytest.fixture
def engine_store(
    request: pytest.FixtureRequest, store_endpoint: str
) -> Iterator[engine_store_pb2_grpc.EngineStoreStub]:
    """A generated EngineStore stub on a fresh channel to ``store_endpoint``."""
    creds = _optional_fixture(request, "store_channel_credentials")
    channel = (
        grpc.secure_channel(store_endpoint, creds)
        if creds is not None
        else grpc.insecure_channel(store_endpoint)
    )
    with channel:
        yield engine_store_pb2_grpc.EngineStoreStub(channel)


@dataclass
class StoreClock:
    """The server's clock as the suite drives it: a test hook, or real time."""

    hook: Callable[[int], Any] | None
    real_time_ttl_ms: int = REAL_TIME_TTL_MS

    @property
    def manual(self) -> bool:
        return self.hook is not None

    def ttl(self, manual_ms: int = 1000) -> int:
        """A ttl for expiry tests: exact with a test clock, short in real time."""
        return manual_ms if self.manual else self.real_time_ttl_ms

    def advance(self, ms: int) -> None:
        """Move the server's time forward by ``ms`` (or wait that long)."""
        if self.hook is not None:
            self.hook(ms)
        else:
            time.sleep(ms / 1000 + 0.02)

    def tick(self) -> None:
        """Make sure the next write gets a later timestamp than the last one."""
        self.advance(1) if self.manual else time.sleep(0.003)

    def require_manual(self) -> None:
        if not self.manual:
            pytest.skip(
                "needs a test clock: provide an `advance_clock` fixture that moves the "
                "server's clock (the exact instant of expiry cannot be hit in real time)"
            )


@pytest.fixture
def store_clock(request: pytest.FixtureRequest) -> StoreClock:
    ttl = _optional_fixture(request, "store_real_time_ttl_ms")
    return StoreClock(_optional_fixture(request, "advance_clock"), ttl or REAL_TIME_TTL_MS)


@pytest.fixture
def store_ns() -> str:
    """A namespace of this test's own (prefix for ids, agents, keys)."""
    return f"ct-{uuid.uuid4().hex[:12]}"


# -- helpers --------------------------------------------------------------------------------


def J(value: Any) -> pb.JsonValue:
    """A JsonValue holding ``value`` as JSON text (compact, Unicode kept)."""
    return pb.JsonValue(json=json.dumps(value, ensure_ascii=False, separators=(",", ":")))


def _exact(text: str) -> Any:
    return json.loads(text, parse_float=Decimal)


def json_equal(a: Any, b: Any) -> bool:
    """Strict JSON equality (true is not 1; integers compared exactly)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(json_equal(x, y) for x, y in zip(a, b, strict=True))
    if a is None or b is None:
        return a is b
    if isinstance(a, int | Decimal) and isinstance(b, int | Decimal):
        return a == b
    return type(a) is type(b) and a == b


def same_json(msg: pb.JsonValue, value: Any) -> bool:
    return json_equal(_exact(msg.json), _exact(json.dumps(value)))


@dataclass
class WireError:
    code: grpc.StatusCode
    reason: str
    field: str
    message: str


def wire_error(err: grpc.RpcError) -> WireError:
    reason, field = "", ""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
                info = error_details_pb2.ErrorInfo()
                detail.Unpack(info)
                reason, field = info.reason, info.metadata.get("field", "")
    return WireError(err.code(), reason, field, err.details() or "")  # type: ignore[attr-defined]


def expect_error(
    call: Callable[[], Any],
    code: grpc.StatusCode,
    reason: str,
    field: str | None = None,
) -> WireError:
    with pytest.raises(grpc.RpcError) as ei:
        call()
    e = wire_error(ei.value)
    assert (e.code, e.reason) == (code, reason), e
    if field is not None:
        assert field in e.field or field in e.message, f"{field!r} not named: {e}"
    return e


def invalid(call: Callable[[], Any], field: str | None = None) -> WireError:
    return expect_error(call, INVALID, "RUN_VALIDATION_ERROR", field)


def invalid_call(field: str | None, fn: Callable[..., Any], *args: Any) -> WireError:
    """``invalid`` for ``fn(*args)`` (binds the arguments now, e.g. in a loop)."""
    return invalid(lambda: fn(*args), field)


def _drain(rpc: Callable[[Any], Any], request: Any) -> list[Any]:
    return list(rpc(request))


def ms(ts: Any) -> int:
    return int(ts.seconds) * 1000 + int(ts.nanos) // 1_000_000


def new_run(
    store: Any, run_id: str, agent: str = "agent", status: str = "queued", **kw: Any
) -> Any:
    resp = store.CreateRun(
        pb.EngineCreateRunRequest(run=pb.EngineRun(id=run_id, agent=agent, status=status, **kw))
    )
    assert resp.created, f"{run_id} existed"
    return resp.run


def get_run(store: Any, run_id: str) -> Any:
    resp = store.GetRun(pb.EngineGetRunRequest(id=run_id))
    return resp.run if resp.found else None


def list_runs(store: Any, **kw: Any) -> tuple[list[Any], int]:
    runs: list[Any] = []
    totals = set()
    for page in store.ListRuns(pb.EngineListRunsRequest(**kw)):
        runs.extend(page.runs)
        totals.add(page.total)
    assert len(totals) == 1, f"every page carries the same total: {totals}"
    return runs, totals.pop()


def claim(store: Any, run_id: str, owner: str, ttl_ms: int) -> Any:
    return store.ClaimRun(pb.EngineClaimRunRequest(id=run_id, owner=owner, ttl_ms=ttl_ms))


def renew(store: Any, run_id: str, owner: str, ttl_ms: int) -> Any:
    return store.RenewClaim(pb.EngineRenewClaimRequest(id=run_id, owner=owner, ttl_ms=ttl_ms))


def claim_key(store: Any, scope: str, key: str, run_id: str, ttl_ms: int) -> Any:
    return store.ClaimKey(
        pb.EngineClaimKeyRequest(scope=scope, key=key, run_id=run_id, ttl_ms=ttl_ms)
    )


def acquire(store: Any, key: str, owner: str, ttl_ms: int, request_id: str = "") -> Any:
    return store.AcquireLock(
        pb.EngineAcquireLockRequest(key=key, owner=owner, ttl_ms=ttl_ms, request_id=request_id)
    )


def release(store: Any, key: str, owner: str) -> bool:
    return bool(store.ReleaseLock(pb.EngineReleaseLockRequest(key=key, owner=owner)).released)


def upload(
    store: Any,
    art_id: str,
    run_id: str,
    data: bytes,
    chunk: int = 256 * 1024,
    **header: Any,
) -> Any:
    def messages() -> Iterator[pb.EnginePutArtifactRequest]:
        yield pb.EnginePutArtifactRequest(
            header=pb.EngineArtifactHeader(
                id=art_id, run_id=run_id, size_bytes=header.pop("size_bytes", len(data)), **header
            )
        )
        for i in range(0, len(data), chunk):
            yield pb.EnginePutArtifactRequest(chunk=data[i : i + chunk])

    return store.PutArtifact(messages())


def read(store: Any, art_id: str) -> bytes:
    return b"".join(m.chunk for m in store.ReadArtifact(pb.EngineReadArtifactRequest(id=art_id)))


def get_artifact(store: Any, art_id: str) -> Any:
    resp = store.GetArtifact(pb.EngineGetArtifactRequest(id=art_id))
    return resp.artifact if resp.found else None


# -- runs -----------------------------------------------------------------------------------


def test_create_run_is_insert_if_absent(engine_store: Any, store_ns: str) -> None:
    rid = f"{store_ns}-run"
    first = new_run(engine_store, rid, agent="a1", status="queued", input=J({"v": 1}))
    assert first.id == rid and first.agent == "a1" and first.status == "queued"
    assert not first.HasField("claim") and ms(first.created_at) == ms(first.updated_at)
    again = engine_store.CreateRun(
        pb.EngineCreateRunRequest(
            run=pb.EngineRun(id=rid, agent="a2", status="running", input=J({"v": 2}))
        )
    )
    assert not again.created
    assert again.run == first, "the stored run is returned unchanged"
    assert get_run(engine_store, rid) == first
    assert get_run(engine_store, f"{store_ns}-missing") is None


def test_json_values_round_trip_exactly(engine_store: Any, store_ns: str) -> None:
    values: list[Any] = [
        {"nested": {"deeper": [1, {"x": [None, True, False]}], "empty": {}, "list": []}},
        2**53 + 1,
        -(2**63),
        2**64 + 7,
        10**40,
        [1.5, -0.25, 1e-7, 12345678.125],
        "plain",
        "héllo wörld \u2014 \u201cquotes\u201d \u2013 ünïcödé",
        "日本語のテキスト",
        "emoji 🎉👩‍👩‍👧‍👦 and flags 🇳🇿",
        "rtl مرحبا بالعالم",
        "combining e\u0301 and \u2028 separators \u2029",
        "controls \u0000 \u0001 \t \n escaped",
        None,
        True,
        0,
        {"k🔑": "v", "": "empty key"},
    ]
    for i, value in enumerate(values):
        rid = f"{store_ns}-{i}"
        run = new_run(engine_store, rid, input=J(value), output=J(value), metadata=J({"v": value}))
        stored = get_run(engine_store, rid)
        for got in (run, stored):
            assert same_json(got.input, value), (value, got.input.json)
            assert same_json(got.output, value)
            assert same_json(got.metadata, {"v": value})
        engine_store.KvSet(pb.EngineKvSetRequest(agent=store_ns, key=f"k{i}", value=J(value)))
        kv = engine_store.KvGet(pb.EngineKvGetRequest(agent=store_ns, key=f"k{i}"))
        assert kv.found and same_json(kv.value, value)
        engine_store.PutEffect(pb.EnginePutEffectRequest(key=f"{rid}-e", result=J(value)))
        eff = engine_store.GetEffect(pb.EngineGetEffectRequest(key=f"{rid}-e"))
        assert eff.found and same_json(eff.result, value)
        engine_store.DocUpsert(
            pb.EngineDocUpsertRequest(
                agent=store_ns, collection="c", id=f"d{i:02d}", doc=J({"v": value})
            )
        )
    docs = [
        d
        for page in engine_store.DocList(pb.EngineDocListRequest(agent=store_ns, collection="c"))
        for d in page.docs
    ]
    assert [d.id for d in docs] == [f"d{i:02d}" for i in range(len(values))]
    for d, value in zip(docs, values, strict=True):
        assert same_json(d.doc, {"v": value})
    # a stored null is not the same as absent
    run = new_run(engine_store, f"{store_ns}-nulls", output=J(None))
    assert run.HasField("output") and run.output.json.strip() == "null"
    assert not run.HasField("input") and not run.HasField("error")


def test_update_run_patch_and_clear(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    rid = f"{store_ns}-run"
    made = new_run(engine_store, rid, input=J({"a": 1}), metadata=J({"m": 1}), concurrency_key="ck")
    store_clock.tick()
    patch = pb.EngineRunPatch(status="running", output=J({"result": [1, 2]}), error=J(None))
    run = engine_store.UpdateRun(pb.EngineUpdateRunRequest(id=rid, patch=patch)).run
    assert run.status == "running" and same_json(run.output, {"result": [1, 2]})
    assert run.HasField("error") and same_json(run.error, None)
    assert same_json(run.input, {"a": 1}) and run.concurrency_key == "ck", "untouched fields kept"
    assert ms(run.updated_at) > ms(made.updated_at) and run.created_at == made.created_at
    assert get_run(engine_store, rid) == run
    cleared = engine_store.UpdateRun(
        pb.EngineUpdateRunRequest(
            id=rid, patch=pb.EngineRunPatch(clear=["output", "error", "concurrency_key"])
        )
    ).run
    assert not cleared.HasField("output") and not cleared.HasField("error")
    assert not cleared.HasField("concurrency_key") and same_json(cleared.metadata, {"m": 1})
    # releasing the claim through the patch
    assert claim(engine_store, rid, "w1", 60_000).claimed
    released = engine_store.UpdateRun(
        pb.EngineUpdateRunRequest(id=rid, patch=pb.EngineRunPatch(clear=["claim"]))
    ).run
    assert not released.HasField("claim")
    assert claim(engine_store, rid, "w2", 60_000).claimed


def test_update_run_guards(engine_store: Any, store_ns: str, store_clock: StoreClock) -> None:
    rid = f"{store_ns}-run"
    new_run(engine_store, rid, status="queued")
    before = get_run(engine_store, rid)

    def update(**kw: Any) -> Any:
        return engine_store.UpdateRun(
            pb.EngineUpdateRunRequest(id=rid, patch=pb.EngineRunPatch(status="running"), **kw)
        )

    expect_error(
        lambda: update(expect_status=["running", "done"]),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INVALID_RUN_STATE",
    )
    expect_error(
        lambda: update(expect_owner="w1"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INVALID_RUN_STATE",
    )  # no claim at all
    assert get_run(engine_store, rid) == before, "a failed guard changes nothing"
    assert update(expect_status=["paused", "queued"]).run.status == "running"

    ttl = store_clock.ttl()
    assert claim(engine_store, rid, "w1", ttl).claimed
    expect_error(
        lambda: update(expect_owner="w2"),
        grpc.StatusCode.FAILED_PRECONDITION,
        "INVALID_RUN_STATE",
    )
    assert update(expect_owner="w1").run.claim.owner == "w1"
    store_clock.advance(ttl)  # the claim expired, and nobody took it: expiry is not checked
    assert update(expect_owner="w1", expect_status=["running"]).run.status == "running"
    expect_error(
        lambda: engine_store.UpdateRun(
            pb.EngineUpdateRunRequest(id=f"{store_ns}-nope", patch=pb.EngineRunPatch())
        ),
        grpc.StatusCode.NOT_FOUND,
        "RUN_NOT_FOUND",
    )


def test_list_runs_order_total_limit_offset(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    agent = f"{store_ns}-agent"
    # created_at first, then id: "b" before "a" because it is older; "d"/"c"
    # share an instant when the clock is the test's
    new_run(engine_store, f"{store_ns}-b", agent=agent)
    store_clock.tick()
    new_run(engine_store, f"{store_ns}-a", agent=agent)
    store_clock.tick()
    new_run(engine_store, f"{store_ns}-d", agent=agent)
    new_run(engine_store, f"{store_ns}-c", agent=agent)
    store_clock.tick()
    new_run(engine_store, f"{store_ns}-e", agent=agent)
    runs, total = list_runs(engine_store, agent=agent)
    assert total == 5 and len(runs) == 5
    keys = [(ms(r.created_at), r.id) for r in runs]
    assert keys == sorted(keys), "ordered by created_at then id"
    ids = [r.id.removeprefix(f"{store_ns}-") for r in runs]
    assert ids[:2] == ["b", "a"] and ids[4] == "e"
    if store_clock.manual:
        assert ids == ["b", "a", "c", "d", "e"]
    page, total = list_runs(engine_store, agent=agent, limit=2, offset=1)
    assert [r.id for r in page] == [r.id for r in runs[1:3]] and total == 5
    page, total = list_runs(engine_store, agent=agent, offset=3)
    assert [r.id for r in page] == [r.id for r in runs[3:]] and total == 5
    page, total = list_runs(engine_store, agent=agent, limit=0)
    assert page == [] and total == 5
    page, total = list_runs(engine_store, agent=agent, offset=10)
    assert page == [] and total == 5


def test_list_runs_filters(engine_store: Any, store_ns: str) -> None:
    a1, a2 = f"{store_ns}-a1", f"{store_ns}-a2"
    new_run(engine_store, f"{store_ns}-1", agent=a1, status="queued", concurrency_key="k1")
    new_run(engine_store, f"{store_ns}-2", agent=a1, status="running", concurrency_key="k1")
    new_run(engine_store, f"{store_ns}-3", agent=a1, status="done")
    new_run(engine_store, f"{store_ns}-4", agent=a2, status="queued", concurrency_key="k1")

    def ids(**kw: Any) -> set[str]:
        runs, total = list_runs(engine_store, **kw)
        assert total == len(runs)
        return {r.id.removeprefix(f"{store_ns}-") for r in runs}

    assert ids(agent=a1) == {"1", "2", "3"}
    assert ids(agent=a1, statuses=["queued", "running"]) == {"1", "2"}
    assert ids(agent=a1, statuses=["done"]) == {"3"}
    assert ids(agent=a2, concurrency_key="k1") == {"4"}
    assert ids(agent=a1, concurrency_key="k1", statuses=["running"]) == {"2"}
    assert ids(agent=a1, concurrency_key="nope") == set()


def test_list_runs_without_limit_returns_every_match_across_pages(
    engine_store: Any, store_ns: str
) -> None:
    agent = f"{store_ns}-many"
    n = 2_100  # more than two pages of 1000
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(
            pool.map(lambda i: new_run(engine_store, f"{store_ns}-{i:05d}", agent=agent), range(n))
        )
    runs, total = list_runs(engine_store, agent=agent)
    assert total == n and len(runs) == n
    assert len({r.id for r in runs}) == n
    keys = [(ms(r.created_at), r.id) for r in runs]
    assert keys == sorted(keys)


def test_claim_run_only_when_unclaimed_or_expired(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    rid = f"{store_ns}-run"
    assert not claim(engine_store, rid, "w1", 60_000).claimed, "unknown run: false"
    new_run(engine_store, rid)
    first = claim(engine_store, rid, "w1", 60_000)
    assert first.claimed and first.run.claim.owner == "w1"
    other = claim(engine_store, rid, "w2", 60_000)
    assert not other.claimed and other.run.claim.owner == "w1"
    again = claim(engine_store, rid, "w1", 60_000)
    assert not again.claimed, "a live claim, even the caller's own, is not claimed again"
    assert get_run(engine_store, rid).claim == first.run.claim


def test_claim_run_takeover_after_ttl(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    rid = f"{store_ns}-run"
    new_run(engine_store, rid)
    ttl = store_clock.ttl()
    assert claim(engine_store, rid, "w1", ttl).claimed
    assert not claim(engine_store, rid, "w2", ttl).claimed
    store_clock.advance(ttl)
    taken = claim(engine_store, rid, "w2", 60_000)
    assert taken.claimed and taken.run.claim.owner == "w2"
    assert not renew(engine_store, rid, "w1", 60_000).renewed, "the old owner cannot renew"


def test_renew_claim_only_for_the_live_owner(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    rid = f"{store_ns}-run"
    assert not renew(engine_store, rid, "w1", 1000).renewed, "unknown run: false"
    new_run(engine_store, rid)
    assert not renew(engine_store, rid, "w1", 1000).renewed, "unclaimed: false"
    ttl = store_clock.ttl()
    first = claim(engine_store, rid, "w1", ttl).run.claim
    assert not renew(engine_store, rid, "w2", 60_000).renewed
    assert get_run(engine_store, rid).claim == first, "a refused renew changes nothing"
    renewed = renew(engine_store, rid, "w1", 60_000)
    assert renewed.renewed and ms(renewed.run.claim.expires_at) > ms(first.expires_at)
    rid2 = f"{store_ns}-run2"
    new_run(engine_store, rid2)
    assert claim(engine_store, rid2, "w1", ttl).claimed
    store_clock.advance(ttl)
    assert not renew(engine_store, rid2, "w1", 60_000).renewed, "an expired claim is not renewed"


def test_claims_keys_and_locks_expire_at_exactly_t_plus_ttl(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    """docs/SPEC.md §4: granted at T with ttl D -> live at T + D - 1 ms, taken over at T + D."""
    store_clock.require_manual()
    d = 5_000
    rid, scope, lock = f"{store_ns}-run", f"{store_ns}-scope", f"{store_ns}-lock"
    new_run(engine_store, rid)
    new_run(engine_store, f"{rid}-renew")
    granted = claim(engine_store, rid, "w1", d).run.claim  # all three granted at T
    assert claim(engine_store, f"{rid}-renew", "w1", d).claimed
    assert claim_key(engine_store, scope, "k", "run-1", d).created
    first = acquire(engine_store, lock, "w1", d)
    assert first.acquired and ms(first.expires_at) == ms(granted.expires_at)
    store_clock.advance(d - 1)  # T + D - 1: all live
    assert not claim(engine_store, rid, "w2", d).claimed
    assert renew(engine_store, f"{rid}-renew", "w1", d).renewed, "still live: renewable"
    held = claim_key(engine_store, scope, "k", "run-2", d)
    assert not held.created and held.run_id == "run-1"
    blocked = acquire(engine_store, lock, "w2", d)
    assert not blocked.acquired and blocked.owner == "w1"
    assert blocked.fencing_token == first.fencing_token
    store_clock.advance(1)  # exactly T + D: all expired, taken over
    taken = claim(engine_store, rid, "w2", d)
    assert taken.claimed and taken.run.claim.owner == "w2"
    key = claim_key(engine_store, scope, "k", "run-2", d)
    assert key.created and key.run_id == "run-2"
    lock2 = acquire(engine_store, lock, "w2", d)
    assert lock2.acquired and lock2.fencing_token > first.fencing_token


# -- steps and checkpoints ------------------------------------------------------------------


def test_steps_are_append_only_in_order(engine_store: Any, store_ns: str) -> None:
    rid, other = f"{store_ns}-run", f"{store_ns}-other"
    names = ["fetch", "parse", "fetch", "store", "notify"]
    for i, name in enumerate(names):
        step = engine_store.AppendStep(
            pb.EngineAppendStepRequest(
                step=pb.EngineStep(
                    run_id=rid, name=name, status="done", input=J({"i": i}), output=J([i, None])
                )
            )
        ).step
        assert step.seq == i + 1 and step.name == name
        engine_store.AppendStep(
            pb.EngineAppendStepRequest(step=pb.EngineStep(run_id=other, name=f"o{i}"))
        )
    steps = [
        s
        for page in engine_store.ListSteps(pb.EngineListStepsRequest(run_id=rid))
        for s in page.steps
    ]
    assert [s.name for s in steps] == names and [s.seq for s in steps] == [1, 2, 3, 4, 5]
    assert all(same_json(s.input, {"i": i}) for i, s in enumerate(steps))
    assert all(same_json(s.output, [i, None]) and s.status == "done" for i, s in enumerate(steps))
    assert not steps[0].HasField("error")
    none = list(engine_store.ListSteps(pb.EngineListStepsRequest(run_id=f"{store_ns}-none")))
    assert [s for page in none for s in page.steps] == []


def test_checkpoints_keep_the_highest_step_index(engine_store: Any, store_ns: str) -> None:
    rid = f"{store_ns}-run"

    def save(index: int, state: Any) -> Any:
        return engine_store.SaveCheckpoint(
            pb.EngineSaveCheckpointRequest(
                checkpoint=pb.EngineCheckpoint(run_id=rid, step_index=index, state=J(state))
            )
        )

    def latest() -> Any:
        resp = engine_store.LatestCheckpoint(pb.EngineLatestCheckpointRequest(run_id=rid))
        return resp.checkpoint if resp.found else None

    assert latest() is None
    assert save(3, {"at": 3}).saved
    assert save(5, {"at": 5}).saved
    lower = save(4, {"at": 4})
    assert not lower.saved and lower.checkpoint.step_index == 5
    assert latest().step_index == 5 and same_json(latest().state, {"at": 5})
    assert save(5, {"at": "5 again"}).saved, "an equal index replaces"
    assert same_json(latest().state, {"at": "5 again"})
    assert save(6, None).saved
    cp = latest()
    assert cp.step_index == 6 and cp.HasField("state") and same_json(cp.state, None)


# -- idempotency and locks ------------------------------------------------------------------


def test_idempotency_first_caller_wins_until_expiry(engine_store: Any, store_ns: str) -> None:
    scope = f"{store_ns}-scope"
    first = claim_key(engine_store, scope, "order-1", "run-a", 60_000)
    assert first.created and first.run_id == "run-a"
    for rid in ("run-b", "run-c", "run-a"):
        again = claim_key(engine_store, scope, "order-1", rid, 60_000)
        assert not again.created and again.run_id == "run-a"
        assert ms(again.expires_at) == ms(first.expires_at)
    assert claim_key(engine_store, f"{scope}-2", "order-1", "run-b", 60_000).created
    assert claim_key(engine_store, scope, "order-2", "run-b", 60_000).created


def test_idempotency_takeover_after_ttl(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    scope = f"{store_ns}-scope"
    ttl = store_clock.ttl()
    assert claim_key(engine_store, scope, "k", "run-a", ttl).created
    store_clock.advance(ttl)
    taken = claim_key(engine_store, scope, "k", "run-b", 60_000)
    assert taken.created and taken.run_id == "run-b"
    assert claim_key(engine_store, scope, "k", "run-c", 60_000).run_id == "run-b"


def test_locks_one_holder_and_fencing_tokens_increase(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    key = f"{store_ns}-lock"
    a = acquire(engine_store, key, "a", 60_000)
    assert a.acquired and a.fencing_token >= 1 and a.owner == "a"
    b = acquire(engine_store, key, "b", 60_000)
    assert not b.acquired and b.owner == "a" and b.fencing_token == a.fencing_token
    store_clock.tick()
    again = acquire(engine_store, key, "a", 60_000)
    assert again.acquired and again.fencing_token == a.fencing_token, "extends, same token"
    assert ms(again.expires_at) > ms(a.expires_at)
    assert not release(engine_store, key, "b"), "a non-owner's release changes nothing"
    assert not acquire(engine_store, key, "b", 60_000).acquired
    tokens = [a.fencing_token]
    assert release(engine_store, key, "a")
    assert not release(engine_store, key, "a"), "released twice: nothing held"
    for owner in ("b", "c", "a", "b"):
        got = acquire(engine_store, key, owner, 60_000)
        assert got.acquired and got.owner == owner
        tokens.append(got.fencing_token)
        assert release(engine_store, key, owner)
    assert tokens == sorted(set(tokens)), f"tokens strictly increase: {tokens}"


def test_lock_takeover_after_ttl(engine_store: Any, store_ns: str, store_clock: StoreClock) -> None:
    key = f"{store_ns}-lock"
    ttl = store_clock.ttl()
    a = acquire(engine_store, key, "a", ttl)
    assert a.acquired
    store_clock.advance(ttl)
    b = acquire(engine_store, key, "b", 60_000)
    assert b.acquired and b.fencing_token > a.fencing_token
    assert not release(engine_store, key, "a"), "the expired holder releases nothing"
    assert not acquire(engine_store, key, "a", 60_000).acquired


# -- effects and state ----------------------------------------------------------------------


def test_effects_a_recorded_null_is_found(engine_store: Any, store_ns: str) -> None:
    key = f"{store_ns}-effect"
    missing = engine_store.GetEffect(pb.EngineGetEffectRequest(key=key))
    assert not missing.found and not missing.HasField("result")
    engine_store.PutEffect(pb.EnginePutEffectRequest(key=key, result=J(None)))
    got = engine_store.GetEffect(pb.EngineGetEffectRequest(key=key))
    assert got.found and got.HasField("result") and same_json(got.result, None)
    engine_store.PutEffect(pb.EnginePutEffectRequest(key=key, result=J({"charged": 2**60})))
    got = engine_store.GetEffect(pb.EngineGetEffectRequest(key=key))
    assert same_json(got.result, {"charged": 2**60})


def test_kv_state_null_is_distinct_from_absent(engine_store: Any, store_ns: str) -> None:
    a1, a2 = f"{store_ns}-a1", f"{store_ns}-a2"
    assert not engine_store.KvGet(pb.EngineKvGetRequest(agent=a1, key="k")).found
    engine_store.KvSet(pb.EngineKvSetRequest(agent=a1, key="k", value=J(None)))
    got = engine_store.KvGet(pb.EngineKvGetRequest(agent=a1, key="k"))
    assert got.found and same_json(got.value, None)
    engine_store.KvSet(pb.EngineKvSetRequest(agent=a1, key="k", value=J({"n": [1, 2]})))
    assert same_json(
        engine_store.KvGet(pb.EngineKvGetRequest(agent=a1, key="k")).value, {"n": [1, 2]}
    )
    assert not engine_store.KvGet(pb.EngineKvGetRequest(agent=a2, key="k")).found


def test_integers_longer_than_pythons_conversion_limit_are_stored_exactly(
    engine_store: Any, store_ns: str
) -> None:
    """Integers of any length: 5 000 digits is past the 4 300 that Python (a
    likely server language) converts to int by default."""
    digits = "7" * 5000
    text = f'{{"n":{digits},"neg":-{digits},"list":[{digits},1]}}'
    rid = f"{store_ns}-long"
    run = new_run(engine_store, rid, input=pb.JsonValue(json=text))
    assert run.input.json == text and get_run(engine_store, rid).input.json == text
    engine_store.KvSet(pb.EngineKvSetRequest(agent=store_ns, key="long",
                                             value=pb.JsonValue(json=text)))
    assert engine_store.KvGet(pb.EngineKvGetRequest(agent=store_ns, key="long")).value.json == text
    engine_store.DocUpsert(pb.EngineDocUpsertRequest(agent=store_ns, collection="long", id="d",
                                                     doc=pb.JsonValue(json=text)))
    where = pb.EngineDocListRequest(agent=store_ns, collection="long",
                                    where=pb.JsonValue(json=f'{{"n":{digits}}}'))
    assert [d.doc.json for page in engine_store.DocList(where) for d in page.docs] == [text]
    other = pb.EngineDocListRequest(agent=store_ns, collection="long",
                                    where=pb.JsonValue(json=f'{{"n":{digits}8}}'))
    assert [d.id for page in engine_store.DocList(other) for d in page.docs] == []


def _docs(store: Any, agent: str, coll: str, where: Any = None, **kw: Any) -> list[str]:
    req = pb.EngineDocListRequest(agent=agent, collection=coll, **kw)
    if where is not None:
        req.where.CopyFrom(J(where))
    return [d.id for page in store.DocList(req) for d in page.docs]


def test_doc_list_orders_by_id_and_filters_by_top_level_equality(
    engine_store: Any, store_ns: str
) -> None:
    agent = store_ns
    docs = {
        "d3": {"kind": "a", "n": 1, "tags": ["x"], "meta": {"deep": True}},
        "d1": {"kind": "a", "n": 2, "tags": ["x", "y"]},
        "d2": {"kind": "b", "n": 1, "flag": True},
        "d5": {"kind": "a", "n": 1.0, "tags": ["x"], "meta": {"deep": True}},
        "d4": {"kind": "a", "n": "1", "flag": 1, "nothing": None},
    }
    for doc_id, doc in docs.items():
        resp = engine_store.DocUpsert(
            pb.EngineDocUpsertRequest(agent=agent, collection="c", id=doc_id, doc=J(doc))
        )
        assert resp.created and same_json(resp.doc.doc, doc)
    assert _docs(engine_store, agent, "c") == ["d1", "d2", "d3", "d4", "d5"]
    assert _docs(engine_store, agent, "c", {}) == ["d1", "d2", "d3", "d4", "d5"]
    assert _docs(engine_store, agent, "c", {"kind": "a"}) == ["d1", "d3", "d4", "d5"]
    assert _docs(engine_store, agent, "c", {"kind": "a", "n": 1}) == ["d3", "d5"]
    assert _docs(engine_store, agent, "c", {"n": "1"}) == ["d4"], "a string is not a number"
    assert _docs(engine_store, agent, "c", {"flag": True}) == ["d2"], "true is not 1"
    assert _docs(engine_store, agent, "c", {"flag": 1}) == ["d4"]
    assert _docs(engine_store, agent, "c", {"nothing": None}) == ["d4"], "null matches null"
    assert _docs(engine_store, agent, "c", {"missing": None}) == [], "absent is not null"
    assert _docs(engine_store, agent, "c", {"tags": ["x"]}) == ["d3", "d5"]
    assert _docs(engine_store, agent, "c", {"meta": {"deep": True}}) == ["d3", "d5"]
    assert _docs(engine_store, agent, "c", {"deep": True}) == [], "top-level fields only"
    assert _docs(engine_store, agent, "c", {"kind": "a"}, limit=2) == ["d1", "d3"]
    assert _docs(engine_store, agent, "other") == []
    replaced = engine_store.DocUpsert(
        pb.EngineDocUpsertRequest(agent=agent, collection="c", id="d1", doc=J({"kind": "z"}))
    )
    assert not replaced.created
    assert _docs(engine_store, agent, "c", {"kind": "z"}) == ["d1"]
    delete = pb.EngineDocDeleteRequest(agent=agent, collection="c", id="d1")
    assert engine_store.DocDelete(delete).deleted
    assert not engine_store.DocDelete(delete).deleted
    assert _docs(engine_store, agent, "c") == ["d2", "d3", "d4", "d5"]


def test_doc_list_refuses_where_it_cannot_honour(engine_store: Any, store_ns: str) -> None:
    for where in ('["kind"]', '"kind"', "1", "null"):
        req = pb.EngineDocListRequest(
            agent=store_ns, collection="c", where=pb.JsonValue(json=where)
        )
        invalid_call("where", _drain, engine_store.DocList, req)
    for unsupported in ({"a.b": 1}, {"$or": [{"a": 1}]}, {"n": {"$gt": 1}}):
        req = pb.EngineDocListRequest(agent=store_ns, collection="c", where=J(unsupported))
        invalid_call("where", _drain, engine_store.DocList, req)
    req = pb.EngineDocListRequest(agent=store_ns, collection="c", where=pb.JsonValue(json="{"))
    invalid(lambda: list(engine_store.DocList(req)), "where")


# -- artifacts ------------------------------------------------------------------------------


def test_artifact_bytes_are_exact_and_listed_like_runs(
    engine_store: Any, store_ns: str, store_clock: StoreClock
) -> None:
    rid = f"{store_ns}-run"
    blobs = {
        "b": os.urandom(2 * 1024 * 1024 + 12_345),  # several chunks, odd tail
        "a": bytes(range(256)) * 7,
        "c": b"",
    }
    for name, data in blobs.items():
        resp = upload(
            engine_store,
            f"{store_ns}-{name}",
            rid,
            data,
            name=f"{name}.bin",
            content_type="application/octet-stream",
            metadata=J({"name": name}),
        )
        assert resp.created
        art = resp.artifact
        assert art.size_bytes == len(data) and art.sha256 == hashlib.sha256(data).hexdigest()
        assert art.name == f"{name}.bin" and same_json(art.metadata, {"name": name})
        store_clock.tick()
    for name, data in blobs.items():
        assert read(engine_store, f"{store_ns}-{name}") == data
        assert get_artifact(engine_store, f"{store_ns}-{name}").size_bytes == len(data)
    arts = [
        a
        for page in engine_store.ListArtifacts(pb.EngineListArtifactsRequest(run_id=rid))
        for a in page.artifacts
    ]
    assert [a.id.removeprefix(f"{store_ns}-") for a in arts] == ["b", "a", "c"]
    keys = [(ms(a.created_at), a.id) for a in arts]
    assert keys == sorted(keys)
    other = engine_store.ListArtifacts(pb.EngineListArtifactsRequest(run_id=f"{rid}-x"))
    assert [a for page in other for a in page.artifacts] == []


def test_artifact_insert_if_absent_keeps_metadata_and_bytes(
    engine_store: Any, store_ns: str
) -> None:
    art_id, rid = f"{store_ns}-art", f"{store_ns}-run"
    original = os.urandom(300_000)
    first = upload(engine_store, art_id, rid, original, name="first", metadata=J({"v": 1}))
    assert first.created
    second = upload(
        engine_store, art_id, f"{rid}-2", os.urandom(500_000), name="second", metadata=J({"v": 2})
    )
    assert not second.created and second.artifact == first.artifact
    assert get_artifact(engine_store, art_id) == first.artifact
    assert read(engine_store, art_id) == original


def test_artifact_unknown_ids(engine_store: Any, store_ns: str) -> None:
    assert get_artifact(engine_store, f"{store_ns}-none") is None
    expect_error(
        lambda: read(engine_store, f"{store_ns}-none"), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND"
    )


def test_artifact_delete_frees_the_id_and_is_idempotent(engine_store: Any, store_ns: str) -> None:
    art_id, rid = f"{store_ns}-art", f"{store_ns}-run"
    kept = upload(engine_store, f"{store_ns}-kept", rid, b"kept").artifact
    assert upload(engine_store, art_id, rid, os.urandom(300_000), name="first").created

    def delete(i: str, request_id: str = "") -> bool:
        req = pb.EngineDeleteArtifactRequest(id=i, request_id=request_id)
        return bool(engine_store.DeleteArtifact(req).deleted)

    assert delete(art_id, f"{store_ns}-d1")
    assert delete(art_id, f"{store_ns}-d1"), "a retry is answered deleted=true"
    assert not delete(art_id) and not delete(f"{store_ns}-none")
    assert get_artifact(engine_store, art_id) is None
    expect_error(lambda: read(engine_store, art_id), grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND")
    listed = [
        a
        for page in engine_store.ListArtifacts(pb.EngineListArtifactsRequest(run_id=rid))
        for a in page.artifacts
    ]
    assert listed == [kept]
    again = os.urandom(70_000)
    second = upload(engine_store, art_id, rid, again, name="second")
    assert second.created and second.artifact.name == "second"
    assert read(engine_store, art_id) == again
    invalid(lambda: delete(""), "id")


def test_artifact_bad_streams_store_nothing(engine_store: Any, store_ns: str) -> None:
    rid = f"{store_ns}-run"

    def put(messages: list[pb.EnginePutArtifactRequest]) -> Any:
        return engine_store.PutArtifact(iter(messages))

    def header(art_id: str, size: int, **kw: Any) -> pb.EnginePutArtifactRequest:
        return pb.EnginePutArtifactRequest(
            header=pb.EngineArtifactHeader(id=art_id, run_id=rid, size_bytes=size, **kw)
        )

    chunk = pb.EnginePutArtifactRequest(chunk=b"x" * 1000)
    cases: dict[str, list[pb.EnginePutArtifactRequest]] = {
        "bytes-first": [chunk, header(f"{store_ns}-bytes-first", 1000)],
        "ends-early": [header(f"{store_ns}-ends-early", 5000), chunk, chunk],
        "too-long": [header(f"{store_ns}-too-long", 1500), chunk, chunk],
        "two-headers": [
            header(f"{store_ns}-two-headers", 1000),
            chunk,
            header(f"{store_ns}-two-headers", 1000),
        ],
        "bad-sha": [header(f"{store_ns}-bad-sha", 1000, sha256="0" * 64), chunk],
        "negative": [header(f"{store_ns}-negative", -1)],
        "bad-metadata": [
            header(f"{store_ns}-bad-metadata", 1000, metadata=pb.JsonValue(json="{nope")),
            chunk,
        ],
    }
    for name, messages in cases.items():
        invalid_call(None, put, messages)
        assert get_artifact(engine_store, f"{store_ns}-{name}") is None, name
    invalid(lambda: put([]), "header")
    arts = [
        a
        for page in engine_store.ListArtifacts(pb.EngineListArtifactsRequest(run_id=rid))
        for a in page.artifacts
    ]
    assert arts == []


# -- bad input and request ids ----------------------------------------------------------------


def test_bad_input_is_invalid_argument_and_stores_nothing(engine_store: Any, store_ns: str) -> None:
    s, ns = engine_store, store_ns
    long_key = "k" * 1025
    long_id = "r" * 513
    bad_json = [
        "{",
        '{"a": 1,}',
        "NaN",
        "Infinity",
        "-Infinity",
        '{"a": NaN}',
        "",
        "[1] [2]",
        "'single'",
        '{"a": 1} trailing',
    ]
    rid = f"{ns}-run"
    for text in bad_json:
        bad = pb.JsonValue(json=text)
        run = pb.EngineRun(id=rid, agent="a", status="queued", input=bad)
        invalid_call("input", s.CreateRun, pb.EngineCreateRunRequest(run=run))
        invalid_call("value", s.KvSet, pb.EngineKvSetRequest(agent=ns, key="k", value=bad))
        invalid_call("result", s.PutEffect, pb.EnginePutEffectRequest(key=f"{ns}-e", result=bad))
        cp = pb.EngineCheckpoint(run_id=rid, step_index=1, state=bad)
        invalid_call("state", s.SaveCheckpoint, pb.EngineSaveCheckpointRequest(checkpoint=cp))
        step = pb.EngineStep(run_id=rid, name="s", output=bad)
        invalid_call("output", s.AppendStep, pb.EngineAppendStepRequest(step=step))
        invalid_call(
            "doc",
            s.DocUpsert,
            pb.EngineDocUpsertRequest(agent=ns, collection="c", id="d", doc=bad),
        )
    assert get_run(s, rid) is None
    assert not s.KvGet(pb.EngineKvGetRequest(agent=ns, key="k")).found
    assert not s.GetEffect(pb.EngineGetEffectRequest(key=f"{ns}-e")).found
    assert not s.LatestCheckpoint(pb.EngineLatestCheckpointRequest(run_id=rid)).found
    assert [x for p in s.ListSteps(pb.EngineListStepsRequest(run_id=rid)) for x in p.steps] == []
    assert _docs(s, ns, "c") == []

    new_run(s, rid)
    before = get_run(s, rid)
    invalid(
        lambda: s.UpdateRun(
            pb.EngineUpdateRunRequest(
                id=rid, patch=pb.EngineRunPatch(status="x", output=pb.JsonValue(json="{"))
            )
        ),
        "output",
    )
    invalid(
        lambda: s.UpdateRun(
            pb.EngineUpdateRunRequest(id=rid, patch=pb.EngineRunPatch(clear=["nonsense"]))
        ),
        "clear",
    )
    invalid(
        lambda: s.DocUpsert(
            pb.EngineDocUpsertRequest(agent=ns, collection="c", id="d", doc=J([1, 2]))
        ),
        "doc",
    )  # not an object
    assert get_run(s, rid) == before

    # oversized and empty keys and ids
    invalid(lambda: claim_key(s, long_key, "k", "r", 1000), "scope")
    invalid(lambda: claim_key(s, ns, long_key, "r", 1000), "key")
    invalid(lambda: acquire(s, long_key, "o", 1000), "key")
    invalid(lambda: s.PutEffect(pb.EnginePutEffectRequest(key=long_key, result=J(1))), "key")
    invalid(lambda: s.KvSet(pb.EngineKvSetRequest(agent=ns, key=long_key, value=J(1))), "key")
    invalid(
        lambda: s.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id=long_id, agent="a", status="q"))
        ),
        "id",
    )
    invalid(
        lambda: s.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id="", agent="a", status="q"))
        ),
        "id",
    )
    invalid(
        lambda: s.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id=f"{ns}-x", agent="", status="q"))
        ),
        "agent",
    )
    invalid(
        lambda: s.CreateRun(
            pb.EngineCreateRunRequest(run=pb.EngineRun(id=f"{ns}-\x01", agent="a", status="q"))
        ),
        "id",
    )
    assert get_run(s, f"{ns}-x") is None
    # negative, zero and absurd ttls
    for ttl in (-1, 0, -60_000, 10**15):
        invalid_call("ttl_ms", claim, s, rid, "w", ttl)
        invalid_call("ttl_ms", renew, s, rid, "w", ttl)
        invalid_call("ttl_ms", claim_key, s, ns, "ttl", "r", ttl)
        invalid_call("ttl_ms", acquire, s, f"{ns}-lock", "w", ttl)
    assert not get_run(s, rid).HasField("claim")
    assert claim_key(s, ns, "ttl", "r-ok", 60_000).created, "no key was stored"
    first = acquire(s, f"{ns}-lock", "other", 60_000)
    assert first.acquired, "no lock was stored"
    # negative limits, offsets and indexes
    invalid(lambda: list_runs(s, agent=ns, limit=-1), "limit")
    invalid(lambda: list_runs(s, agent=ns, offset=-1), "offset")
    invalid(lambda: _docs(s, ns, "c", limit=-5), "limit")
    invalid(
        lambda: s.SaveCheckpoint(
            pb.EngineSaveCheckpointRequest(
                checkpoint=pb.EngineCheckpoint(run_id=rid, step_index=-1, state=J(1))
            )
        ),
        "step_index",
    )
    # unknown fields in `where`
    invalid(lambda: _docs(s, ns, "c", {"$where": "1"}), "where")
    invalid(lambda: _docs(s, ns, "c", {"a.b": 1}), "where")


def test_request_ids_replay_the_original_answer(engine_store: Any, store_ns: str) -> None:
    s, ns = engine_store, store_ns
    req = pb.EngineCreateRunRequest(
        run=pb.EngineRun(id=f"{ns}-run", agent="a", status="queued"), request_id=f"{ns}-c1"
    )
    first = s.CreateRun(req)
    assert first.created and s.CreateRun(req) == first, "the retry is answered created=true"
    key = f"{ns}-lock"
    grant = acquire(s, key, "a", 60_000, request_id=f"{ns}-l1")
    assert grant.acquired and release(s, key, "a")
    replay = acquire(s, key, "a", 60_000, request_id=f"{ns}-l1")
    assert replay == grant, "the original answer, not a second grant"
    b = acquire(s, key, "b", 60_000)
    assert b.acquired and b.fencing_token > grant.fencing_token, "the replay acquired nothing"
    data = os.urandom(100_000)

    def put() -> Any:
        return upload(s, f"{ns}-art", f"{ns}-run", data, request_id=f"{ns}-a1")

    art = put()
    assert art.created and put() == art
    assert read(s, f"{ns}-art") == data
    reused = pb.EngineCreateRunRequest(
        run=pb.EngineRun(id=f"{ns}-other", agent="a", status="queued"), request_id=f"{ns}-c1"
    )
    invalid(lambda: s.CreateRun(reused), "request_id")
    assert get_run(s, f"{ns}-other") is None
