"""Ordered indexes over the committed ledger runs, for ListRuns.

Every run id is kept in one sorted list, and again in one per status and one
per lease owner, so a page filtered by status or owner walks only the runs
that match (its cost follows the matches, not the table), and adding a run
costs O(log n) whatever order ids arrive in (``sortedcontainers.SortedList``:
a list of sorted sublists, so an insert never shifts the whole table as
``bisect.insort`` into one list does).

Only the writer task changes an index, on the event loop, right after a
commit, together with the runs dict it mirrors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from sortedcontainers import SortedList

from .core.records import Record, Status


def _owner(rec: Record) -> str | None:
    return rec.lease.owner if rec.lease is not None else None


class RunIndex:
    __slots__ = ("by_owner", "by_status", "ids")

    def __init__(
        self, runs: Iterable[Record] = (),
        cold: Iterable[tuple[int, str | None, list[str]]] = (),
    ) -> None:
        """``runs``: records; ``cold``: groups (status, lease owner, run ids) of
        runs known by their index entries alone (not held in memory), the ids
        in any order (sorted costs least). No id may be in two groups, or among
        ``runs`` too."""
        # Built in bulk, not one insert at a time, and with no Python work per
        # cold run: a group joins the lists whole, and each list is sorted once.
        # The databases hand every group over in id order, so a sort only
        # merges a few sorted runs (timsort: close to linear time; ids in
        # random order would cost a full n log n sort per list).
        ids: list[str] = []
        status: dict[int, list[str]] = {}
        owners: dict[str, list[str]] = {}
        for rec in runs:
            ids.append(rec.run_id)
            status.setdefault(rec.status, []).append(rec.run_id)
            owner = _owner(rec)
            if owner is not None:
                owners.setdefault(owner, []).append(rec.run_id)
        for st, owner, group in cold:
            ids += group
            status.setdefault(st, []).extend(group)
            if owner is not None:
                owners.setdefault(owner, []).extend(group)
        self.ids: SortedList = SortedList(ids)
        self.by_status: dict[Status, SortedList] = {
            Status(k): SortedList(v) for k, v in status.items() if v
        }
        self.by_owner: dict[str, SortedList] = {k: SortedList(v) for k, v in owners.items() if v}

    def __len__(self) -> int:
        return len(self.ids)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.ids

    def __iter__(self) -> Iterator[str]:
        return iter(self.ids)

    def update(self, old: Record | None, new: Record | None) -> None:
        """Move one run from its old record's entries to its new one's (None:
        absent before / deleted now). Set-like: an entry is added only when
        missing and dropped only when present, so applying the same move twice
        changes nothing more."""
        run_id = (new or old).run_id  # type: ignore[union-attr]
        if old is None and new is not None:
            self._add(self.ids, run_id)
        elif old is not None and new is None:
            self.ids.discard(run_id)
        old_status = old.status if old is not None else None
        new_status = new.status if new is not None else None
        if old_status != new_status:
            if old_status is not None:
                self._drop(self.by_status, old_status, run_id)
            if new_status is not None:
                self._add(self.by_status.setdefault(new_status, SortedList()), run_id)
        old_owner = _owner(old) if old is not None else None
        new_owner = _owner(new) if new is not None else None
        if old_owner != new_owner:
            if old_owner is not None:
                self._drop(self.by_owner, old_owner, run_id)
            if new_owner is not None:
                self._add(self.by_owner.setdefault(new_owner, SortedList()), run_id)

    @staticmethod
    def _add(ids: SortedList, run_id: str) -> None:
        if run_id not in ids:
            ids.add(run_id)

    @staticmethod
    def _drop(table: dict, key: object, run_id: str) -> None:
        ids = table.get(key)
        if ids is None:
            return
        ids.discard(run_id)
        if not ids:
            del table[key]

    def walk(
        self,
        statuses: frozenset[Status],
        owner: str,
        *,
        prefix: str = "",
        after: str | None = None,
        before: str | None = None,
        reverse: bool = False,
    ) -> Iterator[str]:
        """Like ``candidates``, within the ids starting with ``prefix``: past
        ``after`` going forward, or below ``before`` going backward
        (``reverse``), from the narrowest index the filters allow."""
        top = prefix + "\U0010ffff" if prefix else None

        def bounded(ids: SortedList) -> Iterator[str]:
            if reverse:
                high = before if before is not None and (top is None or before < top) else top
                return ids.irange(minimum=prefix or None, maximum=high,
                                  inclusive=(True, False), reverse=True)
            if after is not None and after >= prefix:
                return ids.irange(minimum=after, maximum=top, inclusive=(False, False))
            return ids.irange(minimum=prefix or None, maximum=top, inclusive=(True, False))

        if owner:
            return bounded(self.by_owner.get(owner, SortedList()))
        if statuses:
            lists = [self.by_status[s] for s in statuses if s in self.by_status]
            if len(lists) == 1:
                return bounded(lists[0])
            return heapq.merge(*(bounded(ids) for ids in lists), reverse=reverse)
        return bounded(self.ids)

    def candidates(
        self, after: str | None, statuses: frozenset[Status], owner: str
    ) -> Iterator[str]:
        """Run ids past ``after`` in order, from the narrowest index the filters
        allow. Every id a filter admits is among them; the caller still checks
        the record (an owner index does not know the statuses, and so on)."""
        return self.walk(statuses, owner, after=after)
