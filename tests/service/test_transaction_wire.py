"""Ledger.Transact (and Execute's `transaction` command, through the `ledger`
fixture's stream half): several commands under one fence, all or nothing."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from _wire import expect, run_all

from fencepost.v1 import engine_store_pb2 as epb
from fencepost.v1 import engine_store_pb2_grpc, ledger_pb2_grpc
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import record_pb2 as rpb
from fencepost_server.testing.clock import ManualClock

FP = grpc.StatusCode.FAILED_PRECONDITION
TTL = 10_000


def J(value: Any) -> epb.JsonValue:
    return epb.JsonValue(json=json.dumps(value))


@pytest.fixture
def es(channel: grpc.Channel) -> Any:
    return engine_store_pb2_grpc.EngineStoreStub(channel)


def acquire(ledger: Any, owner: str = "a", run_id: str = "R") -> pb.Run:
    return ledger.Acquire(pb.AcquireRequest(run_id=run_id, owner=owner, lease_ttl_ms=TTL)).run


def checkpoint_step(run: pb.Run, step: int, **extra: Any) -> list[pb.Command]:
    """The seed's checkpoint boundary as one transaction: save the snapshot,
    record the effect's result, append the step, point the record at the
    snapshot (which renews the lease)."""
    return [
        pb.Command(id=1, save_checkpoint=epb.EngineSaveCheckpointRequest(
            checkpoint=epb.EngineCheckpoint(run_id="R", step_index=step, state=J({"step": step})))),
        pb.Command(id=2, put_effect=epb.EnginePutEffectRequest(key=f"fx-{step}", result=J("ok"))),
        pb.Command(id=3, append_step=epb.EngineAppendStepRequest(
            step=epb.EngineStep(run_id="R", name=f"step-{step}"))),
        pb.Command(id=4, record_checkpoint=pb.RecordCheckpointRequest(
            run_id="R", owner=run.lease.owner, fencing_token=run.fencing_token,
            key="R/cp", snapshot_version=step)),
    ]


def nothing_of_step(es: Any, ledger: Any, step: int, version: int) -> None:
    cp = es.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id="R"))
    assert not cp.found or cp.checkpoint.step_index != step
    assert not es.GetEffect(epb.EngineGetEffectRequest(key=f"fx-{step}")).found
    steps = [s.name for p in es.ListSteps(epb.EngineListStepsRequest(run_id="R")) for s in p.steps]
    assert f"step-{step}" not in steps
    assert ledger.GetRun(pb.GetRunRequest(run_id="R")).run.version == version


def test_a_transaction_commits_every_command_and_answers_each(ledger: Any, es: Any) -> None:
    run = acquire(ledger)
    fence = epb.Fence(run_id="R", fencing_token=run.fencing_token)
    resp = ledger.Transact(pb.TransactionRequest(fence=fence, commands=checkpoint_step(run, 1)))
    assert [r.id for r in resp.results] == [1, 2, 3, 4]
    assert [r.WhichOneof("kind") for r in resp.results] == [
        "save_checkpoint", "put_effect", "append_step", "record_checkpoint"]
    assert resp.results[0].save_checkpoint.saved
    assert resp.results[2].append_step.step.seq == 1
    assert resp.results[3].record_checkpoint.run.checkpoint_ref.snapshot_version == 1
    cp = es.LatestCheckpoint(epb.EngineLatestCheckpointRequest(run_id="R"))
    assert cp.found and json.loads(cp.checkpoint.state.json) == {"step": 1}
    assert es.GetEffect(epb.EngineGetEffectRequest(key="fx-1")).found
    rec = ledger.GetRun(pb.GetRunRequest(run_id="R")).run
    assert rec.checkpoint_ref.key == "R/cp" and rec.version == run.version + 1


def test_a_stale_fence_applies_nothing(ledger: Any, es: Any, clock: ManualClock) -> None:
    old = acquire(ledger, "a")
    clock.advance(2 * TTL)
    new = acquire(ledger, "b")  # takeover
    fence = epb.Fence(run_id="R", fencing_token=old.fencing_token)
    req = pb.TransactionRequest(fence=fence, commands=checkpoint_step(old, 7))
    err = expect(ledger.Transact, req, FP, "RUN_LEASE_LOST", has_record=True)
    assert err.record is not None and err.record.fencing_token == new.fencing_token
    assert err.metadata["command_index"] == "0" and "commands[0]" in err.message
    nothing_of_step(es, ledger, 7, new.version)


def test_a_refusal_anywhere_rolls_back_the_commands_before_it(ledger: Any, es: Any) -> None:
    run = acquire(ledger)
    commands = checkpoint_step(run, 2)
    commands.insert(3, pb.Command(id=9, update_run=epb.EngineUpdateRunRequest(id="no-such-run")))
    fence = epb.Fence(run_id="R", fencing_token=run.fencing_token)
    err = expect(ledger.Transact, pb.TransactionRequest(fence=fence, commands=commands),
                 grpc.StatusCode.NOT_FOUND, "RUN_NOT_FOUND", field="commands[3].id")
    assert err.metadata["command_index"] == "3"
    nothing_of_step(es, ledger, 2, run.version)
    # the ledger command after the refusal was not applied either, nor the one
    # before it in a transaction that fails at its end
    commands = checkpoint_step(run, 3)
    commands.append(pb.Command(id=10, renew=pb.RenewRequest(
        run_id="R", owner="a", fencing_token=run.fencing_token + 5)))
    expect(ledger.Transact, pb.TransactionRequest(commands=commands), FP, "RUN_LEASE_LOST")
    nothing_of_step(es, ledger, 3, run.version)


def test_the_fence_is_checked_before_every_command(ledger: Any, es: Any) -> None:
    """A command that ends the lease ends the fence for the commands after it."""
    run = acquire(ledger)
    fence = epb.Fence(run_id="R", fencing_token=run.fencing_token)
    finish = pb.Command(id=1, finish=pb.FinishRequest(
        run_id="R", owner="a", fencing_token=run.fencing_token,
        status=rpb.RunStatus.RUN_STATUS_COMPLETED))
    late = pb.Command(id=2, put_effect=epb.EnginePutEffectRequest(key="late", result=J(1)))
    err = expect(ledger.Transact, pb.TransactionRequest(fence=fence, commands=[finish, late]),
                 FP, "RUN_LEASE_LOST")
    assert err.metadata["command_index"] == "1"
    assert not es.GetEffect(epb.EngineGetEffectRequest(key="late")).found
    assert ledger.GetRun(pb.GetRunRequest(run_id="R")).run.version == run.version  # not finished
    # the other order commits: write, then finish
    resp = ledger.Transact(pb.TransactionRequest(fence=fence, commands=[late, finish]))
    assert [r.id for r in resp.results] == [2, 1]
    assert es.GetEffect(epb.EngineGetEffectRequest(key="late")).found


def test_a_lock_fenced_transaction(ledger: Any, es: Any, clock: ManualClock) -> None:
    lock = es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="a", ttl_ms=TTL))
    fence = epb.Fence(lock_key="LK", fencing_token=lock.fencing_token)
    cmds = [
        pb.Command(id=1, kv_set=epb.EngineKvSetRequest(agent="ag", key="k", value=J(1))),
        pb.Command(id=2, doc_upsert=epb.EngineDocUpsertRequest(
            agent="ag", collection="c", id="d", doc=J({"v": 1}))),
    ]
    ledger.Transact(pb.TransactionRequest(fence=fence, commands=cmds))
    clock.advance(2 * TTL)
    es.AcquireLock(epb.EngineAcquireLockRequest(key="LK", owner="b", ttl_ms=TTL))
    cmds[0].kv_set.value.json = "2"
    err = expect(ledger.Transact, pb.TransactionRequest(fence=fence, commands=cmds[:1]),
                 FP, "LOCK_LOST")
    assert err.metadata["owner"] == "b"
    got = es.KvGet(epb.EngineKvGetRequest(agent="ag", key="k"))
    assert got.value.json == "1"


@pytest.mark.parametrize(
    ("commands", "field"),
    [
        ([], "commands"),
        ([pb.Command(id=1, transaction=pb.TransactionRequest())], "commands[0].transaction"),
        ([pb.Command(id=1)], "commands[0].kind"),
        (
            [pb.Command(id=1, kv_set=epb.EngineKvSetRequest(agent="a", key="k", value=J(1),
                                                            request_id="x"))],
            "commands[0].request_id",
        ),
        (
            [
                pb.Command(id=1, kv_set=epb.EngineKvSetRequest(agent="a", key="k", value=J(1))),
                pb.Command(id=2, save_checkpoint=epb.EngineSaveCheckpointRequest()),
            ],
            "commands[1].checkpoint",
        ),
        (
            [pb.Command(id=i, kv_set=epb.EngineKvSetRequest(agent="a", key="k", value=J(i)))
             for i in range(101)],
            "commands",
        ),
    ],
    ids=["empty", "nested", "no-kind", "own-request-id", "bad-command", "too-many"],
)
def test_bad_transactions_name_the_field(ledger: Any, es: Any, commands: list[pb.Command],
                                         field: str) -> None:
    expect(ledger.Transact, pb.TransactionRequest(commands=commands),
           grpc.StatusCode.INVALID_ARGUMENT, "RUN_VALIDATION_ERROR", field=field)
    assert not es.KvGet(epb.EngineKvGetRequest(agent="a", key="k")).found


def test_a_retried_transaction_gets_its_first_answer(ledger: Any, es: Any,
                                                     clock: ManualClock) -> None:
    run = acquire(ledger)
    fence = epb.Fence(run_id="R", fencing_token=run.fencing_token)
    step = pb.Command(id=1, append_step=epb.EngineAppendStepRequest(
        step=epb.EngineStep(run_id="R", name="once")))
    req = pb.TransactionRequest(fence=fence, commands=[step], request_id="tx-1")
    first = ledger.Transact(req)
    clock.advance(2 * TTL)
    acquire(ledger, "b")  # the fence moved, but a retry is answered, not re-applied
    again = ledger.Transact(req)
    assert again == first
    steps = [s for p in es.ListSteps(epb.EngineListStepsRequest(run_id="R")) for s in p.steps]
    assert len(steps) == 1
    # a refused transaction is remembered as refused
    bad = pb.TransactionRequest(fence=fence, commands=[step], request_id="tx-2")
    e1 = expect(ledger.Transact, bad, FP, "RUN_LEASE_LOST")
    e2 = expect(ledger.Transact, bad, FP, "RUN_LEASE_LOST")
    assert (e1.message, e1.metadata) == (e2.message, e2.metadata)


async def test_a_refused_transaction_does_not_disturb_its_neighbours(server: Any) -> None:
    """In one Execute message (one writer batch): a stale transaction, then a
    plain write and a current transaction; only the stale one is refused."""
    async with grpc.aio.insecure_channel(server.address) as ch:
        ledger = ledger_pb2_grpc.LedgerStub(ch)
        es = engine_store_pb2_grpc.EngineStoreStub(ch)
        run = (await ledger.Acquire(pb.AcquireRequest(run_id="R", owner="a"))).run
        stale = epb.Fence(run_id="R", fencing_token=run.fencing_token + 1)
        good = epb.Fence(run_id="R", fencing_token=run.fencing_token)

        def tx(cid: int, fence: epb.Fence, key: str) -> pb.Command:
            return pb.Command(id=cid, transaction=pb.TransactionRequest(fence=fence, commands=[
                pb.Command(id=1, put_effect=epb.EnginePutEffectRequest(key=key, result=J(1))),
                pb.Command(id=2, renew=pb.RenewRequest(run_id="R", owner="a",
                                                       fencing_token=run.fencing_token)),
            ]))

        results = await run_all(ledger, pb.ExecuteRequest(commands=[
            tx(1, stale, "stale"),
            pb.Command(id=2, put_effect=epb.EnginePutEffectRequest(key="plain", result=J(1))),
            tx(3, good, "good"),
        ]))
        assert results[1].WhichOneof("kind") == "error"
        assert results[2].WhichOneof("kind") == "put_effect"
        assert [r.WhichOneof("kind") for r in results[3].transaction.results] == [
            "put_effect", "renew"]
        found = {k: (await es.GetEffect(epb.EngineGetEffectRequest(key=k))).found
                 for k in ("stale", "plain", "good")}
        assert found == {"stale": False, "plain": True, "good": True}
        rec = (await ledger.GetRun(pb.GetRunRequest(run_id="R"))).run
        assert rec.version == run.version + 1  # one renew: the good transaction's
