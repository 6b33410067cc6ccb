"""A client's mutations over one ``Ledger.Execute`` stream per client.

A unary call costs the server far more than the command it carries, so by
default (``Client(transport="stream")``) every mutation of a client travels on
one bidirectional Execute stream, many commands per message each way: the
ledger's (acquire, renew, record_checkpoint, suspend, finish, release, cancel,
request_resume, delete) and, through ``client.store``, the engine store's 13
unary ones (create_run ... doc_delete). Which request travels as which
``Command`` kind is read from ``ledger.proto``'s ``Command.kind`` oneof, so
the dispatcher knows no kind by name. Reads, listings, artifact streams and
``ValidateFence`` stay unary; KeepAlive is its own stream.

- **Coalescing.** A command is buffered; the stream's writer task wakes one
  event-loop turn later and sends everything buffered as ONE
  ``ExecuteRequest``: the commands issued in the same turn, and all those
  issued while the previous write was in flight. ``command_window_ms``
  (0 to 1 ms) makes the writer wait that much longer before it sends.
- **Correlation.** Each command gets an id, unique for the dispatcher's
  life; a reader task routes each ``CommandResult`` to its command. A result's
  ``error`` is the unary call's status, mapped by ``from_status``: the same
  function, hence the same exception, as the unary path.
- **Fallback.** The stream is opened on the first command, in the
  background, once the endpoint believed to lead has answered a call; until
  it is connected, and whenever it is down (broken, server unreachable, a
  server without Execute), commands go over the unary RPCs. A manager task
  reconnects with the retry policy's jittered backoff (a server answering
  UNIMPLEMENTED is asked again only every minute).
- **Following the leader.** With several endpoints (``_endpoints``) the
  stream goes to the current one; when the client's calls move elsewhere (a
  standby named the leader, the stream's coordinator stopped answering) the
  stream is ended and opened there, its unanswered commands retried with
  their request ids like those of a broken stream.
- **Unknown outcomes.** A command written on a stream that then breaks got
  no answer: its attempt fails as UNAVAILABLE does for a unary call (an
  ``OutcomeUnknownError``), so ``call_with_retry`` retries it with the same
  request id, over whatever transport is up by then; the server answers a
  repeated id with the original answer. A command that never left the buffer,
  or that a server without Execute refused, was certainly not applied: it is
  sent unary at once, in the same attempt.
- **Deadlines.** Each attempt keeps the policy's per-attempt timeout; past it
  the attempt fails as DEADLINE_EXCEEDED would (not retried). Cancelling the
  caller abandons the reply only: a command once submitted is still sent.
- **Close.** ``aclose`` sends what is buffered, half-closes the stream and
  waits (bounded) for the server to answer every command it took; whatever is
  still unanswered then fails with CANCELLED, as a unary call cut off by the
  channel's close does. Nothing is dropped silently.
- **Sharing.** The Clients of one event loop that name the same single
  coordinator with the same credentials and settings (and no interceptors)
  share one stream (``SharedDispatcher``): a process running many workers,
  each a Client of its own owner, sends all their commands in shared
  messages, as one Client with many runs does. Each command still carries its
  own owner (and the server authorizes it as such); a Client's close waits
  (bounded) for its own commands, and the last one's closes the stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc
from google.rpc import status_pb2

from ._connect import connected, until_connected
from ._endpoints import Endpoints
from ._errors import UnavailableError, from_rpc_error, from_status
from ._retry import RetryPolicy
from ._security import TLS, aio_channel, channel_credentials
from .v1 import ledger_pb2 as pb
from .v1 import ledger_pb2_grpc

if TYPE_CHECKING:
    from ._endpoints import Endpoint

log = logging.getLogger("fencepost.execute")


def _kinds() -> dict[type[Any], str]:
    """Every request message a ``Command`` can carry, and its field name in
    the ``kind`` oneof (the answer is the ``CommandResult`` field of the same
    name: the unary response message, or ``error``)."""
    command = pb.Command()
    return {
        type(getattr(command, field.name)): field.name
        for field in pb.Command.DESCRIPTOR.oneofs_by_name["kind"].fields
    }


# The request messages the stream carries (the ledger's commands, fields 2-10,
# the engine store's mutations, fields 20-32, and transactions, 40), and the Command /
# CommandResult field of each (exactly the unary request and response messages).
KIND_OF_REQUEST: dict[type[Any], str] = _kinds()

MAX_WINDOW_MS = 1.0
# One message carries at most this many commands, of at most about this many
# bytes; a command larger than that alone goes unary, where a refusal of its
# size cannot take the stream (and every other command on it) down.
_MAX_COMMANDS_PER_MESSAGE = 1000
_MAX_MESSAGE_BYTES = 1 << 20
# How long aclose() waits for the server to answer what the stream carries.
CLOSE_WAIT_S = 5.0
# How long opening a stream may take before it counts as failed.
_CONNECT_TIMEOUT_S = 10.0
# A server without Execute is asked again this often.
_UNIMPLEMENTED_RETRY_S = 60.0
_CLOSED = "the client was closed before the command was answered"


def check_window(command_window_ms: float) -> float:
    """``command_window_ms`` validated, in seconds."""
    if (
        isinstance(command_window_ms, bool)
        or not isinstance(command_window_ms, int | float)
        or not 0 <= command_window_ms <= MAX_WINDOW_MS  # also refuses NaN
    ):
        raise ValueError(
            f"command_window_ms must be a number of milliseconds from 0 to {MAX_WINDOW_MS:g} "
            f"(got {command_window_ms!r})"
        )
    return float(command_window_ms) / 1000


class Dispatcher(Protocol):
    """What a call's attempt needs of the stream that carries mutations."""

    def carries(self, request: Any) -> bool: ...

    async def execute(
        self, rpc: Callable[..., Any], request: Any, deadline_s: float | None, endpoint: Endpoint
    ) -> Any: ...


