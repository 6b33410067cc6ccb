"""A hostile client's extreme values, generated, against every mutation of a
real server (ledger, raw seam, engine store; unary, Transact, Execute and the
artifact upload): integers at and past every bound (2^53 - 1, 2^63 - 1,
2^64 as a varint past 64 bits, negatives), deep and huge JSON, odd UTF-8
(lone surrogates, NULs, overlong encodings) in ids, keys and owners. Every
answer is OK or a fencepost error (never INTERNAL, UNKNOWN or DATA_LOSS);
afterwards the server answers health, a normal lifecycle works, every stored
run and document can be read, and a restart on the same database succeeds.
Bounded: a fixed seed, a few hundred calls, a few seconds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from fuzz._protofuzz import key, length_delimited, varint
from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor, MethodDescriptor
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost.v1 import run_store_pb2 as spb
from fencepost_server.core.errors import Code
from fencepost_server.rpc.status import GRPC_CODE
from fencepost_server.testing.clock import ManualClock
from fencepost_server.testing.server import ServerThread

T0 = 1_700_000_000_000
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.DATA_LOSS)
REASONS = {c.value: GRPC_CODE[c] for c in Code}
OVERLONG = b"\x80" * 9 + b"\x02"  # 2^64 as ten varint bytes: past what any field holds

INT_EDGES = [0, 1, 2, 3, -1, 2**31 - 1, 60_000, 86_400_000, 2**53 - 2, 2**53 - 1, 2**53,
             2**63 - 1, -(2**63), -(2**53)]
NAMES = ["r", "w", "a", "k", "c"]  # shared so that commands meet each other's rows
ODD_TEXT = ["\x00", "a\x00b", "é", "\U0001f600", "\u202e", "\ufeff", "\uffff", "x" * 600,
            "", " ", "a\nb", "\x7f", "\u0085"]
ODD_BYTES = [b"\xed\xa0\x80", b"\xed\xbf\xbf", b"a\xed\xa0\x80b", b"\xc0\x80", b"\xff\xfe",
             b"\xf4\x90\x80\x80"]  # lone surrogates, overlong NUL, not UTF-8, past U+10FFFF


def _nest(depth: int, obj: bool) -> str:
    return ('{"a":' * depth + "1" + "}" * depth) if obj else "[" * depth + "1" + "]" * depth


_EXTREME_JSON = st.sampled_from(["1e99999999999999999999", "-1e99999999999999999999",
                     "1e-99999999999999999999", "1e999999999999999999", "9" * 5000,
                     "-" + "9" * 4301, "0.5e-1000000000000000001", "NaN", "Infinity", "1e",
                     "{", '"\\ud800"', '"\\u0000"', '{"a": 1, "a": 2}', "1 2"])
JSON_TEXT = st.one_of(
    st.sampled_from(["1", "null", '{"a": 1}', '"s"', "[]", "{}", "true"]),
    st.builds(_nest, st.sampled_from([99, 100, 101, 450, 900, 3000]), st.booleans()),
    _EXTREME_JSON, _EXTREME_JSON, _EXTREME_JSON,
    st.integers(1, 200_000).map(lambda n: '"' + "x" * n + '"'),
    st.integers(1, 20_000).map(lambda n: "[" + ",".join(["1"] * n) + "]"),
)


def _int_value(data: st.DataObject) -> bytes:
    if data.draw(st.integers(0, 4)) == 0:
        return varint(data.draw(st.integers(-(2**63), 2**63 - 1)))
    edge = data.draw(st.sampled_from([*INT_EDGES, None]))
    return OVERLONG if edge is None else varint(edge)


def _text(data: st.DataObject, json: bool) -> bytes:
    if json:
        return str(data.draw(JSON_TEXT)).encode("utf-8", "surrogatepass")
    choice = data.draw(st.sampled_from(["name", "odd", "bytes", "any"]))
    if choice == "name":
        return str(data.draw(st.sampled_from(NAMES))).encode()
    if choice == "odd":
        return str(data.draw(st.sampled_from(ODD_TEXT))).encode()
    if choice == "bytes":
        return bytes(data.draw(st.sampled_from(ODD_BYTES)))
    return str(data.draw(st.text(max_size=20))).encode("utf-8", "surrogatepass")


FieldPath = tuple[FieldDescriptor, ...]


def _paths(desc: Descriptor, depth: int = 0) -> list[FieldPath]:
    """Every field a request holds, down nested messages (a message type
    is not entered again inside itself)."""
    out: list[FieldPath] = []
    for f in desc.fields:
        if f.type != FieldDescriptor.TYPE_MESSAGE:
            out.append((f,))
        elif depth < 3 and f.message_type is not desc:
            assert f.message_type is not None
            out += [(f, *rest) for rest in _paths(f.message_type, depth + 1)]
    return out


SWEEP_INTS = [varint(v) for v in (2**53 - 1, 2**53, 2**63 - 1, -(2**63))] + [OVERLONG]
SWEEP_JSON = [_nest(101, False), _nest(900, True), "1e99999999999999999999",
              "-1e99999999999999999999", "9" * 5000]


def _sweep(path: FieldPath) -> list[bytes]:
    """The bound values themselves, for one field: each sent once, whatever
    Hypothesis draws besides."""
    *outer, leaf = path
    parent = outer[-1].message_type if outer else leaf.containing_type
    if parent is not None and parent.name == "JsonValue":
        values = [length_delimited(leaf.number, j.encode()) for j in SWEEP_JSON]
    elif leaf.type in (FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_INT32,
                       FieldDescriptor.TYPE_UINT64):
        values = [key(leaf.number, 0) + v for v in SWEEP_INTS]
    elif leaf.type == FieldDescriptor.TYPE_STRING:
        values = [length_delimited(leaf.number, b) for b in (b"a\x00b", b"\xed\xa0\x80")]
    else:
        return []
    out = []
    for value in values:
        for f in reversed(outer):
            value = length_delimited(f.number, value)
        out.append(value)
    return out


def _leaf(data: st.DataObject, f: FieldDescriptor, json: bool) -> bytes:
    n = f.number
    if f.type == FieldDescriptor.TYPE_STRING:
        return length_delimited(n, _text(data, json))
    if f.type == FieldDescriptor.TYPE_BYTES:
        return length_delimited(n, bytes(data.draw(st.binary(max_size=64))))
    if f.type == FieldDescriptor.TYPE_ENUM:
        assert f.enum_type is not None
        known = [v.number for v in f.enum_type.values]
        return key(n, 0) + varint(data.draw(st.sampled_from([*known, 99, -1])))
    if f.type == FieldDescriptor.TYPE_BOOL:
        return key(n, 0) + varint(data.draw(st.integers(0, 1)))
    return key(n, 0) + _int_value(data)  # every other number in these protos is a varint


def _override(data: st.DataObject, path: FieldPath) -> bytes:
    """Wire bytes setting the field at ``path`` to an extreme value. Appended
    to a valid request they replace that one value (a message is merged
    into), so the call gets past "is required" to the rule that meets it."""
    *outer, leaf = path
    parent = outer[-1].message_type if outer else leaf.containing_type
    out = _leaf(data, leaf, json=parent is not None and parent.name == "JsonValue")
    for f in reversed(outer):
        out = length_delimited(f.number, out)
    return out


def _mutations() -> list[MethodDescriptor]:
    out = [pb.DESCRIPTOR.services_by_name["Ledger"].methods_by_name[m] for m in (
        "Acquire", "Renew", "RecordCheckpoint", "Suspend", "Finish", "Release", "Cancel",
        "RequestResume", "DeleteRun", "Transact", "Execute")]
    out += list(spb.DESCRIPTOR.services_by_name["RunStore"].methods)
    engine = epb.DESCRIPTOR.services_by_name["EngineStore"]
    out += [m for m in engine.methods if not m.server_streaming
            and not m.name.startswith(("Get", "Latest", "Kv" + "Get"))]
    return [m for m in out if m.name not in ("Describe", "Get", "KvGet")]


MUTATIONS = _mutations()

_RUN = rpb.Run(schema=1, run_id="r", version=1, status=rpb.RUN_STATUS_QUEUED, attempt=1,
               fencing_token=1)
_RUN.created_at.FromMilliseconds(T0)
_RUN.updated_at.FromMilliseconds(T0)
_NEXT = rpb.Run()
_NEXT.CopyFrom(_RUN)
_NEXT.version = 2
_HELD = dict(run_id="r", owner="w", fencing_token=1)
_J = epb.JsonValue(json="1")
_ACQUIRE = pb.AcquireRequest(run_id="r", owner="w")
# A valid request per mutation: the generated fields are appended to it.
TEMPLATES: dict[str, Any] = {
    "Acquire": _ACQUIRE,
    "Renew": pb.RenewRequest(**_HELD),
    "RecordCheckpoint": pb.RecordCheckpointRequest(**_HELD, key="k"),
    "Suspend": pb.SuspendRequest(**_HELD),
    "Finish": pb.FinishRequest(**_HELD, status=rpb.RUN_STATUS_COMPLETED),
    "Release": pb.ReleaseRequest(**_HELD),
    "Cancel": pb.CancelRequest(run_id="r"),
    "RequestResume": pb.RequestResumeRequest(run_id="r"),
    "DeleteRun": pb.DeleteRunRequest(run_id="r"),
    "Transact": pb.TransactionRequest(commands=[pb.Command(acquire=_ACQUIRE)]),
    "Execute": pb.ExecuteRequest(commands=[pb.Command(id=1, acquire=_ACQUIRE)]),
    "Create": spb.CreateRequest(run=_RUN),
    "CompareAndSet": spb.CompareAndSetRequest(run_id="r", expected_version=1, next=_NEXT),
    "Delete": spb.DeleteRequest(run_id="r"),
    "CreateRun": epb.EngineCreateRunRequest(run=epb.EngineRun(id="r", agent="a", status="s")),
    "UpdateRun": epb.EngineUpdateRunRequest(id="r"),
    "ClaimRun": epb.EngineClaimRunRequest(id="r", owner="w", ttl_ms=1000),
    "RenewClaim": epb.EngineRenewClaimRequest(id="r", owner="w", ttl_ms=1000),
    "AppendStep": epb.EngineAppendStepRequest(step=epb.EngineStep(run_id="r", name="s")),
    "SaveCheckpoint": epb.EngineSaveCheckpointRequest(
        checkpoint=epb.EngineCheckpoint(run_id="r", step_index=1, state=_J)),
    "ClaimKey": epb.EngineClaimKeyRequest(scope="a", key="k", run_id="r", ttl_ms=1000),
    "AcquireLock": epb.EngineAcquireLockRequest(key="k", owner="w", ttl_ms=1000),
    "ReleaseLock": epb.EngineReleaseLockRequest(key="k", owner="w"),
    "PutEffect": epb.EnginePutEffectRequest(key="k", result=_J),
    "KvSet": epb.EngineKvSetRequest(agent="a", key="k", value=_J),
    "DocUpsert": epb.EngineDocUpsertRequest(agent="a", collection="c", id="d",
                                            doc=epb.JsonValue(json='{"a": 1}')),
    "DocDelete": epb.EngineDocDeleteRequest(agent="a", collection="c", id="d"),
    "PutArtifact": epb.EnginePutArtifactRequest(
        header=epb.EngineArtifactHeader(id="x", run_id="r", size_bytes=1)),
    "DeleteArtifact": epb.EngineDeleteArtifactRequest(id="x"),
}


@pytest.fixture(scope="module")
def hostile_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path: Path = tmp_path_factory.mktemp("hostile") / "fencepost.db"
    with ServerThread(path, clock=ManualClock(T0)) as srv:
        yield srv


def _check(err: grpc.RpcError, where: str) -> None:
    code = err.code()
    assert code not in NEVER, f"{where}: {code} {err.details()}"
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    if status is None:  # only what a stream's own deadline does
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED), (
            f"{where}: {code} without ErrorInfo: {err.details()}")
        return
    info = error_details_pb2.ErrorInfo()
    assert status.details and status.details[0].Unpack(info), where
    assert info.domain == "fencepost" and REASONS.get(info.reason) == code, (where, info)
    if info.reason == "RUN_VALIDATION_ERROR":
        assert info.metadata.get("field"), f"{where}: no field named: {status.message}"


def _call(ch: grpc.Channel, method: MethodDescriptor, payload: bytes, extra: bytes) -> str:
    path = f"/{method.containing_service.full_name}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    try:
        if method.client_streaming and method.server_streaming:  # Execute
            for r in ch.stream_stream(path)(iter([payload, extra]), timeout=10):
                resp = pb.ExecuteResponse.FromString(r)
                for result in resp.results:
                    code = result.error.code if result.WhichOneof("kind") == "error" else 0
                    assert code not in {c.value[0] for c in NEVER}, (path, result)
        elif method.client_streaming:  # PutArtifact: a header, then a chunk
            out_cls.FromString(ch.stream_unary(path)(iter([payload, extra]), timeout=10))
        else:
            out_cls.FromString(ch.unary_unary(path)(payload, timeout=10))
    except grpc.RpcError as err:
        _check(err, f"{method.name}({payload[:200]!r})")
        return err.code().name
    return "OK"


def _lifecycle(channel: grpc.Channel, run_id: str) -> None:
    led = ledger_pb2_grpc.LedgerStub(channel)
    got = led.Acquire(pb.AcquireRequest(run_id=run_id, owner="checker"))
    token = got.run.fencing_token
    led.Renew(pb.RenewRequest(run_id=run_id, owner="checker", fencing_token=token))
    done = led.Finish(pb.FinishRequest(run_id=run_id, owner="checker", fencing_token=token,
                                       status=rpb.RUN_STATUS_COMPLETED))
    assert done.run.status == rpb.RUN_STATUS_COMPLETED


def _everything_reads(channel: grpc.Channel) -> None:
    """Every stored run, page by page and one by one, and every document."""
    led = ledger_pb2_grpc.LedgerStub(channel)
    token, ids = "", []
    while True:
        page = led.ListRuns(pb.ListRunsRequest(page_size=7, page_token=token))
        ids += [r.run_id for r in page.runs]
        if not (token := page.next_page_token):
            break
    for run_id in ids:
        assert led.GetRun(pb.GetRunRequest(run_id=run_id)).run.run_id == run_id
        try:  # every stored run still takes a command: granted, or refused as a rule says
            led.Acquire(pb.AcquireRequest(run_id=run_id, owner="checker"))
        except grpc.RpcError as err:
            _check(err, f"Acquire({run_id!r}) after the hammering")
    es = engine_store_pb2_grpc.EngineStoreStub(channel)
    for page in es.ListRuns(epb.EngineListRunsRequest()):
        assert all(r.id for r in page.runs)
    for agent in NAMES:
        for collection in NAMES:
            where = epb.JsonValue(json='{"a": 1}')
            list(es.DocList(epb.EngineDocListRequest(agent=agent, collection=collection,
                                                     where=where)))


def test_extreme_values_on_every_mutation_leave_a_working_server(
    hostile_server: ServerThread,
) -> None:
    srv = hostile_server
    channel = grpc.insecure_channel(srv.address)
    calls: dict[str, int] = {}
    outcomes: dict[str, int] = {}

    def hammer(method: MethodDescriptor, sweep: bool) -> None:
        template = TEMPLATES[method.name].SerializeToString()
        paths = _paths(method.input_type)
        fresh = iter(range(10**6))

        def base() -> bytes:
            if method.name != "Create":
                return template
            req = spb.CreateRequest()  # a new run each time: its values get stored
            req.CopyFrom(TEMPLATES["Create"])
            req.run.run_id = f"fresh-{next(fresh)}"
            return req.SerializeToString()

        def send(payload: bytes, extra: bytes) -> None:
            outcome = _call(channel, method, payload, extra)
            calls[method.name] = calls.get(method.name, 0) + 1
            outcomes[outcome] = outcomes.get(outcome, 0) + 1

        chunk = b""
        if method.name == "PutArtifact":
            chunk = epb.EnginePutArtifactRequest(chunk=b"z").SerializeToString()
        if sweep and method.name not in ("Execute", "Transact"):  # swept as unary calls
            for path in paths:
                for value in _sweep(path):
                    send(base() + value, chunk)

        @settings(max_examples=min(40, 3 * len(paths)), deadline=None, derandomize=True,
                  database=None, suppress_health_check=list(HealthCheck))
        @given(st.data())
        def one(data: st.DataObject) -> None:
            chosen = data.draw(st.lists(st.sampled_from(paths), min_size=1, max_size=2))
            payload = base() + b"".join(_override(data, p) for p in chosen)
            extra = chunk
            if method.name == "Execute":  # a second message
                extra = template + _override(data, data.draw(st.sampled_from(paths)))
            send(payload, extra)

        one()

    try:
        for round_ in range(2):  # twice: the second round meets the rows the first left
            for method in MUTATIONS:
                hammer(method, sweep=round_ == 0)
        print(f"calls by method {calls}; outcomes {outcomes}")
        assert outcomes.get("OK", 0) >= 20, f"too few calls got past validation: {outcomes}"
        assert sorted(calls) == sorted(TEMPLATES), calls
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == \
            health_pb2.HealthCheckResponse.SERVING
        _lifecycle(channel, "lifecycle-before-restart")
        _everything_reads(channel)
    finally:
        channel.close()
    srv.restart()
    with grpc.insecure_channel(srv.address) as ch:
        _lifecycle(ch, "lifecycle-after-restart")
        _everything_reads(ch)
