"""Where a command's items are: the shard keys of everything it writes or
checks (docs/SPEC.md "Shards", the table of shard keys). Pure.

A command names its items by their shard keys; a fence adds the run or
lock it is keyed by; a transaction is the union of its commands and its
fence. ``None`` means the command has no shard of its own: the server's
sweeps over every shard, and the few writes that name no run (an artifact
deleted by id, a chunk staged or discarded by upload id).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from . import engine as E
from . import ledger as L
from .errors import LedgerError, not_owner, validation
from .fence import Fence
from .shards import compound_key, shard_of


def _run_id(cmd: Any) -> tuple[str, ...]:
    return (cmd.run_id,)


def _id(cmd: Any) -> tuple[str, ...]:
    return (cmd.id,)


def _key(cmd: Any) -> tuple[str, ...]:
    return (cmd.key,)


def _none(cmd: Any) -> None:
    return None


_KEYS: dict[type, Callable[[Any], tuple[str, ...] | None]] = {
    **dict.fromkeys(
        (L.Acquire, L.Renew, L.RecordCheckpoint, L.Suspend, L.Finish, L.Release, L.Cancel,
         L.RequestResume, L.DeleteRun, L.Retire, L.RawCreate, L.RawCompareAndSet, L.RawDelete,
         E.AppendStep, E.SaveCheckpoint, E.CommitArtifact),
        _run_id),
    **dict.fromkeys((E.CreateRun, E.UpdateRun, E.ClaimRun, E.RenewClaim), _id),
    **dict.fromkeys((E.AcquireLock, E.ReleaseLock, E.PutEffect), _key),
    E.ClaimKey: lambda c: (compound_key(c.scope, c.key),),
    E.KvSet: lambda c: (compound_key(c.agent, c.key),),
    E.DocUpsert: lambda c: (compound_key(c.agent, c.collection),),
    E.DocDelete: lambda c: (compound_key(c.agent, c.collection),),
    **dict.fromkeys(
        (E.DeleteArtifact, E.StageChunk, E.DiscardUpload, E.SweepUploads, L.ExtendLeases,
         L.TakeShards), _none),
}


def fence_key(fence: Fence) -> str:
    """The shard key of what a fence is keyed by: its run, or its lock."""
    return fence.run_id or fence.lock_key


def shard_keys(cmd: Any) -> tuple[str, ...] | None:
    """The shard keys of the items ``cmd`` writes or checks (repeats
    possible), or None when it has no shard of its own (as has a command
    type without a rule: a test's executor; every product command has one)."""
    if type(cmd) is L.Transaction:
        keys: list[str] = []
        for inner in cmd.commands:
            got = shard_keys(inner)
            if got is None:
                return None
            keys.extend(got)
        if cmd.fence is not None:
            keys.append(fence_key(cmd.fence))
        return tuple(keys)
    keys_of = _KEYS.get(type(cmd), _none)(cmd)
    fence = getattr(cmd, "fence", None)
    if keys_of is None or fence is None:
        return keys_of
    return (*keys_of, fence_key(fence))


def shards_of(cmd: Any, shards: int) -> frozenset[int] | None:
    """The shards ``cmd`` writes or checks among ``shards``, or None (see
    ``shard_keys``)."""
    keys = shard_keys(cmd)
    if keys is None:
        return None
    return frozenset(shard_of(k, shards) for k in keys)


def command_types() -> frozenset[type]:
    """Every command type with a rule (Transaction included)."""
    return frozenset((*_KEYS, L.Transaction))


class Ownership:
    """Which shards this coordinator leads, and who leads each of the others
    (address, epoch): a command keyed in a shard it does not lead is refused
    with NOT_OWNER naming that shard's owner. Immutable: a change of
    ownership replaces the whole object."""

    __slots__ = ("led", "owners", "shards")

    def __init__(self, shards: int, led: Iterable[int],
                 owners: Mapping[int, tuple[str, int]]) -> None:
        self.shards = shards
        self.led = frozenset(led)
        self.owners = dict(owners)

    def refusal(self, cmd: Any) -> LedgerError | None:
        """NOT_OWNER for the first shard ``cmd`` touches that is not led here
        (None: every one is, or the command has no shard of its own); a
        validation error naming the shards when they are led by different
        coordinators, known to be (no coordinator could commit it)."""
        got = shards_of(cmd, self.shards)
        if got is None or got <= self.led:
            return None
        away = got - self.led
        owners = {self.owners.get(s, ("", 0))[0] for s in away}
        if (away != got or len(owners) > 1) and "" not in owners:
            led = sorted(got - away)
            where = "; ".join(
                [f"shards {', '.join(map(str, led))} here"] * bool(led)
                + [f"shard {s} at {self.owners[s][0]}" for s in sorted(away)])
            return validation(
                "commands" if type(cmd) is L.Transaction else "fence",
                f"touches shards led by different coordinators ({where}); a write must stay "
                "within one coordinator's shards (docs/SPEC.md §13): nothing was done")
        return self._not_owner(min(away))

    def refusal_for_key(self, key: str) -> LedgerError | None:
        """NOT_OWNER when the item with shard key ``key`` is not led here."""
        shard = shard_of(key, self.shards)
        return None if shard in self.led else self._not_owner(shard)

    def refusal_for_shard(self, shard: int) -> LedgerError | None:
        """NOT_OWNER when ``shard`` is not led here."""
        return None if shard in self.led else self._not_owner(shard)

    def _not_owner(self, shard: int) -> LedgerError:
        owner, epoch = self.owners.get(shard, ("", 0))
        return not_owner(shard, owner, epoch)