def _streamable(request: Any) -> bool:
    """A ``Command`` kind, small enough for a message."""
    return type(request) in KIND_OF_REQUEST and request.ByteSize() <= _MAX_MESSAGE_BYTES


def open_execute(endpoint: Endpoint) -> Any:
    """A new Execute call (write()/read() style) on ``endpoint``."""
    return endpoint.stub(ledger_pb2_grpc.LedgerStub).Execute()  # type: ignore[call-arg]


def attempt_of(
    dispatcher: Dispatcher | None,
    rpc_of: Callable[[Endpoint], Callable[..., Any]],
    request: Any,
    *,
    mutation: bool,
) -> Callable[[Endpoint, float | None], Awaitable[Any]]:
    """One attempt of a call on an endpoint, for ``call_with_retry``: a
    mutation the ``dispatcher`` carries goes over its Execute stream (unary
    while the stream is down), anything else is the unary ``rpc_of(endpoint)``
    with the attempt's timeout. A mutation is sent only once the endpoint's
    channel is connected, so one that cannot have left fails as
    ``UnavailableError``, not as an unknown outcome (``_connect``), and the
    next attempt tries the next endpoint. The ledger client and the engine
    store both call through here."""
    streamed = mutation and dispatcher is not None and dispatcher.carries(request)

    async def attempt(endpoint: Endpoint, deadline_s: float | None) -> Any:
        rpc = rpc_of(endpoint)
        if not mutation:
            return await rpc(request, timeout=deadline_s)
        if not connected(endpoint.channel):
            loop = asyncio.get_running_loop()
            started = loop.time()
            await until_connected(endpoint.channel, deadline_s)
            if deadline_s is not None:
                deadline_s = max(deadline_s - (loop.time() - started), 0.001)
        if streamed:
            assert dispatcher is not None
            return await dispatcher.execute(rpc, request, deadline_s, endpoint)
        return await rpc(request, timeout=deadline_s)

    return attempt


def _status(code: grpc.StatusCode, message: str) -> status_pb2.Status:
    return status_pb2.Status(code=code.value[0], message=message)


class _Expired(Exception):
    """The attempt's deadline passed before its command was answered."""


