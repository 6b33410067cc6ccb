"""Contracts held by tests: generated code is fresh, the core is pure, only the
writer writes, every error code maps to one gRPC status with ErrorInfo."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from fencepost.v1 import record_pb2
from fencepost_server.core.errors import Code, LedgerError
from fencepost_server.core.records import Record, Status
from fencepost_server.rpc.status import GRPC_CODE, to_status

REPO = Path(__file__).resolve().parents[2]
SERVER = REPO / "server" / "fencepost_server"
GEN = REPO / "clients" / "python" / "fencepost" / "v1"


def test_checked_in_stubs_equal_a_fresh_make_proto(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(REPO / "scripts" / "codegen.py"), str(tmp_path)],
                   check=True, capture_output=True, timeout=120)  # what `make proto` runs
    fresh = sorted((tmp_path / "fencepost" / "v1").glob("*_pb2*"))
    assert fresh, "protoc generated nothing"
    names = sorted(p.name for p in fresh)
    assert names == sorted(p.name for p in GEN.glob("*_pb2*")), "stub set differs: run make proto"
    for path in fresh:
        assert path.read_bytes() == (GEN / path.name).read_bytes(), (
            f"{path.name} is stale: run make proto"
        )


CORE_MODULES = ["records", "ledger", "errors", "validate", "codec", "engine"]


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_imports_no_io(module: str) -> None:
    code = (
        f"import sys; import fencepost_server.core.{module}; "
        "bad = [m for m in ('asyncio', 'grpc', 'sqlite3', 'aiosqlite', 'google.protobuf') "
        "if m in sys.modules]; print(','.join(bad))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"core.{module} pulls in {out.stdout.strip()}"


def _calls(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            try:
                names.append(ast.unparse(node.func))
            except Exception:  # pragma: no cover
                continue
    return names


def test_only_the_storage_module_connects_and_only_the_writer_opens_it() -> None:
    connectors = {}
    openers = {}
    for path in SERVER.rglob("*.py"):
        calls = _calls(path)
        rel = str(path.relative_to(SERVER))
        if any(c in ("sqlite3.connect", "aiosqlite.connect") for c in calls):
            connectors[rel] = True
        if any(c.endswith("storage.open") or c.endswith("storage.open_writer") for c in calls):
            openers[rel] = True
    assert set(connectors) == {"storage/sqlite.py"}
    assert set(openers) == {"writer/writer.py"}
    src = (SERVER / "storage" / "sqlite.py").read_text()
    # the other connections: read-only ones, and the checkpointer's, which may
    # not change a row (tests/unit/test_sqlite_storage.py tries)
    assert src.count("sqlite3.connect(") == 3 and "mode=ro" in src
    assert 'PRAGMA query_only=1' in src


def test_read_only_connection_cannot_write(tmp_path: Path) -> None:
    from fencepost_server.storage.sqlite import SqliteStorage, open_read_only

    st = SqliteStorage(tmp_path / "x.db")
    st.open()
    st.close()
    ro = open_read_only(tmp_path / "x.db")
    import sqlite3

    with pytest.raises(sqlite3.OperationalError):
        ro.execute("INSERT INTO meta VALUES ('x', 1)")
    ro.close()


def test_architecture_doc_states_the_invariants() -> None:
    doc = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    for phrase in ("imports no asyncio, grpc or sqlite3", "Only the writer", "path of one write"):
        assert phrase.lower() in doc.lower(), phrase


@pytest.mark.parametrize("code", list(Code))
def test_every_code_maps_to_a_status_with_error_info(code: Code) -> None:
    rec = Record("r", 3, Status.RUNNING, 1, 2, 0, 0, revision=9)
    status = to_status(LedgerError(code, "msg", rec, field="f"))
    assert status.code == GRPC_CODE[code]
    proto = rpc_status.status_pb2.Status.FromString(
        dict(status.trailing_metadata)["grpc-status-details-bin"]
    )
    info = error_details_pb2.ErrorInfo()
    assert proto.details[0].Unpack(info)
    assert (info.reason, info.domain, info.metadata["field"]) == (code.value, "fencepost", "f")
    run = record_pb2.Run()
    assert proto.details[1].Unpack(run) and run.fencing_token == 2 and run.revision == 9


def test_spec_codes_have_their_spec_grpc_codes() -> None:
    S = grpc.StatusCode
    assert GRPC_CODE[Code.RUN_VALIDATION_ERROR] is S.INVALID_ARGUMENT
    assert GRPC_CODE[Code.RUN_NOT_FOUND] is S.NOT_FOUND
    assert GRPC_CODE[Code.RUN_CONFLICT] is S.ABORTED
    assert GRPC_CODE[Code.RUN_INTEGRITY_ERROR] is S.DATA_LOSS
    for c in (
        Code.RUN_LEASE_HELD,
        Code.RUN_LEASE_LOST,
        Code.RUN_ALREADY_TERMINAL,
        Code.RUN_SUSPENDED,
        Code.RUN_INVALID_TRANSITION,
        Code.RUN_STORE_ATOMIC_REQUIRED,
        Code.INVALID_RUN_STATE,
    ):
        assert GRPC_CODE[c] is S.FAILED_PRECONDITION
