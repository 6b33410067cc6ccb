"""The committed state the writer moves after each commit, its change events
and its counters: read by handlers on the event loop, moved only by the writer."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.placement import shard_keys
from ..core.records import Record
from ..core.shards import shard_of
from .index import RunIndex


@dataclass(slots=True)
class ChangeEvent:
    """One committed change to one record, in revision order."""

    revision: int
    kind: int  # KIND_PUT or KIND_DELETE
    run_id: str
    record: Record | None  # the new record (PUT) or None (DELETE)
    previous: Record | None  # the record before this change
    cause: type  # the command class that made the change (L.Acquire, L.Cancel...)


@dataclass
class LedgerState:
    """The committed state, read by handlers on the event loop. Only the writer
    task moves it, and only after a commit."""

    # The runs held in memory ("hot"): every unfinished run, and finished ones
    # until the runs table reflects them; then they are read from there on
    # demand (``Reads.read_runs``). ``index`` knows every run, hot or not.
    runs: dict[str, Record] = field(default_factory=dict)
    tombstones: dict[str, int] = field(default_factory=dict)
    revision: int = 0
    index: RunIndex = field(default_factory=RunIndex)  # ListRuns: by id, status, owner
    # Changes at or below this revision are no longer retained (watch floor).
    compacted: int = 0


@dataclass
class WriterStats:
    batches: int = 0
    commands: int = 0
    failed_commits: int = 0
    max_batch: int = 0
    commit_seconds: float = 0.0
    held: int = 0  # batches held open by the commit delay
    held_in_vain: int = 0  # of those, the ones that gathered nothing
    held_to_window: int = 0  # of those, the ones the window ended (not the target)
    memory_renewals: int = 0  # renewals answered from memory, no commit
    leases_flushed: int = 0  # lease expiries copied into the runs table

    @property
    def mean_batch(self) -> float:
        return self.commands / self.batches if self.batches else 0.0


# Keys whose shard a tally remembers, at most: a run's commands (acquire,
# renewals, checkpoints, finish) then hash its id once, not each time.
TALLY_REMEMBERS = 65_536


class ShardTally:
    """Commands per shard (each shard a command writes or checks counts it
    once; a command with no shard of its own counts nowhere). One tally per
    thread that adds to it: the writer thread's and the event loop's."""

    __slots__ = ("_known", "counts")

    def __init__(self, shards: int = 0) -> None:
        self.counts = [0] * shards
        self._known: dict[str, int] = {}

    def add(self, cmd: object) -> None:
        counts = self.counts
        if not counts:
            return
        keys = shard_keys(cmd)
        if not keys:
            return
        if len(keys) == 1:
            counts[self._shard(keys[0])] += 1
        else:
            for s in {self._shard(k) for k in keys}:
                counts[s] += 1

    def _shard(self, key: str) -> int:
        known = self._known
        shard = known.get(key)
        if shard is None:
            if len(known) >= TALLY_REMEMBERS:
                known.clear()
            shard = known[key] = shard_of(key, len(self.counts))
        return shard
