"""Where each command's items are (docs/SPEC.md "Shards", the table of
shard keys): every command type has a rule, each rule names the keys the
table gives, and fences and transactions add theirs."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path

import pytest
from google.protobuf import json_format

from fencepost.v1 import ledger_pb2 as pb
from fencepost_server.core import engine as E
from fencepost_server.core import ledger as L
from fencepost_server.core import placement
from fencepost_server.core.fence import Fence
from fencepost_server.core.records import Record, Status
from fencepost_server.core.shards import SEPARATOR, shard_of
from fencepost_server.rpc.commands import KINDS


def _command_types() -> set[type]:
    """Every dataclass of the ledger and the engine store that carries a
    request id: the commands the writer takes."""
    found = set()
    for module in (L, E):
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if cls.__module__ == module.__name__ and dataclasses.is_dataclass(cls) \
                    and "request_id" in {f.name for f in dataclasses.fields(cls)}:
                found.add(cls)
    return found


def test_every_command_type_has_a_rule() -> None:
    assert _command_types() == placement.command_types()


RUN = "run-7"
RECORD = Record(RUN, 1, Status.QUEUED, 0, 0, 1, 1)
BY_RUN = [
    L.Acquire(RUN, "w"), L.Renew(RUN, "w", 1), L.RecordCheckpoint(RUN, "w", 1, "k", 1),
    L.Suspend(RUN, "w", 1), L.Finish(RUN, "w", 1, Status.COMPLETED), L.Release(RUN, "w", 1),
    L.Cancel(RUN), L.RequestResume(RUN), L.DeleteRun(RUN), L.Retire(RUN, 3),
    L.RawCreate(RECORD), L.RawCompareAndSet(RUN, 1, RECORD), L.RawDelete(RUN),
    E.CreateRun(RUN, "agent", "pending"), E.UpdateRun(RUN, E.RunPatch()),
    E.ClaimRun(RUN, "w", 1000), E.RenewClaim(RUN, "w", 1000), E.AppendStep(RUN, "step"),
    E.SaveCheckpoint(RUN, 1, "{}"),
    E.CommitArtifact("art", RUN, "name", "text/plain", 0, "0" * 64, None),
]


@pytest.mark.parametrize("cmd", BY_RUN, ids=lambda c: type(c).__name__)
def test_a_runs_items_are_keyed_by_the_run_id(cmd: object) -> None:
    assert placement.shard_keys(cmd) == (RUN,)


def test_keyed_items_use_their_key_or_compound_key() -> None:
    assert placement.shard_keys(E.AcquireLock("lk", "w", 1000)) == ("lk",)
    assert placement.shard_keys(E.ReleaseLock("lk", "w")) == ("lk",)
    assert placement.shard_keys(E.PutEffect("fx", "{}")) == ("fx",)
    assert placement.shard_keys(E.ClaimKey("scope", "key", RUN, 1000)) == \
        (f"scope{SEPARATOR}key",)  # the run_id is a stored value, not a reference
    assert placement.shard_keys(E.KvSet("agent", "key", "v")) == (f"agent{SEPARATOR}key",)
    # one collection, one shard: the document's id plays no part
    assert placement.shard_keys(E.DocUpsert("agent", "coll", "d1", "{}")) == \
        placement.shard_keys(E.DocDelete("agent", "coll", "d2")) == (f"agent{SEPARATOR}coll",)


@pytest.mark.parametrize("cmd", [
    E.DeleteArtifact("art"), E.StageChunk("up", 0, b""), E.DiscardUpload("up"),
    E.SweepUploads(), L.ExtendLeases(1, 1),
], ids=lambda c: type(c).__name__)
def test_writes_naming_no_run_and_sweeps_have_no_shard(cmd: object) -> None:
    assert placement.shard_keys(cmd) is None
    assert placement.shards_of(cmd, 64) is None


def test_a_fence_adds_the_run_or_lock_it_is_keyed_by() -> None:
    by_lock = E.PutEffect("fx", "{}", fence=Fence(3, lock_key="lk"))
    assert placement.shard_keys(by_lock) == ("fx", "lk")
    by_run = L.RecordCheckpoint(RUN, "w", 1, "k", 1, fence=Fence(2, run_id="other"))
    assert placement.shard_keys(by_run) == (RUN, "other")


def test_a_transaction_is_the_union_of_its_commands_and_fence() -> None:
    tx = L.Transaction((E.AppendStep(RUN, "s"), E.KvSet("a", "k", "v")),
                       fence=Fence(1, run_id="fencing-run"))
    assert placement.shard_keys(tx) == (RUN, f"a{SEPARATOR}k", "fencing-run")
    assert placement.shards_of(tx, 4096) == frozenset(
        shard_of(k, 4096) for k in (RUN, f"a{SEPARATOR}k", "fencing-run"))
    assert placement.shards_of(tx, 1) == frozenset({0})
    # one member naming no run: the whole transaction has no shard of its own
    assert placement.shard_keys(L.Transaction((E.AppendStep(RUN, "s"),
                                               E.DeleteArtifact("art")))) is None


def test_shards_follow_the_shard_rule() -> None:
    for n in (1, 7, 64, 4096):
        assert placement.shards_of(L.Acquire(RUN, "w"), n) == frozenset({shard_of(RUN, n)})


def test_a_command_type_without_a_rule_has_no_shard() -> None:
    class Bump:  # a test's own executor seam (tests/unit/test_writer.py)
        request_id = ""

    assert placement.shard_keys(Bump()) is None


def test_ownership_refuses_naming_the_first_shard_led_elsewhere() -> None:
    n = 4096
    keys = ("a-run", "b-run", "c-run")
    shards = sorted({shard_of(k, n) for k in keys})
    assert len(shards) == 3
    own = placement.Ownership(n, [shards[0]], {shards[1]: ("10.0.0.2:1", 7),
                                              shards[2]: ("10.0.0.3:1", 9)})
    by_key = {shard_of(k, n): k for k in keys}
    away = L.Transaction(tuple(E.AppendStep(by_key[s], "s") for s in shards[1:2]))
    refused = own.refusal(away)
    assert refused is not None and refused.code.value == "NOT_OWNER"
    assert refused.metadata == {"shard": str(shards[1]), "owner": "10.0.0.2:1", "epoch": "7"}
    # across coordinators, no one could commit it: refused naming every shard
    for tx in (L.Transaction(tuple(E.AppendStep(k, "s") for k in keys)),
               L.Transaction(tuple(E.AppendStep(by_key[s], "s") for s in shards[1:]))):
        spans = own.refusal(tx)
        assert spans is not None and spans.code.value == "RUN_VALIDATION_ERROR"
        assert spans.field == "commands"
        assert all(str(s) in spans.message for s in shards[1:]), spans.message
    # an owner not known yet (a shard in transition): routed, not refused
    moving = placement.Ownership(n, [shards[0]], {shards[1]: ("", 8)})
    half = L.Transaction(tuple(E.AppendStep(by_key[s], "s") for s in shards[:2]))
    assert moving.refusal(half).code.value == "NOT_OWNER"  # type: ignore[union-attr]
    assert own.refusal(E.AppendStep(by_key[shards[0]], "s")) is None
    assert own.refusal(E.DeleteArtifact("art")) is None  # no shard of its own
    elsewhere = own.refusal_for_key(by_key[shards[2]])
    assert elsewhere is not None and elsewhere.metadata == {
        "shard": str(shards[2]), "owner": "10.0.0.3:1", "epoch": "9"}
    unknown = placement.Ownership(n, [], {}).refusal_for_key("x")
    assert unknown is not None and unknown.metadata is not None
    assert unknown.metadata["owner"] == "" and "not known" in unknown.message


PLACEMENT_VECTORS = json.loads(
    (Path(__file__).resolve().parents[1] / "vectors" / "placement.json").read_text("utf-8")
)["vectors"]


@pytest.mark.parametrize("vector", PLACEMENT_VECTORS,
                         ids=lambda v: next(iter(v["command"])))
def test_the_server_places_every_vector(vector: dict) -> None:
    """tests/vectors/placement.json: what a client must compute for each
    Command it routes (the SDKs check the same file)."""
    command = json_format.ParseDict(vector["command"], pb.Command())
    kind = command.WhichOneof("kind")
    cmd = KINDS[kind].to_command(getattr(command, kind))
    keys = placement.shard_keys(cmd)
    assert (None if keys is None else list(keys)) == vector["shard_keys"]
    got = placement.shards_of(cmd, 64)
    assert (None if got is None else sorted(got)) == vector["shards_of_64"]


@pytest.mark.parametrize("vector", PLACEMENT_VECTORS,
                         ids=lambda v: next(iter(v["command"])))
def test_the_python_sdk_places_every_vector(vector: dict) -> None:
    from fencepost._placement import shard_keys as sdk_shard_keys

    command = json_format.ParseDict(vector["command"], pb.Command())
    keys = sdk_shard_keys(getattr(command, str(command.WhichOneof("kind"))))
    assert (None if keys is None else list(keys)) == vector["shard_keys"]


def test_the_placement_vectors_cover_every_command_kind() -> None:
    kinds = {next(iter(v["command"])) for v in PLACEMENT_VECTORS}
    assert kinds == {f.name for f in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields}
