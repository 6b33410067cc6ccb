"""Several coordinators, one leader: which endpoint a client sends to, and
how it follows the leader.

Any number of coordinators may serve one database; exactly one leads. The
others (standbys) refuse every call, at its start, with UNAVAILABLE and
ErrorInfo reason ``NOT_LEADER``, whose metadata ``leader`` is the leader's
advertised address (empty while none is known: a takeover is under way).

A client keeps one channel per endpoint, opened on first use, and sends each
attempt of a call (and each stream it opens) to the endpoint it believes
leads: the first one given, until a failure says otherwise.

- ``NOT_LEADER`` naming a leader: the next attempt goes there at once. The
  address is used as advertised even when it is not among the endpoints
  given (it joins them); an advertised address equal to a given one is that
  endpoint.
- ``NOT_LEADER`` naming none, a connection that could not be made (nothing
  was sent), a read or stream that got no answer, ``SHUTTING_DOWN``: the next
  endpoint, after the retry policy's backoff (``_retry``). So does a call
  with no answer within its deadline (not retried: the next call goes
  elsewhere), and a KeepAlive stream whose renewals stay unanswered
  (``_renewal``).

An endpoint that takes no connection within ``CONNECT_WAIT_S`` (its
machine died: nothing answers) is passed over the same way, by calls and
streams alike.

A standby did nothing with a call it refused, and a mutation carries one
request id for all its attempts, so following the leader neither loses nor
doubles a command: a new leader answers a request id the old one committed
from the database.
"""

from __future__ import annotations

import asyncio
import builtins
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from ._connect import until_connected
from ._errors import (
    FencepostError,
    NotLeaderError,
    NotOwnerError,
    OutcomeUnknownError,
    UnavailableError,
)

log = logging.getLogger("fencepost")

S = TypeVar("S")

# With several endpoints, how long an attempt or a stream waits for a
# connection before it tries the next endpoint: a coordinator whose machine
# died answers no connection attempt at all (gRPC would wait 20 s).
CONNECT_WAIT_S = 2.0


def parse_endpoints(value: str | Sequence[str], field: str = "address") -> tuple[str, ...]:
    """``"a"``, ``"a,b"`` or ``["a", "b"]`` as a tuple of addresses, in order,
    each once; ``ValueError`` naming ``field`` for an empty one or none."""
    if isinstance(value, str):
        items = [value]
    elif isinstance(value, Sequence) and all(isinstance(v, str) for v in value):
        items = builtins.list(value)
    else:
        raise ValueError(f"{field}: an address string or a list of them (got {value!r})")
    out: builtins.list[str] = []
    for item in items:
        for part in item.split(","):
            address = part.strip()
            if not address or any(c.isspace() for c in address):
                raise ValueError(f"{field}: an empty or malformed endpoint in {value!r}")
            if address not in out:
                out.append(address)
    if not out:
        raise ValueError(f"{field}: no endpoint given")
    return tuple(out)


class Endpoint:
    """One coordinator's address, its channel (from ``source``, called on
    every use: the source opens it once) and the stubs made on it.
    ``answers``: it has answered a call (served, or refused for a reason of
    its own) since it last failed one: it leads, as far as this client
    knows."""

    __slots__ = ("_source", "_stubs", "address", "answers")

    def __init__(self, address: str, source: Callable[[], grpc.aio.Channel]) -> None:
        self.address = address
        self._source = source
        self._stubs: dict[type[Any], tuple[grpc.aio.Channel, Any]] = {}
        self.answers = False

    def __repr__(self) -> str:
        return f"<Endpoint {self.address or '(channel)'}>"

    @property
    def channel(self) -> grpc.aio.Channel:
        return self._source()

    def stub(self, cls: Callable[[grpc.aio.Channel], S]) -> S:
        """A ``cls(channel)`` stub, made once per channel."""
        channel = self.channel
        cached = self._stubs.get(cls)  # type: ignore[call-overload]
        if cached is None or cached[0] is not channel:
            cached = (channel, cls(channel))
            self._stubs[cls] = cached  # type: ignore[index]
        return cached[1]  # type: ignore[no-any-return]


def moves_on(exc: FencepostError) -> bool:
    """Whether a failed attempt says its endpoint is not (or no longer) the
    one to send to: a standby's refusal, no answer from an endpoint that
    could not be reached, or none within the deadline (a frozen coordinator
    keeps its connections open). A mutation's lost answer on a broken
    connection does not move by itself: its retry first checks the
    connection, and moves when it is gone."""
    if isinstance(exc, NotLeaderError):
        return True
    if not isinstance(exc, UnavailableError) or isinstance(exc, NotOwnerError):
        return False  # NOT_OWNER: it leads, other shards (the call is rerouted)
    if exc.grpc_code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return True
    return exc.grpc_code is grpc.StatusCode.UNAVAILABLE and not isinstance(
        exc, OutcomeUnknownError)


