"""Whether this coordinator serves: on a SQLite file it leads from the start;
on PostgreSQL it campaigns as a standby, takes over (load, extend the live
leases by the time nobody led), serves, renews, and is deposed when it loses
the leader row or a batch finds the epoch moved. Every servicer asks ``gate``
first; the App hands in what serving and being deposed mean for the rest."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

from ..clock import Clock
from ..core import ledger as L
from ..core.errors import Code, LedgerError
from ..writer import Writer

if TYPE_CHECKING:
    from ..storage.postgres import PostgresStorage
    from .leadership import Leadership
    from .sharded import ShardedLeading

log = logging.getLogger("fencepost")


class Coordinator:
    def __init__(
        self,
        clock: Clock,
        *,
        prepare: Callable[[], Awaitable[None]],
        serving: Callable[[], Awaitable[None]],
        deposed: Callable[[], None],
    ) -> None:
        """Once the state is loaded: ``prepare`` (sweep, retention), then this
        coordinator leads, then ``serving`` (health says SERVING). ``deposed``
        once leadership is lost (streams end, NOT_SERVING)."""
        self.clock = clock
        self.leadership: Leadership | None = None  # PostgreSQL: set by ``lead``
        self.sharded: ShardedLeading | None = None  # --lead-shards: set by ``lead_shards``
        self._prepare = prepare
        self._serving = serving
        self._on_deposed = deposed
        self.leading = False
        # set when this coordinator stops leading; ``serve`` then exits with code 3
        self.deposed = asyncio.Event()

    async def lead_alone(self) -> None:
        """SQLite: the only coordinator; the writer has loaded the state."""
        await self._serve()

    async def lead_shards(self, sharded: ShardedLeading) -> None:
        """--lead-shards: serve at once, leading the shards as they are taken
        (ha/sharded.py); the others are refused with NOT_OWNER."""
        self.sharded = sharded
        await sharded.start()
        await self._serve()

    async def _serve(self) -> None:
        await self._prepare()
        self.leading = True
        await self._serving()

    def lead(self, leadership: Leadership, storage: PostgresStorage, writer: Writer,
             describe: Callable[[], str]) -> Coroutine[Any, Any, None]:
        """Standby until this coordinator takes over; then load, extend the
        live leases by the time the coordinator was unavailable, serve, and
        renew until leadership is lost (then ``deposed`` is set). The
        leadership counts from this call: the gate refuses until it leads."""
        self.leadership = leadership
        return self._lead(leadership, storage, writer, describe)

    async def _lead(self, ld: Leadership, storage: PostgresStorage, writer: Writer,
                    describe: Callable[[], str]) -> None:
        try:
            takeover = await ld.campaign()
            storage.lead(takeover.epoch)
            keeper = asyncio.create_task(ld.keep(), name="fencepost-leader-renewal")
            started = time.perf_counter()
            await writer.start()
            log.info("taking over (epoch %d): loaded revision %d, %d runs in %.2f s",
                     takeover.epoch, writer.state.revision, len(writer.state.index),
                     time.perf_counter() - started)
            if takeover.gap_ms:
                extended = await writer.submit(
                    L.ExtendLeases(takeover.gap_ms, self.clock.now_ms() - takeover.gap_ms)
                )
                assert isinstance(extended, L.LeasesExtended)
                log.info("epoch %d: extended %d leases and %d claims and locks by %d ms",
                         takeover.epoch, extended.runs, extended.others, takeover.gap_ms)
            if ld.leading:
                await self._serve()
                log.info(
                    "leading (epoch %d) on %s after %s; loaded revision %d, %d runs in %.2f s; "
                    "leases extended by %d ms",
                    takeover.epoch, ld.address, takeover.previous or "a fresh database",
                    writer.state.revision, len(writer.state.index),
                    time.perf_counter() - started, takeover.gap_ms,
                )
                log.info("fencepost serving on %s", describe())
            why = await keeper
        except asyncio.CancelledError:
            raise
        except (LedgerError, RuntimeError, *storage.ERRORS) as exc:  # a database failure
            why = f"could not take over: {exc}"
            log.error("taking over failed: %s", exc)
        except Exception as exc:  # could not load or extend: not leading
            why = f"could not take over: {exc}"
            log.exception("taking over failed")
        self.depose(why)

    def depose(self, why: str) -> None:
        """Leadership is lost: refuse everything from now on (``deposed``)."""
        if self.leadership is not None:
            self.leadership.lose(why)
        self.leading = False
        self._on_deposed()
        self.deposed.set()

    def on_failed_commit(self, exc: LedgerError) -> None:
        moved = exc.metadata.get("moved") if exc.metadata else None
        if moved and self.sharded is not None:
            self.sharded.moved_during_batch([int(s) for s in moved.split(",")])
            return
        if exc.code is Code.NOT_LEADER and self.leadership is not None:
            self.depose("a batch found the epoch moved: another coordinator took over")

    def memory_ok(self) -> bool:
        """A renewal is answered from memory only while this coordinator is
        sure it leads (docs/SPEC.md §9.1); else it goes to the epoch check."""
        if self.sharded is not None:
            return self.leading and self.sharded.memory_ok()
        return self.leading and self.leadership is not None and self.leadership.leading

    def gauge(self) -> tuple[int, int]:
        """(leading, epoch) for the metrics."""
        ld = self.leadership
        if ld is None:
            return int(self.leading), 0
        return int(self.leading and ld.leading), ld.epoch or 0

    def shard_stats(self) -> tuple[int, int, int] | None:
        """--lead-shards: (shards led, taken, given up); None otherwise."""
        sh = self.sharded
        return None if sh is None else (len(sh.led), sh.takeovers, sh.moves)

    def gate(self) -> LedgerError | None:
        """None while this coordinator leads; else why it refuses (NOT_LEADER)."""
        if self.sharded is not None and not self.leading:  # not open yet
            from ..storage.postgres import NotLeader

            return NotLeader("")
        ld = self.leadership
        if ld is None or (self.leading and ld.leading):
            return None
        from ..storage.postgres import NotLeader  # loaded: only PostgreSQL has a leadership

        leader = ld.leader_address
        return NotLeader("" if leader == ld.address else leader)

    async def close(self) -> None:
        """After the writer has closed: hand leadership over at once (a
        standby takes over without waiting for the lease), then disconnect."""
        if self.sharded is not None:
            self.leading = False
            await self.sharded.close()
        if self.leadership is not None:
            if self.leading and self.leadership.leading:
                await self.leadership.resign()
            self.leading = False
            await self.leadership.close()
