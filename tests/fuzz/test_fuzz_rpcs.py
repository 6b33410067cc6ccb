"""Protocol fuzzing of every RPC of every fencepost service against a real
server process over loopback (docs/SPEC.md §8, §10: no input crashes the server or a
stream; every failure is a gRPC status with a fencepost ErrorInfo).

Services are discovered from the generated ``fencepost.v1`` modules, so a new
service (the engine store, say) is fuzzed as soon as the server registers it;
one the server does not register yet is skipped with the reason printed.
Requests are wire bytes built from the descriptors (tests/fuzz/_protofuzz.py):
arbitrary, malformed and boundary values, truncated encodings, and for
streaming RPCs sequences of such messages, cut short by a deadline.

After the fuzzing: the server process is alive, serving, ``PRAGMA
integrity_check`` is ok, and the committed history is still well formed.
"""

from __future__ import annotations

import importlib
import pkgutil
import sqlite3
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from _protofuzz import describe, request
from google.protobuf import message_factory
from google.protobuf.descriptor import MethodDescriptor
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fencepost.v1
from fencepost_server.core.errors import Code
from fencepost_server.rpc.status import GRPC_CODE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "system"))
from _history import load
from _proc import CHANNEL_OPTIONS, ServerProc

REASONS = {c.value: GRPC_CODE[c] for c in Code}
NEVER = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNIMPLEMENTED,
         grpc.StatusCode.DATA_LOSS)
STREAM_DEADLINE_S = 0.25
UNARY_DEADLINE_S = 10.0


def _methods() -> list[MethodDescriptor]:
    out = []
    for mod in pkgutil.iter_modules(fencepost.v1.__path__):
        if not mod.name.endswith("_pb2"):
            continue
        m = importlib.import_module(f"fencepost.v1.{mod.name}")
        for svc in m.DESCRIPTOR.services_by_name.values():
            out.extend(svc.methods)
    return out


METHODS = _methods()


class Fuzzed:
    def __init__(self, srv: ServerProc, services: set[str]) -> None:
        self.srv = srv
        self.services = services
        self.channel = grpc.insecure_channel(srv.address, options=CHANNEL_OPTIONS)
        self.calls = 0
        self.codes: dict[str, int] = {}


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fuzzed]:
    tmp = tmp_path_factory.mktemp("fuzz")
    # --test-hooks so TestHooks is fuzzed too; everything else behaves as in production
    srv = ServerProc(tmp / "fencepost.db", tmp / "server.log", args=("--test-hooks",))
    srv.start()
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = reflection_pb2_grpc.ServerReflectionStub(ch)
            req = reflection_pb2.ServerReflectionRequest(list_services="")
            resp = next(iter(stub.ServerReflectionInfo(iter([req]), timeout=10)))
            names = {s.name for s in resp.list_services_response.service}
        names.add("fencepost.v1.TestHooks")  # served, though not listed by reflection
        f = Fuzzed(srv, names)
        yield f
        f.channel.close()
        assert srv.proc is not None and srv.proc.poll() is None, "server died:\n" + srv.log_tail()
        assert srv.stop() == 0, "graceful stop failed:\n" + srv.log_tail()
    finally:
        srv.kill()