def _expire(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_exception(_Expired())


class _NotSent(Exception):
    """The command was certainly not applied (never written, or the server has
    no Execute): send it another way at once."""


class _Unanswered(Exception):
    """The command was written and the stream ended before its answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class _Moved(_Unanswered):
    """The calls of the client go to another endpoint than the stream's (it
    stopped answering, or a standby named another leader): the stream ends,
    its unanswered commands are retried with their request ids, and the next
    stream goes to the new endpoint."""


class _Session:
    """One Execute call: ``run()`` drives a writer task (the only one to call
    ``write``; it sends the buffer) and a reader task (routes each result to
    its command's future) until the stream ends."""

    def __init__(self, call: Any, window_s: float, endpoint: Endpoint) -> None:
        self.call = call
        self.window_s = window_s
        self.endpoint = endpoint  # where the stream goes
        self.moved = asyncio.Event()  # calls go to another endpoint now: end the stream
        self.buffer: list[tuple[pb.Command, int]] = []  # not written yet, with sizes
        self.waiting: dict[int, asyncio.Future[pb.CommandResult]] = {}  # unanswered
        self.wake = asyncio.Event()
        self.closing = False  # half-close once the buffer is sent
        self.ended = False
        self.answered = False  # got at least one result
        self.messages_sent = 0
        self.commands_sent = 0

    @property
    def usable(self) -> bool:
        return not self.ended and not self.closing and not self.moved.is_set()

    def submit(self, cid: int, kind: str, request: Any, size: int) -> asyncio.Future[Any]:
        cmd = pb.Command(id=cid)
        getattr(cmd, kind).CopyFrom(request)
        fut: asyncio.Future[pb.CommandResult] = asyncio.get_running_loop().create_future()
        self.waiting[cid] = fut
        self.buffer.append((cmd, size))
        self.wake.set()
        return fut

    def close(self) -> None:
        """Send what is buffered, then half-close."""
        self.closing = True
        self.wake.set()

    async def run(self) -> None:
        """Until the stream ends: returns after a half-close the server
        completed, raises what else ended it."""
        writer = asyncio.create_task(self._write(), name="fencepost-execute-write")
        reader = asyncio.create_task(self._read(), name="fencepost-execute-read")
        mover: asyncio.Task[Any] = asyncio.create_task(self.moved.wait(),
                                                       name="fencepost-execute-move")
        try:
            done, _ = await asyncio.wait({writer, reader, mover},
                                         return_when=asyncio.FIRST_COMPLETED)
            for task in (reader, writer):
                if task in done and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            if mover in done:
                raise _Moved(grpc.StatusCode.UNAVAILABLE,
                             f"calls go to another endpoint than {self.endpoint.address} now")
            if writer in done:
                # the writer ends only after a half-close: the server answers
                # every command it took, then ends the stream
                await reader
                return
            raise _Unanswered(grpc.StatusCode.UNAVAILABLE, "the server ended the Execute stream")
        finally:
            tasks: set[asyncio.Task[Any]] = {writer, reader, mover}
            for task in tasks:
                task.cancel()
            await asyncio.wait(tasks)

    async def _write(self) -> None:
        while True:
            await self.wake.wait()
            if self.window_s and not self.closing:
                await asyncio.sleep(self.window_s)  # let more commands join
            self.wake.clear()
            while self.buffer:
                batch = self._take()
                self.messages_sent += 1
                self.commands_sent += len(batch)
                await self.call.write(pb.ExecuteRequest(commands=batch))
            if self.closing:
                await self.call.done_writing()
                return

    def _take(self) -> list[pb.Command]:
        n, size = 0, 0
        for _, cmd_size in self.buffer:
            if n and (n >= _MAX_COMMANDS_PER_MESSAGE or size + cmd_size > _MAX_MESSAGE_BYTES):
                break
            n += 1
            size += cmd_size
        taken, self.buffer = self.buffer[:n], self.buffer[n:]
        return [cmd for cmd, _ in taken]

    async def _read(self) -> None:
        while True:
            msg = await self.call.read()
            if msg is grpc.aio.EOF:  # type: ignore[attr-defined]
                return
            self.answered = True
            for result in msg.results:
                fut = self.waiting.pop(result.id, None)
                if fut is None:
                    if result.WhichOneof("kind") == "error":
                        log.warning("Execute error for no command of ours (id %d): %s",
                                    result.id, result.error.message)
                    continue  # an answer whose caller gave up: abandoned
                if not fut.done():
                    fut.set_result(result)

    def fail(self, code: grpc.StatusCode, message: str, *, applied_unknown: bool) -> None:
        """End the session: every unanswered command learns why. Those never
        written (or refused unapplied) get ``_NotSent``, the others
        ``_Unanswered``."""
        self.ended = True
        unsent = {cmd.id for cmd, _ in self.buffer}
        self.buffer.clear()
        waiting, self.waiting = self.waiting, {}
        for cid, fut in waiting.items():
            if fut.done():
                continue  # its caller gave up (cancelled, or past its deadline)
            if cid in unsent or not applied_unknown:
                fut.set_exception(_NotSent(message))
            else:
                fut.set_exception(_Unanswered(code, message))


class ExecuteDispatcher:
    """A client's mutations over one Execute stream (see the module docs).

    ``execute(rpc, request, timeout)`` is one attempt of one command, for
    ``call_with_retry``: over the stream when it is open, else the unary
    ``rpc``. One manager task owns the stream and reconnects it; it is started
    by the first command and stopped by ``aclose``.
    """

    def __init__(
        self,
        open_call: Callable[[Endpoint], Any],
        endpoints: Endpoints,
        *,
        window_s: float,
        retry: RetryPolicy,
    ) -> None:
        self._open_call = open_call
        self._endpoints = endpoints
        self._window_s = window_s
        self._retry = retry
        self._ids = itertools.count(1)
        self._session: _Session | None = None
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        # diagnostics (tests): streams opened, and what went on them
        self.streams_opened = 0
        self.messages_sent = 0
        self.commands_sent = 0
        self.unimplemented = False  # the server said it has no Execute

    @property
    def is_open(self) -> bool:
        """Commands go on the stream (rather than unary) right now."""
        return self._session is not None and self._session.usable

    def statistics(self) -> tuple[bool, int, int, int]:
        """(open now, streams opened, messages sent, commands sent), the open
        stream's sends included."""
        live = self._session
        messages, commands = self.messages_sent, self.commands_sent
        if live is not None:
            messages += live.messages_sent
            commands += live.commands_sent
        return self.is_open, self.streams_opened, messages, commands

    def carries(self, request: Any) -> bool:
        """Whether ``request`` is a mutation the stream may carry (a ``Command``
        kind, small enough for a message)."""
        return not self._closed and _streamable(request)

    async def execute(
        self, rpc: Callable[..., Any], request: Any, deadline_s: float | None, endpoint: Endpoint
    ) -> Any:
        """One attempt of ``request`` to ``endpoint``, given ``deadline_s`` (the
        gRPC timeout of a unary attempt): its unary response message, or a
        ``FencepostError`` (a result's error, a broken stream as UNAVAILABLE,
        a passed deadline), or the unary call's ``grpc.RpcError``. A stream
        to another endpoint is ended (and reopened to the current one) and
        the attempt goes unary."""
        timeout = deadline_s
        session = self._current(endpoint)
        if session is not None:
            loop = asyncio.get_running_loop()
            deadline = None if timeout is None else loop.time() + timeout
            kind = KIND_OF_REQUEST[type(request)]
            fut = session.submit(next(self._ids), kind, request, request.ByteSize())
            # a timer on the future, not asyncio.timeout: no task cancellation
            # to undo (measured: 2 us per command where asyncio.timeout costs 5)
            timer = None if deadline is None else loop.call_at(deadline, _expire, fut)
            try:
                result = await fut  # our cancellation abandons the reply, not the command
            except _Expired:
                raise from_status(_status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                                  mutation=True) from None
            except _Unanswered as lost:
                raise from_status(_status(lost.code, str(lost)), mutation=True) from None
            except _NotSent:
                if deadline is not None:
                    timeout = deadline - loop.time()
                    if timeout <= 0:
                        raise from_status(
                            _status(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
                            mutation=True,
                        ) from None
            else:
                which = result.WhichOneof("kind")
                if which == "error":
                    raise from_status(result.error, mutation=True)
                if which != kind:
                    raise from_status(
                        _status(grpc.StatusCode.INTERNAL,
                                f"Execute answered a {kind} command with {which!r}"),
                        mutation=True,
                    )
                return getattr(result, kind)
            finally:
                if timer is not None:
                    timer.cancel()
        return await rpc(request, timeout=timeout)

    def _current(self, endpoint: Endpoint) -> _Session | None:
        """The open session to ``endpoint``, if any; starts the manager on the
        first command, and ends a session to another endpoint."""
        if self._closed:
            return None
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="fencepost-execute")
        session = self._session
        if session is None or not session.usable:
            return None
        if session.endpoint is not endpoint:
            log.info("calls go to %s now: moving the Execute stream off %s",
                     endpoint.address, session.endpoint.address)
            session.moved.set()
            return None
        return session

    async def aclose(self) -> None:
        """Send what is buffered, half-close, wait (at most ``CLOSE_WAIT_S``)
        for the answers, then stop. Unary fallback stays possible meanwhile;
        ``execute`` goes unary from now on."""
        if self._closed:
            return
        self._closed = True
        task, self._task = self._task, None
        if task is None:
            return
        try:
            session = self._session
            if session is not None and not session.ended:
                session.close()
                _, pending = await asyncio.wait({task}, timeout=CLOSE_WAIT_S)
                if pending and session.waiting:
                    log.warning("closing: %d command(s) on the Execute stream still unanswered "
                                "after %.0f s; they fail with CANCELLED",
                                len(session.waiting), CLOSE_WAIT_S)
        finally:
            task.cancel()
            await asyncio.wait({task})

    # -- the manager -----------------------------------------------------------------------

    async def _run(self) -> None:
        backoff = self._retry.backoffs()
        hops = 0  # reconnects straight to a named leader, in a row
        while not self._closed:
            session: _Session | None = None
            call: Any = None
            code, message = grpc.StatusCode.UNAVAILABLE, "the Execute stream broke"
            applied_unknown = True
            # only where a call was answered: a stream a standby refuses would
            # take the commands written meanwhile down with an unknown outcome
            endpoint = await self._endpoints.answering()
            started = time.monotonic()
            at_once = False  # a standby named the leader: go there without waiting
            try:
                await self._endpoints.reachable(endpoint, None)
                call = self._open_call(endpoint)
                self.streams_opened += 1
                session = _Session(call, self._window_s, endpoint)
                async with asyncio.timeout(_CONNECT_TIMEOUT_S):
                    await call.wait_for_connection()
                self._session = session
                self.unimplemented = False
                log.debug("Execute stream open")
                await session.run()  # returns after aclose's half-close only
                code, message = grpc.StatusCode.CANCELLED, _CLOSED
            except asyncio.CancelledError:
                code, message = grpc.StatusCode.CANCELLED, _CLOSED
                raise
            except grpc.RpcError as err:
                status = err.code() if callable(getattr(err, "code", None)) else None
                if status is grpc.StatusCode.UNIMPLEMENTED:
                    self.unimplemented = True
                    applied_unknown = False  # refused before any command was looked at
                    log.info("the server has no Ledger.Execute: mutations go unary "
                             "(asking again in %.0f s)", _UNIMPLEMENTED_RETRY_S)
                else:
                    log.info("Execute stream ended (%s: %s); unary until it reconnects",
                             getattr(status, "name", status), _details(err))
                    at_once = self._endpoints.after_failure(
                        endpoint, from_rpc_error(err, mutation=False))
                message = (f"the Execute stream broke ({getattr(status, 'name', status)}: "
                           f"{_details(err)})")
            except _Unanswered as ended:
                code, message = ended.code, str(ended)
                log.info("%s; unary until it reconnects", message)
                at_once = isinstance(ended, _Moved)
            except (TimeoutError, OSError, RuntimeError, asyncio.InvalidStateError) as exc:
                message = f"the Execute stream failed ({exc!r})"
                log.info("%s; unary until it reconnects", message)
                if isinstance(exc, TimeoutError):  # could not connect: try the next endpoint
                    self._endpoints.after_failure(endpoint, UnavailableError(
                        message, code="UNAVAILABLE", grpc_code=grpc.StatusCode.UNAVAILABLE))
            except UnavailableError as exc:  # no connection to it (``Endpoints.reachable``)
                message = f"the Execute stream was not opened ({exc})"
                log.info("%s; unary until it reconnects", message)
                self._endpoints.after_failure(endpoint, exc)
            except Exception as exc:
                message = f"the Execute stream crashed ({exc!r})"
                log.exception("Execute stream crashed; unary until it reconnects")
            finally:
                if self._session is session:
                    self._session = None
                if self._closed and applied_unknown and code is not grpc.StatusCode.CANCELLED:
                    # ended during the close: no retry may follow onto a closing channel
                    code, message = grpc.StatusCode.CANCELLED, f"{_CLOSED} ({message})"
                if session is not None:
                    self.messages_sent += session.messages_sent
                    self.commands_sent += session.commands_sent
                    session.fail(code, message, applied_unknown=applied_unknown)
                if call is not None:
                    call.cancel()
            if self._closed:
                return
            if self.unimplemented:
                delay = _UNIMPLEMENTED_RETRY_S
            elif at_once and hops < len(self._endpoints):
                hops += 1
                delay = 0.0
            else:
                hops = 0
                worked = session is not None and session.answered
                if worked or time.monotonic() - started > self._retry.max_backoff_s:
                    backoff = self._retry.backoffs()  # it had worked: start over
                delay = backoff.next()
            await asyncio.sleep(delay)


@dataclass(eq=False)
class _Shared:
    """One stream shared by the Clients of one loop and key, and its own
    channel to the coordinator."""

    dispatcher: ExecuteDispatcher
    endpoints: Endpoints
    users: int = 0


# Per event loop: the shared streams by key (an entry leaves with its last user).
_SHARED: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[ShareKey, _Shared]] = (
    weakref.WeakKeyDictionary()
)


