"""A coordinator leading the shards assigned to it, with the others of the
database leading the rest (``fencepost serve --lead-shards``; SPEC §13).

``ShardLeases`` (shards.py) takes, renews and loses shard rows; this object
turns what each round did into the writer's state, one change at a time:

- **taken**: the shard's epoch joins the batches' check, the writer loads
  its runs and extends their leases durably (``Writer.take``), and only then
  does the ownership admit its commands;
- **lost** (another coordinator bumped its epoch, or the rows were not
  renewed in time): the ownership refuses its commands at once, every batch
  already accepted is answered (those that touch it fail the check), then
  its runs leave memory and its KeepAlive tracks end as moved, not lost;
- **surplus** (assigned to another coordinator that joined): the same as
  lost, but every command accepted is committed first, and the row is then
  released so the new owner takes it on its next round without waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..core.errors import LedgerError
from ..core.placement import Ownership

if TYPE_CHECKING:
    from ..storage.postgres import PostgresStorage
    from ..writer import Writer
    from .leadership import Takeover
    from .shards import Owner, ShardLeases

log = logging.getLogger("fencepost.shards")

# After handing every shard over on SIGTERM, how long a coordinator still
# answers (NOT_OWNER, naming each shard's new owner) before its streams end.
LINGER_S = 0.2
TAKE_ATTEMPTS = 3  # loading a taken shard; then it is released for another to take


class ShardedLeading:
    def __init__(self, leases: ShardLeases, storage: PostgresStorage, writer: Writer,
                 moved: Callable[[frozenset[int], list[str]], None]) -> None:
        """``moved``: called with the shards given up and their run ids (their
        KeepAlive tracks and watches end: the lease moved with its shard)."""
        self.leases = leases
        self.storage = storage
        self.writer = writer
        self._moved = moved
        self._changes: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        self.led: frozenset[int] = frozenset()  # admitted by the ownership
        self.loaded: frozenset[int] = frozenset()  # held in the writer's memory
        self._leaving: set[int] = set()  # lost or handed over, not yet given up
        self.takeovers = 0
        self.moves = 0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """The writer opens (converting the database the first time); then
        the rounds start. Serving from here on: a shard not led is NOT_OWNER."""
        self.writer.lead_only(Ownership(self.storage.shards, (), {}))
        self.writer.lead_while(self.memory_ok)
        await self.writer.start()
        self._tasks = [
            asyncio.create_task(self._apply_changes(), name="fencepost-shard-changes"),
            asyncio.create_task(self.leases.run(self._taken, self._lost, self._round),
                                name="fencepost-shard-leases"),
        ]

    # -- from the rounds (loop) ---------------------------------------------------

    def _taken(self, taken: dict[int, Takeover]) -> None:
        self._changes.put_nowait(("take", taken))

    def _lost(self, shards: list[int], why: str) -> None:
        self._refuse(shards)
        self._changes.put_nowait(("lost", frozenset(shards)))

    def _round(self) -> None:
        surplus = [s for s in self.leases.surplus if s in self.loaded]
        if surplus:
            self._refuse(surplus)
            self._changes.put_nowait(("handover", frozenset(surplus)))
        else:
            self._publish()

    def moved_during_batch(self, shards: list[int]) -> None:
        """A batch found these shards' epochs moved: they are lost."""
        held = [s for s in shards if s in self.storage.sharing_state.epochs]
        if held:
            log.error("lost shards %s: a batch found their epoch moved", held)
            self._lost(held, "a batch found the epoch moved")

    # -- one change at a time ----------------------------------------------------

    async def _apply_changes(self) -> None:
        while True:
            kind, what = await self._changes.get()
            try:
                if kind == "take":
                    await self._take(what)  # type: ignore[arg-type]
                else:
                    await self._give_up(what, release=kind == "handover")  # type: ignore[arg-type]
            except asyncio.CancelledError:
                raise
            except Exception:
                # the shards stay out of the ownership; their rows run out and
                # a coordinator takes them (maybe this one, on a later round)
                log.exception("could not %s shards", "take" if kind == "take" else "give up")

    async def _take(self, taken: dict[int, Takeover]) -> None:
        shards = frozenset(taken)
        state = self.storage.sharing_state
        # checked from the next batch on (none of theirs is admitted yet)
        state.epochs = {**state.epochs, **{s: t.epoch for s, t in taken.items()}}
        started = time.perf_counter()
        gaps = {s: t.gap_ms for s, t in taken.items()}
        self.loaded = self.loaded | shards
        for attempt in range(TAKE_ATTEMPTS):
            try:
                done = await self.writer.take(shards, gaps)
                break
            except LedgerError as exc:  # (the database, or a shard taken again meanwhile)
                log.warning("could not load shards %s: %s", sorted(shards), exc.message)
                if attempt == TAKE_ATTEMPTS - 1:  # let another coordinator have them
                    await self._give_up(shards, release=True)
                    return
                await asyncio.sleep(0.2 * (attempt + 1))
        self.led = self.led | (shards - self._leaving)
        self.takeovers += len(shards)
        self._publish()
        log.info("leading shards %s: %d leases extended (%d claims and locks) in %.3f s, "
                 "from revision %d", sorted(shards), done.runs, done.others,
                 time.perf_counter() - started, done.first_revision)

    async def _give_up(self, shards: frozenset[int], *, release: bool,
                       handing: bool = False) -> None:
        self._leaving -= shards
        shards = shards & self.loaded
        if not shards:
            return
        self.led = self.led - shards
        # (if this raises, they stay loaded: a later take forgets what memory holds first)
        gone = await self.writer.drop(shards)
        self.loaded = self.loaded - shards
        state = self.storage.sharing_state
        state.epochs = {s: e for s, e in state.epochs.items() if s not in shards}
        self._moved(shards, gone)
        self.moves += len(shards)
        if release:
            await self.leases.release(shards)
        log.info("%s shards %s (%d runs)", "handed over" if release or handing else "gave up",
                 sorted(shards), len(gone))

    def _refuse(self, shards: list[int]) -> None:
        """Refuse the shards' commands from now on."""
        self._leaving.update(shards)
        self.led = self.led - frozenset(shards)
        self._publish()

    def _publish(self) -> None:
        owners = named_owners(self.leases.address, self.led, self.leases.assigned_to,
                              self.leases.owners())
        self.writer.lead_only(Ownership(self.storage.shards, self.led, owners))
        self.writer.leads_shard_zero(0 in self.led)

    # -- the rest of the coordinator asks ----------------------------------------

    def memory_ok(self) -> bool:
        """Renewals from memory only while the shard rows are surely held."""
        return time.monotonic() < self.leases.valid_until

    async def hand_over_all(self) -> None:
        """A clean stop (SIGTERM), while still answering: no more rounds; every
        shard handed over as to a joining coordinator; the members left, so
        the others take the shards at once (they are told: NOTIFY)."""
        await self._stop_tasks()
        shards = self.loaded
        self.leases.assign_without_me()  # the refusals name who takes each shard
        self._refuse(list(shards))
        try:
            await self._give_up(shards, release=False, handing=True)
        finally:
            await self.leases.resign()
        if shards:  # still answering a moment: calls on their way are sent on, not cut off
            await asyncio.sleep(LINGER_S)

    async def _stop_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks = []

    async def close(self) -> None:
        """After the writer has closed: give every shard still held up at once
        and leave the members (after ``hand_over_all``: nothing is left)."""
        await self._stop_tasks()
        await self.leases.resign()
        await self.leases.close()


def named_owners(me: str, led: frozenset[int], assigned_to: dict[int, str],
                 rows: dict[int, Owner]) -> dict[int, tuple[str, int]]:
    """The owner a refusal names for each shard (address, epoch): its row's
    holder; for one held here but not admitted, the member it is handed to;
    for one on its way here, none (the client asks here again shortly), so
    two coordinators mid-move never send a client back and forth."""
    named = {}
    for s, o in rows.items():
        if s in led or (o.address != me and assigned_to.get(s) != me):
            named[s] = (o.address, o.epoch)
        else:
            to = assigned_to.get(s, me)
            named[s] = ("" if to == me else to, o.epoch)
    return named
