"""One client's way to its coordinators, handed to everything that talks to them.

A ``Connection`` holds the endpoints (the channel of each, opened on first
use, and the one believed to lead: ``_endpoints``), the Execute dispatcher
that carries mutations (``_execute``; None when every call is unary) and the
retry policy. ``Client`` makes one and hands the same object to its engine
store (``AsyncStore``) and to its renewer (``_renewal``); a store made on its
own makes one of its own. Each of them reaches the coordinators only through
what it is handed: nobody sets another's attributes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import grpc

from ._endpoints import Endpoint, Endpoints
from ._execute import ExecuteDispatcher, SharedDispatcher, attempt_of, open_execute, share_key
from ._ids import new_request_id
from ._retry import RetryPolicy, call_with_retry
from ._security import TLS, aio_channel, channel_credentials

T = TypeVar("T")

Transport = Literal["stream", "unary"]


class Connection:
    """Endpoints, dispatcher and retry policy of one client (module docs)."""

    def __init__(
        self,
        endpoints: Endpoints,
        *,
        retry: RetryPolicy,
        dispatcher: ExecuteDispatcher | SharedDispatcher | None = None,
        owned: bool = True,
    ) -> None:
        self.endpoints = endpoints
        self.retry = retry
        self.dispatcher = dispatcher
        self._owned = owned  # aclose closes the channels (not a caller's own)

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

        endpoints = Endpoints(addresses, open_channel,
                              check=lambda one: channel_credentials(one, tls, token))
        dispatcher: ExecuteDispatcher | SharedDispatcher | None = None
        if transport == "stream":
            key = share_key(addresses, tls=tls, token=token, options=options,
                            interceptors=chosen, window_s=window_s, retry=retry)
            dispatcher = (
                ExecuteDispatcher(open_execute, endpoints, window_s=window_s, retry=retry)
                if key is None else SharedDispatcher(key)
            )
        return cls(endpoints, retry=retry, dispatcher=dispatcher)

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
    ) -> T:
        """``attempt`` on the endpoint believed to lead, retried and mapped
        (``call_with_retry``)."""
        return await call_with_retry(attempt, policy or self.retry, mutation=mutation,
                                     endpoints=self.endpoints)

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
        attempt = attempt_of(self.dispatcher, rpc_of, request, mutation=mutation)
        return await self.retried(attempt, mutation=mutation, policy=policy)

    def statistics(self) -> tuple[bool, int, int, int]:
        """The Execute stream's (open now, streams opened, messages sent,
        commands sent); all zero when every call is unary."""
        if self.dispatcher is None:
            return False, 0, 0, 0
        return self.dispatcher.statistics()

    async def aclose(self) -> None:
        """Close the Execute stream (every command answered, or failed after a
        bounded wait), then the channels opened here."""
        if self.dispatcher is not None:
            await self.dispatcher.aclose()
        if self._owned:
            await self.endpoints.aclose()