@dataclass(frozen=True)
class ShareKey:
    """What Clients must have in common to share a stream."""

    address: str
    tls: TLS | None
    token: str | None
    options: tuple[tuple[str, Any], ...]
    window_s: float
    retry: RetryPolicy


def share_key(
    addresses: Sequence[str],
    *,
    tls: TLS | None,
    token: str | None,
    options: Sequence[tuple[str, Any]],
    interceptors: Sequence[Any],
    window_s: float,
    retry: RetryPolicy,
) -> ShareKey | None:
    """What Clients must have in common to share a stream (module docs), or
    None when this one keeps a stream of its own: several endpoints (each
    Client follows its leader itself), interceptors (they see its calls only),
    or settings that cannot be compared."""
    if len(addresses) != 1 or interceptors:
        return None
    key = ShareKey(addresses[0], tls, token, tuple(options), window_s, retry)
    try:
        hash(key)
    except TypeError:
        return None
    return key


class SharedDispatcher:
    """One Client's part of a shared Execute stream (module docs): the
    stream's ``ExecuteDispatcher``, found or made on the loop of the Client's
    first mutation, with a channel of its own to the same coordinator."""

    def __init__(self, key: ShareKey) -> None:
        self._key = key
        self._shared: _Shared | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._inflight = 0
        self._idle = asyncio.Event()

    # diagnostics (tests), of the shared stream
    @property
    def is_open(self) -> bool:
        return self._shared is not None and self._shared.dispatcher.is_open

    @property
    def streams_opened(self) -> int:
        return 0 if self._shared is None else self._shared.dispatcher.streams_opened

    @property
    def messages_sent(self) -> int:
        return 0 if self._shared is None else self._shared.dispatcher.messages_sent

    @property
    def commands_sent(self) -> int:
        return 0 if self._shared is None else self._shared.dispatcher.commands_sent

    @property
    def unimplemented(self) -> bool:
        return self._shared is not None and self._shared.dispatcher.unimplemented

    def statistics(self) -> tuple[bool, int, int, int]:
        """``ExecuteDispatcher.statistics`` of the shared stream."""
        if self._shared is None:
            return False, 0, 0, 0
        return self._shared.dispatcher.statistics()

    def carries(self, request: Any) -> bool:
        return not self._closed and _streamable(request)

    def _attach(self) -> _Shared:
        shared = self._shared
        if shared is None:
            self._loop = loop = asyncio.get_running_loop()
            streams = _SHARED.setdefault(loop, {})
            shared = streams.get(self._key)
            if shared is None:
                k = self._key
                endpoints = Endpoints(
                    (k.address,),
                    lambda one: aio_channel(one, tls=k.tls, token=k.token, options=k.options),
                    check=lambda one: channel_credentials(one, k.tls, k.token),
                )
                shared = _Shared(ExecuteDispatcher(open_execute, endpoints,
                                                   window_s=k.window_s, retry=k.retry),
                                 endpoints)
                streams[self._key] = shared
            shared.users += 1
            self._shared = shared
        return shared

    async def execute(
        self, rpc: Callable[..., Any], request: Any, deadline_s: float | None, endpoint: Endpoint
    ) -> Any:
        """``ExecuteDispatcher.execute`` on the shared stream, to the
        coordinator ``endpoint`` (this Client's) names."""
        if self._closed:
            return await rpc(request, timeout=deadline_s)
        shared = self._attach()
        self._inflight += 1
        self._idle.clear()
        try:
            return await shared.dispatcher.execute(
                rpc, request, deadline_s, shared.endpoints.follow(endpoint))
        finally:
            self._inflight -= 1
            if not self._inflight:
                self._idle.set()

    async def aclose(self) -> None:
        """Wait (at most ``CLOSE_WAIT_S``) for this Client's commands; the last
        user closes the stream (``ExecuteDispatcher.aclose``)."""
        if self._closed:
            return
        self._closed = True
        shared, self._shared = self._shared, None
        if shared is None:
            return
        shared.users -= 1
        if shared.users:
            if self._inflight:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(CLOSE_WAIT_S):
                        await self._idle.wait()
            return
        assert self._loop is not None
        streams = _SHARED.get(self._loop, {})
        if streams.get(self._key) is shared:
            del streams[self._key]
        await shared.dispatcher.aclose()
        await shared.endpoints.aclose()


def _details(err: grpc.RpcError) -> str:
    details = getattr(err, "details", None)
    text = details() if callable(details) else None
    return text or str(err)

