"""One client's way to its coordinators, handed to everything that talks to them.

A ``Connection`` holds the endpoints (the channel of each, opened on first
use, and the one believed to lead: ``_endpoints``), the Execute dispatcher
that carries mutations (``_execute``; None when every call is unary) and the
retry policy. ``Client`` makes one and hands the same object to its engine
store (``AsyncStore``) and to its renewer (``_renewal``); a store made on its
own makes one of its own. Each of them reaches the coordinators only through
what it is handed: nobody sets another's attributes.

Shards (docs/SPEC.md "Shards"). Every call goes to the endpoints given
until a coordinator refuses one with NOT_OWNER: it leads only some shards.
From then on the connection routes (``Router``): it keeps the map
(``Ledger.Shards``, fetched from the owner the refusal named or the
endpoints given; fetched again on a later NOT_OWNER at most every
``MAP_REFRESH_S``, and whenever the named owner is not in it) and sends each
call to the owner of its first shard key (``_placement``), over a ``Line``
of that coordinator's own: its channel and Execute dispatcher (the renewer
keeps a KeepAlive stream per line). A call refused with NOT_OWNER goes to the
owner it names at once, with its request id (``call_with_retry``); a call
with no shard of its own goes to the endpoints given. A client that never
meets NOT_OWNER keeps exactly one line and never asks for the map.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import grpc

from ._endpoints import Endpoint, Endpoints
from ._errors import FencepostError, NotOwnerError
from ._execute import (
    ExecuteDispatcher,
    SharedDispatcher,
    attempt_of,
    open_execute,
    share_key,
)
from ._ids import new_request_id
from ._placement import first_key
from ._retry import Attempt, RetryPolicy, call_with_retry
from ._security import TLS, aio_channel, channel_credentials
from ._shards import shard_of
from .v1 import ledger_pb2, ledger_pb2_grpc

log = logging.getLogger("fencepost")

T = TypeVar("T")

Transport = Literal["stream", "unary"]

# A NOT_OWNER fetches the map again at most this often (seconds), unless it
# names an owner the map does not know.
MAP_REFRESH_S = 0.05
# How long one fetch of the map may take, per coordinator asked.
_MAP_TIMEOUT_S = 5.0


class Line:
    """The way to one coordinator (or to the endpoints given, following
    their leader): its endpoints and the Execute dispatcher of its
    mutations (None: every call unary)."""

    __slots__ = ("dispatcher", "endpoints")

    def __init__(self, endpoints: Endpoints,
                 dispatcher: ExecuteDispatcher | SharedDispatcher | None) -> None:
        self.endpoints = endpoints
        self.dispatcher = dispatcher


class Router:
    """The shard map as this client knows it: the count, and each shard's
    owner address and epoch (from ``Ledger.Shards`` and from each NOT_OWNER,
    whichever names the later epoch)."""

    def __init__(self) -> None:
        self.count = 0  # 0 until a map was fetched
        self.owners: list[str] = []
        self.epochs: list[int] = []
        self.fetched_at = -math.inf
        self.fetches = 0  # maps fetched (diagnostics, tests)
        self._fetching: asyncio.Future[None] | None = None

    def owner_of(self, key: str) -> str:
        """The address of the owner of ``key``'s shard ("" unknown)."""
        if not self.count:
            return ""
        return self.owners[shard_of(key, self.count)]

    def load(self, resp: Any) -> None:
        count = int(resp.shard_count)
        owners, epochs = [""] * count, [0] * count
        for info in resp.shards:
            if 0 <= info.index < count:
                owners[info.index], epochs[info.index] = info.address, int(info.epoch)
        if count == self.count:  # keep a later epoch a refusal told of
            for i in range(count):
                if self.epochs[i] > epochs[i]:
                    owners[i], epochs[i] = self.owners[i], self.epochs[i]
        self.count, self.owners, self.epochs = count, owners, epochs
        self.fetches += 1

    def note(self, exc: NotOwnerError) -> None:
        """What a refusal says of its shard's owner."""
        shard = exc.shard
        if 0 <= shard < self.count and exc.owner and exc.epoch >= self.epochs[shard]:
            self.owners[shard], self.epochs[shard] = exc.owner, exc.epoch

    def stale(self, exc: NotOwnerError, now: float) -> bool:
        """Whether this refusal calls for the map again."""
        if not self.count or now - self.fetched_at >= MAP_REFRESH_S:
            return True
        return bool(exc.owner) and exc.owner not in self.owners


