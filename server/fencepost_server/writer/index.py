"""Ordered indexes over the committed ledger runs, for ListRuns.

Every run id is kept in one sorted list per status and one per lease owner,
so a page filtered by status or owner walks only the runs that match (its
cost follows the matches, not the table), and an unfiltered page merges the
few status lists. Adding a run costs O(log n) whatever order ids arrive in
(``sortedcontainers.SortedList``: a list of sorted sublists, so an insert
never shifts the whole table as ``bisect.insort`` into one list does).

A dict says where each run is indexed (its status and owner), so a move
touches only the lists it changes, without searching them first, and asking
whether a run exists costs one hash lookup however many runs there are.

Only the writer task changes an index, on the event loop, right after a
commit, together with the runs dict it mirrors.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator

from sortedcontainers import SortedList

from ..core.records import Record, Status


def _owner(rec: Record) -> str | None:
    return rec.lease.owner if rec.lease is not None else None


class RunIndex:
    __slots__ = ("by_owner", "by_status", "owner_of", "status_of")

    def __init__(
        self, runs: Iterable[Record] = (),
        cold: Iterable[tuple[int, str | None, list[str]]] = (),
    ) -> None:
        """``runs``: records; ``cold``: groups (status, lease owner, run ids) of
        runs known by their index entries alone (not held in memory), the ids
        in any order (sorted costs least). No id may be in two groups, or among
        ``runs`` too."""
        # Built in bulk, not one insert at a time, and with no Python work per
        # cold run: a group joins the lists whole, and each list is sorted once
        # (timsort: close to linear for ids created in order; for a million
        # random ids, which the databases hand over sorted only within each
        # block of the runs table, about 0.5 s while the test machine was
        # busy, against 0.66 s for the same ids in no order at all).
        self.status_of: dict[str, Status] = {}
        self.owner_of: dict[str, str] = {}
        status: dict[Status, list[str]] = {}
        owners: dict[str, list[str]] = {}
        # the largest group makes the dict in one call (a copy into it would
        # cost as much again: 0.23 s against 0.38 s for a million ids)
        for st, owner, group in sorted(cold, key=lambda g: len(g[2]), reverse=True):
            member = Status(st)
            if self.status_of:
                self.status_of.update(dict.fromkeys(group, member))
            else:
                self.status_of = dict.fromkeys(group, member)
            status.setdefault(member, []).extend(group)
            if owner is not None:
                self.owner_of.update(dict.fromkeys(group, owner))
                owners.setdefault(owner, []).extend(group)
        for rec in runs:
            self.status_of[rec.run_id] = rec.status
            status.setdefault(rec.status, []).append(rec.run_id)
            owner = _owner(rec)
            if owner is not None:
                self.owner_of[rec.run_id] = owner
                owners.setdefault(owner, []).append(rec.run_id)
        self.by_status: dict[Status, SortedList] = {
            k: SortedList(v) for k, v in status.items() if v
        }
        self.by_owner: dict[str, SortedList] = {k: SortedList(v) for k, v in owners.items() if v}

    def __len__(self) -> int:
        return len(self.status_of)

    def __contains__(self, run_id: object) -> bool:
        return run_id in self.status_of

    def __iter__(self) -> Iterator[str]:
        """Every run id, in order."""
        return self.walk(frozenset(), "")

    def groups(self, statuses: Iterable[int]) -> list[tuple[int, str | None, list[str]]]:
        """The runs of ``statuses`` as (status, lease owner, run ids in order)
        groups: the form ``cold`` takes, ready to build an index from in
        linear time."""
        out: list[tuple[int, str | None, list[str]]] = []
        owner_of = self.owner_of
        for st in statuses:
            ids = self.by_status.get(Status(st))
            if ids is None:
                continue
            if not owner_of:
                out.append((int(st), None, list(ids)))
                continue
            by_owner: dict[str | None, list[str]] = {}
            for run_id in ids:
                owner = owner_of.get(run_id)
                group = by_owner.get(owner)
                if group is None:
                    by_owner[owner] = [run_id]
                else:
                    group.append(run_id)
            out += [(int(st), owner, group) for owner, group in by_owner.items()]
        return out

    def add_cold(self, groups: Iterable[tuple[int, str | None, list[str]]]) -> None:
        """Index runs known by their index entries alone (``cold``'s groups),
        none indexed yet."""
        for st, owner, ids in groups:
            status = Status(st)
            for run_id in ids:
                self.status_of[run_id] = status
                self._add(self.by_status, status, run_id)
                if owner is not None:
                    self.owner_of[run_id] = owner
                    self._add(self.by_owner, owner, run_id)

    def update(self, run_id: str, new: Record | None) -> None:
        """Index the run as ``new`` says (None: deleted). Where it was indexed
        before comes from the index itself, so applying the same move twice
        changes nothing more, and a run's old entries never linger."""
        status_of = self.status_of
        old_status = status_of.get(run_id)
        old_owner = self.owner_of.get(run_id)
        if new is None:
            if old_status is None:
                return
            del status_of[run_id]
            new_status = new_owner = None
        else:
            new_status, new_owner = new.status, _owner(new)
            status_of[run_id] = new_status
        if old_status is not new_status:
            if old_status is not None:
                self._drop(self.by_status, old_status, run_id)
            if new_status is not None:
                self._add(self.by_status, new_status, run_id)
        if old_owner != new_owner:
            if old_owner is not None:
                del self.owner_of[run_id]
                self._drop(self.by_owner, old_owner, run_id)
            if new_owner is not None:
                self.owner_of[run_id] = new_owner
                self._add(self.by_owner, new_owner, run_id)

    @staticmethod
    def _add(table: dict, key: object, run_id: str) -> None:
        ids = table.get(key)
        if ids is None:
            table[key] = SortedList((run_id,))
        else:
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
            owned = self.by_owner.get(owner)
            return bounded(owned) if owned is not None else iter(())
        lists = [ids for s, ids in self.by_status.items() if not statuses or s in statuses]
        if len(lists) == 1:
            return bounded(lists[0])
        return heapq.merge(*(bounded(ids) for ids in lists), reverse=reverse)

    def candidates(
        self, after: str | None, statuses: frozenset[Status], owner: str
    ) -> Iterator[str]:
        """Run ids past ``after`` in order, from the narrowest index the filters
        allow. Every id a filter admits is among them; the caller still checks
        the record (an owner index does not know the statuses, and so on)."""
        return self.walk(statuses, owner, after=after)