def _check_error(err: grpc.RpcError, method: MethodDescriptor) -> str:
    code = err.code()  # type: ignore[attr-defined]
    where = describe(method)
    assert code not in NEVER, f"{where}: {code} {err.details()}"  # type: ignore[attr-defined]
    status = rpc_status.from_call(err)  # type: ignore[arg-type]  # raises if inconsistent
    if status is None:
        streaming = method.client_streaming or method.server_streaming
        # no rich status: only transport-level outcomes we provoke ourselves
        allowed = {grpc.StatusCode.RESOURCE_EXHAUSTED}  # gRPC's own message size limit
        if streaming:
            allowed |= {grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
        details = err.details()  # type: ignore[attr-defined]
        assert code in allowed, f"{where}: {code} without ErrorInfo: {details}"
        return code.name  # type: ignore[no-any-return]
    infos = [d for d in status.details if d.Is(error_details_pb2.ErrorInfo.DESCRIPTOR)]
    assert len(infos) == 1, f"{where}: {code} carries {len(infos)} ErrorInfo"
    info = error_details_pb2.ErrorInfo()
    infos[0].Unpack(info)
    assert info.domain == "fencepost", f"{where}: domain {info.domain!r}"
    assert info.reason in REASONS, f"{where}: unknown reason {info.reason!r}"
    assert REASONS[info.reason] == code, f"{where}: {info.reason} sent as {code}"
    if info.reason == "RUN_VALIDATION_ERROR":
        assert status.message, f"{where}: a validation error without a message"
    return str(info.reason)


def _messages(payloads: list[bytes], stall: bool) -> Iterator[bytes]:
    yield from payloads
    if stall:  # a stream the client leaves hanging: the deadline cuts it
        time.sleep(STREAM_DEADLINE_S * 2)


def fuzz_call(f: Fuzzed, method: MethodDescriptor, payloads: list[bytes], stall: bool) -> None:
    path = f"/{method.containing_service.full_name}/{method.name}"
    out_cls = message_factory.GetMessageClass(method.output_type)
    ch = f.channel
    responses: list[bytes] = []
    try:
        if not method.client_streaming and not method.server_streaming:
            call = ch.unary_unary(path, request_serializer=None, response_deserializer=None)
            responses.append(call(payloads[0], timeout=UNARY_DEADLINE_S))
        elif not method.client_streaming:
            it = ch.unary_stream(path, request_serializer=None, response_deserializer=None)(
                payloads[0], timeout=STREAM_DEADLINE_S)
            for r in it:
                responses.append(r)
                if len(responses) >= 50:
                    it.cancel()
                    break
        elif not method.server_streaming:
            upload = ch.stream_unary(path, request_serializer=None, response_deserializer=None)
            responses.append(upload(_messages(payloads, stall), timeout=STREAM_DEADLINE_S * 4))
        else:
            it = ch.stream_stream(path, request_serializer=None, response_deserializer=None)(
                _messages(payloads, stall), timeout=STREAM_DEADLINE_S)
            for r in it:
                responses.append(r)
        outcome = "OK"
    except grpc.RpcError as err:
        outcome = _check_error(err, method)
    for r in responses:
        out_cls.FromString(r)  # every answer is a valid message of the declared type
    f.calls += 1
    f.codes[outcome] = f.codes.get(outcome, 0) + 1
    assert f.srv.proc is not None and f.srv.proc.poll() is None, (
        f"the server died on {describe(method)}:\n{f.srv.log_tail()}"
    )


def _examples(method: MethodDescriptor) -> int:
    if method.client_streaming or method.server_streaming:
        return 10
    return 30


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", METHODS, ids=describe)
def test_fuzz_rpc(fuzzed: Fuzzed, method: MethodDescriptor) -> None:
    if method.containing_service.full_name not in fuzzed.services:
        pytest.skip(f"{method.containing_service.full_name} is not registered by the server "
                    "yet: it is fuzzed automatically once it is")
    in_desc = method.input_type
    if method.client_streaming:
        strat: Any = st.tuples(st.lists(request(in_desc), min_size=0, max_size=5),
                               st.booleans())
    else:
        strat = st.tuples(request(in_desc).map(lambda b: [b]), st.just(False))

    @settings(max_examples=_examples(method), deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(strat)
    def run(case: tuple[list[bytes], bool]) -> None:
        payloads, stall = case
        fuzz_call(fuzzed, method, payloads, stall)

    run()


@pytest.mark.slow
@pytest.mark.parametrize("method", [m for m in METHODS if not m.client_streaming],
                         ids=describe)
def test_oversized_request_is_refused(fuzzed: Fuzzed, method: MethodDescriptor) -> None:
    if method.containing_service.full_name not in fuzzed.services:
        pytest.skip("not registered")
    # a 5 MiB string in field 1 (over the 4 MiB default message limit)
    blob = b"\x0a" + bytes([0x80, 0x80, 0xC0, 0x02]) + b"z" * (5 * 1024 * 1024)
    fuzz_call(fuzzed, method, [blob], False)


@pytest.mark.slow
def test_zz_server_survived_and_the_database_is_intact(fuzzed: Fuzzed) -> None:
    """Runs last in this module: the server is alive and serving, and the
    database it wrote under fuzzing is intact and well formed."""
    assert fuzzed.calls >= 300, fuzzed.calls
    print(f"\nfuzzed {fuzzed.calls} calls: {dict(sorted(fuzzed.codes.items()))}")
    srv = fuzzed.srv
    assert srv.proc is not None and srv.proc.poll() is None
    with grpc.insecure_channel(srv.address) as ch:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
    db = sqlite3.connect(f"file:{srv.db_path}?mode=ro", uri=True)
    try:
        assert [r[0] for r in db.execute("PRAGMA integrity_check")] == ["ok"]
    finally:
        db.close()
    snap = load(srv.db_path)
    revs = [c.revision for c in snap.changes]
    assert revs == list(range(1, len(revs) + 1)), "revisions are not gap-free"
    assert snap.meta_revision == (revs[-1] if revs else 0)
    for run_id, seq in snap.per_run().items():
        prev_tok, top = None, 0
        for c in seq:
            if c.rec is None:
                prev_tok = None
                continue
            tok = c.rec["fencing_token"]
            assert tok >= (prev_tok if prev_tok is not None else top + 1), (
                f"{run_id} rev {c.revision}: token {tok} after {prev_tok} (max {top})")
            prev_tok, top = tok, max(top, tok)
    assert "Traceback" not in srv.log_tail(10**7), srv.log_tail()