class Connection:
    """Endpoints, dispatcher and retry policy of one client (module docs)."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        retry: RetryPolicy,
        dispatcher: ExecuteDispatcher | SharedDispatcher | None = None,
        owned: bool = True,
        open_line: Callable[[str], Line] | None = None,
    ) -> None:
        self.endpoints = endpoints
        self.retry = retry
        self.dispatcher = dispatcher
        self._owned = owned  # aclose closes the channels (not a caller's own)
        self.line = Line(endpoints, dispatcher)  # the endpoints given
        # a line to one coordinator's address (None: cannot route, a
        # caller's own channel), and those opened, by address
        self._open_line = open_line
        self._lines: dict[str, Line] = {}
        self.router: Router | None = None  # set at the first NOT_OWNER
        self._on_routing: list[Callable[[], None]] = []
        self._leads_all = False  # the endpoints given said they lead every shard

    @classmethod
    def open(
        cls,
        addresses: Sequence[str],
        *,
        retry: RetryPolicy,
        tls: TLS | None = None,
        token: str | None = None,
        options: Sequence[tuple[str, Any]] = (),
        interceptors: Sequence[grpc.aio.ClientInterceptor] = (),
        transport: Transport = "unary",
        window_s: float = 0.0,
        before_open: Callable[[], None] | None = None,
    ) -> Connection:
        """Channels of its own to ``addresses`` (each opened on first use,
        after ``before_open``: a client refuses there when it is closed or on
        another event loop); with ``transport="stream"``, mutations over an
        Execute stream, shared with the other connections of the loop that
        have the same settings (``SharedDispatcher``) where it can be."""
        options = tuple(options)
        chosen = tuple(interceptors)

        def open_channel(address: str) -> grpc.aio.Channel:
            if before_open is not None:
                before_open()
            return aio_channel(address, tls=tls, token=token, options=options,
                               interceptors=chosen or None)

        def check(one: str) -> None:
            channel_credentials(one, tls, token)

        endpoints = Endpoints(addresses, open_channel, check=check)
        dispatcher: ExecuteDispatcher | SharedDispatcher | None = None
        if transport == "stream":
            key = share_key(addresses, tls=tls, token=token, options=options,
                            interceptors=chosen, window_s=window_s, retry=retry)
            dispatcher = (
                ExecuteDispatcher(open_execute, endpoints, window_s=window_s, retry=retry)
                if key is None else SharedDispatcher(key)
            )

        def open_line(address: str) -> Line:
            check(address)  # ValueError: this client may not go there
            one = Endpoints((address,), open_channel, check=check)
            return Line(one, None if transport != "stream" else ExecuteDispatcher(
                open_execute, one, window_s=window_s, retry=retry))

        return cls(endpoints, retry=retry, dispatcher=dispatcher, open_line=open_line)

    @classmethod
    def of_channel(
        cls,
        source: grpc.aio.Channel | Callable[[], grpc.aio.Channel],
        *,
        retry: RetryPolicy,
    ) -> Connection:
        """One endpoint on a channel the caller owns and closes; every call unary."""
        return cls(Endpoints.of_channel(source), retry=retry, owned=False)

    @property
    def current(self) -> Endpoint:
        """The endpoint believed to lead (where the next attempt goes)."""
        return self.endpoints.current

    async def retried(
        self,
        attempt: Callable[[Endpoint, float | None], Awaitable[T]],
        *,
        mutation: bool,
        policy: RetryPolicy | None = None,
        key: str | None = None,
    ) -> T:
        """``attempt`` on the endpoint believed to lead (of the owner of
        ``key``'s shard, once routing), retried and mapped
        (``call_with_retry``)."""
        line = took = self.line if self.router is None else self.line_for(key)

        async def reroute(exc: FencepostError) -> tuple[Endpoints, Attempt[T]] | None:
            nonlocal took
            to = await self._rerouted(exc, key, took)
            if to is None:
                return None
            took = to
            return to.endpoints, attempt

        return await call_with_retry(attempt, policy or self.retry, mutation=mutation,
                                     endpoints=line.endpoints,
                                     reroute=None if self._open_line is None else reroute)

    async def call(
        self,
        rpc_of: Callable[[Endpoint], Callable[..., Any]],
        request: Any,
        *,
        mutation: bool,
        policy: RetryPolicy | None = None,
    ) -> Any:
        """One logical call of the unary RPC ``rpc_of(endpoint)``: a mutation
        gets one request id, reused by every retry, and goes over the Execute
        stream while it is up (unary else); only UNAVAILABLE is retried."""
        if mutation and not request.request_id:
            request.request_id = new_request_id()
        line = took = self.line if self.router is None else self.line_for(first_key(request))
        attempt = attempt_of(line.dispatcher, rpc_of, request, mutation=mutation)

        async def reroute(exc: FencepostError) -> tuple[Endpoints, Attempt[Any]] | None:
            nonlocal took
            to = await self._rerouted(exc, first_key(request), took)
            if to is None:
                return None
            took = to
            return to.endpoints, attempt_of(to.dispatcher, rpc_of, request, mutation=mutation)

        return await call_with_retry(attempt, policy or self.retry, mutation=mutation,
                                     endpoints=line.endpoints,
                                     reroute=None if self._open_line is None else reroute)

    async def ask_at(self, address: str, rpc_of: Callable[[Endpoint], Callable[..., Any]],
                     request: Any) -> Any | None:
        """A read at the coordinator at ``address`` (retried there), or None
        when this client may not go there."""
        line = self.line_to(address)
        if line is None:
            return None
        return await call_with_retry(attempt_of(None, rpc_of, request, mutation=False),
                                     self.retry, mutation=False, endpoints=line.endpoints)

    # -- routing -------------------------------------------------------------------------

    def on_routing(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once, when routing starts (the first NOT_OWNER)."""
        self._on_routing.append(callback)

    def line_for(self, key: str | None) -> Line:
        """The line to the owner of ``key``'s shard (the endpoints given for
        None, or while its owner is not known)."""
        router = self.router
        if key is None or router is None:
            return self.line
        owner = router.owner_of(key)
        return self.line if not owner else (self.line_to(owner) or self.line)

    def line_to(self, address: str) -> Line | None:
        """The line to the coordinator at ``address`` (opened on first use;
        the given endpoint's own when it is that one alone), or None when
        this client may not go there."""
        if self.endpoints.alone and self.endpoints.listed[0] == address:
            return self.line
        line = self._lines.get(address)
        if line is None:
            if self._open_line is None:
                return None
            try:
                line = self._lines[address] = self._open_line(address)
            except ValueError as why:
                log.warning("not routing to %s: %s", address, why)
                return None
        return line

    async def _rerouted(self, exc: FencepostError, key: str | None,
                        took: Line | None = None) -> Line | None:
        """Where a call refused with ``exc`` goes next: the owner it names,
        else the owner the map knows (the map fetched when due). A call a
        coordinator did not answer, once routing, goes where a fresh map
        says its shard is led now (None: where it went)."""
        if not isinstance(exc, NotOwnerError):
            return await self._refollowed(key)
        router = self._start_routing(exc.message)
        loop = asyncio.get_running_loop()
        if router.stale(exc, loop.time()):
            await self._fetch_map(router, exc.owner)
        router.note(exc)
        if exc.owner:
            return self.line_to(exc.owner)
        # no owner named: the one asked is taking the shard (or learning who
        # leads it): ask it again, not the map's (older) owner, which names it
        return took or self.line_for(key)

    def _start_routing(self, why: str) -> Router:
        router = self.router
        if router is None:
            router = self.router = Router()
            log.info("%s; routing each call to its shard's owner", why)
            for callback in self._on_routing:
                callback()
        return router

    async def owners(self) -> list[str] | None:
        """Every coordinator leading shards, for a read across shards; None
        while the endpoints given lead every shard (asked once: their map
        names none led elsewhere) or this client cannot go elsewhere."""
        router = self.router
        if self._open_line is None or (router is None and self._leads_all):
            return None
        if router is None:
            resp = await call_with_retry(_ask_map, self.retry, mutation=False,
                                         endpoints=self.line.endpoints)
            if all(info.owner for info in resp.shards):
                self._leads_all = True
                return None
            router = self._start_routing("the shard map names shards led elsewhere")
            router.load(resp)
            router.fetched_at = asyncio.get_running_loop().time()
        elif not router.count:  # routing, but no map fetched yet (or it failed)
            await self._fetch_map(router, "")
        owners = sorted({address for address in router.owners if address})
        return owners or None  # no map: the endpoints given, as before routing

    async def shard_lines(self, fresh: bool) -> list[Line | None] | None:
        """The line to each shard's owner (None: not known now), for a watch
        by shards, with the map fetched again first when ``fresh``; None while
        the endpoints given lead every shard (or this client cannot route)."""
        if await self.owners() is None:
            return None
        router = self.router
        assert router is not None
        if fresh:
            await self._fetch_map(router, "")
        return [self.line_to(address) if address else None for address in router.owners]

    async def _refollowed(self, key: str | None) -> Line | None:
        """The line to ``key``'s owner by a map fetched from the endpoints
        given (at most every MAP_REFRESH_S): the one the call took again
        while the map still says so (a shard's owner gone quiet is followed
        within moments of its hand-over, not after the policy's backoff);
        None while not routing."""
        router = self.router
        if router is None or key is None:
            return None
        loop = asyncio.get_running_loop()
        if loop.time() - router.fetched_at >= MAP_REFRESH_S:
            await self._fetch_map(router, "")
        return self.line_for(key)

    async def refollow(self) -> None:
        """A coordinator stopped answering (a KeepAlive stream to it broke):
        fetch the map again from the endpoints given, when due, so what it
        led follows its new owner."""
        router = self.router
        if router is None:
            return
        if asyncio.get_running_loop().time() - router.fetched_at >= MAP_REFRESH_S:
            await self._fetch_map(router, "")

    async def learn(self, exc: NotOwnerError) -> None:
        """A refusal met outside a call (a renewal): route, and know of it."""
        await self._rerouted(exc, None)

    async def _fetch_map(self, router: Router, hint: str) -> None:
        """``Ledger.Shards`` from ``hint`` (the owner a refusal named), else the
        endpoints given, else any other coordinator this client has reached
        (the one given may be the one that went away); one fetch at a time
        (the others wait for it). None answering leaves the map as it was."""
        fetching = router._fetching
        if fetching is not None:
            await asyncio.shield(fetching)
            return
        loop = asyncio.get_running_loop()
        fetching = router._fetching = loop.create_future()
        try:
            policy = RetryPolicy.no_retry(attempt_timeout_s=_MAP_TIMEOUT_S)
            lines = [self.line_to(hint) if hint else None, self.line,
                     *(line for line in list(self._lines.values()) if line is not self.line)]
            for line in lines:
                if line is None:
                    continue
                try:
                    resp = await call_with_retry(_ask_map, policy, mutation=False,
                                                 endpoints=line.endpoints)
                except FencepostError as failed:
                    log.info("could not fetch the shard map (%s)", failed)
                    continue
                router.load(resp)
                break
            router.fetched_at = loop.time()
        finally:
            router._fetching = None
            fetching.set_result(None)

    def statistics(self) -> tuple[bool, int, int, int]:
        """The Execute streams' (the given endpoints' open now, streams
        opened, messages sent, commands sent, over every line); all zero
        when every call is unary."""
        if self.dispatcher is None:
            return False, 0, 0, 0
        is_open, opened, sent, commands = self.dispatcher.statistics()
        for line in self._lines.values():
            if line.dispatcher is not None:
                _, o, s, c = line.dispatcher.statistics()
                opened, sent, commands = opened + o, sent + s, commands + c
        return is_open, opened, sent, commands

    async def aclose(self) -> None:
        """Close the Execute streams (every command answered, or failed after
        a bounded wait), then the channels opened here."""
        lines, self._lines = list(self._lines.values()), {}
        dispatchers = [d for d in (self.dispatcher, *(line.dispatcher for line in lines))
                       if d is not None]
        if dispatchers:
            await asyncio.gather(*(d.aclose() for d in dispatchers))
        for line in lines:
            await line.endpoints.aclose()
        if self._owned:
            await self.endpoints.aclose()


async def _ask_map(endpoint: Endpoint, deadline_s: float | None) -> Any:
    stub = endpoint.stub(ledger_pb2_grpc.LedgerStub)
    return await stub.Shards(ledger_pb2.ShardsRequest(owners_only=True), timeout=deadline_s)