class Endpoints:
    """The endpoints of one client (or store), and the one believed to lead.

    ``open_channel(address)`` opens the channel of an endpoint the first time
    it is used; ``check(address)`` (optional) refuses, with ``ValueError``, an
    advertised address this client may not use (a bearer token in plaintext
    to a non-loopback host, say): such a hint is not followed.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        open_channel: Callable[[str], grpc.aio.Channel],
        *,
        check: Callable[[str], object] | None = None,
        fixed: Callable[[], grpc.aio.Channel] | None = None,
    ) -> None:
        self._open = open_channel
        self._check = check
        self._channels: dict[str, grpc.aio.Channel] = {}  # opened here: closed by aclose
        self.listed: tuple[str, ...] = tuple(addresses)
        self._all: builtins.list[Endpoint] = (
            [Endpoint(self.listed[0], fixed)] if fixed is not None
            else [self._endpoint(a) for a in self.listed]
        )
        self._current = self._all[0]
        self._answering = asyncio.Event()  # set while the current endpoint answers

    @classmethod
    def of_channel(cls, source: grpc.aio.Channel | Callable[[], grpc.aio.Channel]) -> Endpoints:
        """One endpoint on a channel the caller owns and closes (``source``: the
        channel, or a callable called on every use that returns it). It
        follows no leader elsewhere: a store on a channel of its own."""
        get: Callable[[], grpc.aio.Channel]
        get = (lambda: source) if isinstance(source, grpc.aio.Channel) else source
        return cls(("",), lambda address: get(), check=_refuse_others, fixed=get)

    def _endpoint(self, address: str) -> Endpoint:
        def source() -> grpc.aio.Channel:
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = self._open(address)
            return channel

        return Endpoint(address, source)

    def __len__(self) -> int:
        return len(self._all)

    @property
    def current(self) -> Endpoint:
        """Where the next attempt goes."""
        return self._current

    @property
    def alone(self) -> bool:
        """One endpoint: it has nowhere else to go, so ``reachable`` has
        nothing to wait for (the call itself waits for its connection)."""
        return len(self._all) < 2

    async def reachable(self, endpoint: Endpoint, timeout_s: float | None) -> float | None:
        """With several endpoints, wait (at most ``CONNECT_WAIT_S``, and
        ``timeout_s``) until ``endpoint``'s channel is connected, or raise
        ``UnavailableError`` (nothing was sent: the caller moves on). Returns
        what is left of ``timeout_s``; at once when ``alone``."""
        if self.alone:
            return timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()
        wait = CONNECT_WAIT_S if timeout_s is None else min(timeout_s, CONNECT_WAIT_S)
        await until_connected(endpoint.channel, wait)
        if timeout_s is None:
            return None
        return max(timeout_s - (loop.time() - started), 0.001)

    def answered(self, endpoint: Endpoint) -> None:
        """``endpoint`` answered a call: a leader (standbys answer nothing)."""
        endpoint.answers = True
        if endpoint is self._current:
            self._answering.set()

    async def answering(self) -> Endpoint:
        """The current endpoint; with several, once it has answered a call
        (the Execute stream opens only there: commands on a stream a standby
        refuses would end with an unknown outcome, though nothing was
        applied). A lone endpoint is taken as it is."""
        while len(self._all) > 1 and not self._current.answers:
            self._answering.clear()
            await self._answering.wait()
        return self._current

    def _move_to(self, endpoint: Endpoint) -> None:
        self._current = endpoint
        if endpoint.answers:
            self._answering.set()
        else:
            self._answering.clear()

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every endpoint: those given, then leaders learned from standbys."""
        return tuple(e.address for e in self._all)

    def after_failure(self, endpoint: Endpoint, exc: FencepostError) -> bool:
        """Move on from ``endpoint`` when ``exc`` says so (see the module docs).
        True when the next attempt should go at once: a standby named a leader
        other than itself, and that is now the current endpoint."""
        if not moves_on(exc):
            return False
        endpoint.answers = False
        if isinstance(exc, NotLeaderError):
            leader = exc.leader
            if leader and leader != endpoint.address:
                target = self._find(leader)
                if target is not None:
                    if target is not self._current:
                        log.info("%s is a standby; following the leader to %s",
                                 endpoint.address, leader)
                    self._move_to(target)
                    return True
        self._rotate_from(endpoint, exc)
        return False

    def follow(self, other: Endpoint) -> Endpoint:
        """This object's endpoint of ``other``'s address (another client's
        view of the same coordinators), made the current one, and taken as
        answering when ``other`` answers."""
        mine = self._find(other.address)
        if mine is None:
            return self._current
        if mine is not self._current:
            self._move_to(mine)
        if other.answers and not mine.answers:
            self.answered(mine)
        return mine

    def _find(self, address: str) -> Endpoint | None:
        for e in self._all:
            if e.address == address:
                return e
        if self._check is not None:
            try:
                self._check(address)
            except ValueError as why:
                log.warning("not following the leader to %s: %s", address, why)
                return None
        e = self._endpoint(address)
        self._all.append(e)
        return e

    def _rotate_from(self, endpoint: Endpoint, exc: FencepostError) -> None:
        """The next endpoint after ``endpoint``, unless another call moved on already."""
        if endpoint is not self._current or len(self._all) < 2:
            return
        nxt = self._all[(self._all.index(endpoint) + 1) % len(self._all)]
        log.info("%s: %s; trying %s", endpoint.address, exc.message, nxt.address)
        self._move_to(nxt)

    async def aclose(self) -> None:
        """Close the channels this object opened (not a caller's own channel)."""
        channels, self._channels = builtins.list(self._channels.values()), {}
        for channel in channels:
            await channel.close(None)


def _refuse_others(address: str) -> None:
    raise ValueError("a channel given by the caller follows no leader elsewhere")
