"""The committed state the writer moves after each commit, its change events
and its counters: read by handlers on the event loop, moved only by the writer."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..core.records import Record
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
