"""Retries (AIP-194): only UNAVAILABLE is retried, with jittered exponential
backoff, bounded in total time. A mutation carries one request id for all its
attempts (docs/SPEC.md §5.5), so a retry after a lost answer gets the original answer
instead of applying the command twice. With several endpoints, the attempts
follow the leader (``_endpoints``): a standby's NOT_LEADER is an UNAVAILABLE
like any other, retried on the endpoint it names. A coordinator's NOT_OWNER
(it leads other shards than the call's) is not retried there: the call is
rerouted to the owner it names at once (``Connection``), a few hops in a row
at most, then again after a moment (a shard in transit) until the deadline.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import grpc

from ._errors import (
    FencepostError,
    NotLeaderError,
    NotOwnerError,
    OutcomeUnknownError,
    UnavailableError,
    from_rpc_error,
)

if TYPE_CHECKING:
    from ._endpoints import Endpoint, Endpoints

T = TypeVar("T")

Attempt = Callable[["Endpoint", float | None], Awaitable[T]]
# Where a call refused with NOT_OWNER goes next: the owner's endpoints and
# the attempt for them, or None (no routing here: the refusal is raised).
# Where a call goes after a NOT_OWNER, or after no answer while routing
# (None: nowhere else).
Reroute = Callable[[FencepostError], Awaitable["tuple[Endpoints, Attempt[T]] | None"]]

# A call refused NOT_OWNER by an owner naming the one that sent it there, or
# this many times in a row (owners naming each other: a shard mid-move), goes
# on to the owner named after IN_TRANSIT_S, for at most MOVE_WINDOW_S of such
# refusals; then NotOwnerError (a map that stays wrong).
MAX_OWNER_HOPS = 3
MOVE_WINDOW_S = 2.0
# Between attempts while a shard moves: refused NOT_OWNER with no owner
# named (being taken or handed over: done within moments), or no answer
# from its owner (until another takes it over, after the shard lease).
IN_TRANSIT_S = 0.025
REROUTED_MAX_S = 0.05  # each attempt then follows a map fetched since (MAP_REFRESH_S)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How a call is retried when the server is unavailable.

    ``total_timeout_s`` bounds the time spent retrying (no new attempt starts
    after it); ``attempt_timeout_s`` is each attempt's gRPC deadline (None: no
    deadline); ``max_attempts`` of 1 disables retries.
    """

    initial_backoff_s: float = 0.05
    max_backoff_s: float = 1.0
    multiplier: float = 2.0
    jitter: float = 0.2
    total_timeout_s: float = 10.0
    attempt_timeout_s: float | None = 10.0
    max_attempts: int | None = None

    def __post_init__(self) -> None:
        if self.initial_backoff_s <= 0 or self.max_backoff_s < self.initial_backoff_s:
            raise ValueError("need 0 < initial_backoff_s <= max_backoff_s")
        if self.multiplier < 1:
            raise ValueError("multiplier must be >= 1")
        if not 0 <= self.jitter < 1:
            raise ValueError("jitter must be in [0, 1)")
        if self.total_timeout_s < 0:
            raise ValueError("total_timeout_s must be >= 0")
        if self.attempt_timeout_s is not None and self.attempt_timeout_s <= 0:
            raise ValueError("attempt_timeout_s must be > 0 or None")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1 or None")

    @classmethod
    def no_retry(cls, attempt_timeout_s: float | None = 10.0) -> RetryPolicy:
        """One attempt only."""
        return cls(max_attempts=1, attempt_timeout_s=attempt_timeout_s)

    def backoffs(self) -> _Backoff:
        return _Backoff(self)


class _Backoff:
    def __init__(self, policy: RetryPolicy) -> None:
        self._policy = policy
        self._next = policy.initial_backoff_s

    def next(self) -> float:
        p = self._policy
        delay = self._next * random.uniform(1 - p.jitter, 1 + p.jitter)
        self._next = min(self._next * p.multiplier, p.max_backoff_s)
        return delay


async def call_with_retry(
    attempt: Callable[[Endpoint, float | None], Awaitable[T]],
    policy: RetryPolicy,
    *,
    mutation: bool,
    endpoints: Endpoints,
    reroute: Reroute[T] | None = None,
) -> T:
    """Run ``attempt(endpoint, timeout)`` until it succeeds, fails with a status
    other than UNAVAILABLE, or the policy is exhausted; raise the mapped error.
    ``attempt`` fails with a ``grpc.RpcError`` (mapped here) or with a
    ``FencepostError`` it mapped itself (a command on the Execute stream, whose
    broken stream reads as UNAVAILABLE); both go by the same rules.

    Each attempt goes to ``endpoints.current``, and each failure may move it
    (``Endpoints.after_failure``): a standby's NOT_LEADER naming the leader
    sends the next attempt there at once (at most one such hop per endpoint
    in a row), any other UNAVAILABLE (NOT_LEADER with no leader known
    included: a takeover under way) waits the policy's backoff first. So a
    call waits for a new leader as long as the policy retries at all:
    ``total_timeout_s`` (10 s by default, room for a 5 s leader lease to
    expire and a standby to take over). Then the last error is raised, an
    ``UnavailableError`` (``NotLeaderError`` when the last endpoint was a
    standby) whose message names the endpoints tried and the last leader
    hint.

    A ``NotOwnerError`` (the coordinator leads other shards) goes to
    ``reroute``: the next attempt goes to the owner it names at once, with the
    same request id, neither counted nor delayed by the policy, at most
    ``MAX_OWNER_HOPS`` times in a row; with no owner named (asked again
    there), or naming back the owner that sent it (owners naming each other
    mid-move: followed still, for up to ``MOVE_WINDOW_S``), after
    ``IN_TRANSIT_S``, until the deadline. Without ``reroute``, or past the
    window, it is raised.
    An attempt with no answer goes to ``reroute`` too: the next attempt,
    after the backoff, goes where it says (the shard's owner now).

    A read ended CANCELLED is retried as after UNAVAILABLE: gRPC cancels the
    calls that reached a server but no handler yet when it stops.

    For a mutation, once any attempt ended without an answer the outcome is
    unknown, and the final error is ``OutcomeUnknownError`` even when the last
    attempt was refused with STORAGE_UNAVAILABLE or NOT_LEADER (an earlier
    attempt may still commit).
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + policy.total_timeout_s
    backoff: _Backoff | None = None  # made at the first failure: most calls have none
    attempts = 0
    hops = 0  # attempts sent straight to a named leader, in a row
    owner_hops = 0  # attempts sent straight to a named shard owner, in a row
    crossed: float | None = None  # when owners first named each other
    named: dict[str, str] = {}  # endpoint -> the owner it named
    tried: dict[str, str] = {}  # endpoint -> how its last attempt failed
    hint: str | None = None  # the leader the last NOT_LEADER named ("" none)
    unknown: FencepostError | None = None
    while True:
        attempts += 1
        cause: BaseException | None
        endpoint = endpoints.current
        try:
            timeout = (policy.attempt_timeout_s if endpoints.alone  # no coroutine to make
                       else await endpoints.reachable(endpoint, policy.attempt_timeout_s))
            result = await attempt(endpoint, timeout)
        except grpc.RpcError as err:
            exc, cause = from_rpc_error(err, mutation=mutation), err
        except FencepostError as err:
            # An attempt whose status came in a message, or that lost its
            # stream (a command on the Execute stream): already mapped, by the
            # same function, and retried by the same rules.
            exc, cause = err, err.__cause__
        else:
            endpoints.answered(endpoint)
            return result
        if exc.grpc_code not in _NO_ANSWER or isinstance(exc, NotOwnerError):
            endpoints.answered(endpoint)  # refused it for a reason of its own: it leads
        if isinstance(exc, OutcomeUnknownError):
            unknown = exc
        tried[endpoint.address] = _failure(exc)
        rerouted = final = False
        if isinstance(exc, NotOwnerError):
            # owners naming each other (a move under way, one of them not told yet):
            # followed still, but after a moment each time, until one of them leads it
            crossing = bool(exc.owner) and (named.get(exc.owner) == endpoint.address
                                            or owner_hops >= MAX_OWNER_HOPS)
            if exc.owner:
                named[endpoint.address] = exc.owner
            routed = None if reroute is None else await reroute(exc)
            if routed is None:
                final = True  # the same coordinator would refuse it again
            else:
                endpoints, attempt = routed
                if exc.owner and not crossing:  # at once, as a redirection, not a retry
                    owner_hops += 1
                    attempts -= 1
                    continue
                if crossing:
                    crossed = loop.time() if crossed is None else crossed
                    final = loop.time() - crossed > MOVE_WINDOW_S
                    owner_hops = 0
                rerouted = True  # in transit or crossing: asked again shortly
        elif (reroute is not None and exc.grpc_code is grpc.StatusCode.UNAVAILABLE
              and not isinstance(exc, NotLeaderError)):
            # no answer: with routing on, the shard may be led elsewhere now
            routed = await reroute(exc)
            if routed is not None:
                endpoints, attempt = routed
                rerouted = True
        if isinstance(exc, NotLeaderError):
            hint = exc.leader
        at_once = (not rerouted and endpoints.after_failure(endpoint, exc)
                   and hops < len(endpoints))
        hops = hops + 1 if at_once else 0
        code = exc.grpc_code
        if backoff is None:
            backoff = policy.backoffs()
        delay = 0.0 if at_once else backoff.next()
        if rerouted:  # a shard moving: its new owner serves it within moments
            delay = min(delay, IN_TRANSIT_S if isinstance(exc, NotOwnerError)
                        else REROUTED_MAX_S)
        exhausted = (
            final
            or not (code is grpc.StatusCode.UNAVAILABLE
                    or (code is grpc.StatusCode.CANCELLED and not mutation))
            or (policy.max_attempts is not None and attempts >= policy.max_attempts)
            or loop.time() + delay > deadline
        )
        if not exhausted:
            await asyncio.sleep(delay)
            continue
        if code is grpc.StatusCode.UNAVAILABLE and (
                len(endpoints) > 1 or isinstance(exc, NotLeaderError | NotOwnerError)):
            exc.message += _tried(tried, hint)
        if (
            unknown is not None
            and code is grpc.StatusCode.UNAVAILABLE
            and not isinstance(exc, OutcomeUnknownError)
        ):
            raise OutcomeUnknownError(
                f"no answer from an earlier attempt, and the last was refused: {exc}",
                code=unknown.code,
                grpc_code=unknown.grpc_code,
            ) from cause or exc
        if attempts > 1:
            exc.add_note(f"fencepost: gave up after {attempts} attempts")
        raise exc from cause


# Codes that do not show the endpoint took the call (a leader refuses with others).
_NO_ANSWER = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                        grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN, None})


def _failure(exc: FencepostError) -> str:
    if isinstance(exc, NotLeaderError):
        return f"standby, leader {exc.leader}" if exc.leader else "standby, no leader known"
    if isinstance(exc, NotOwnerError):
        return f"shard {exc.shard} led at {exc.owner or 'no address known'}"
    if isinstance(exc, OutcomeUnknownError):
        return "no answer"
    if isinstance(exc, UnavailableError):
        return "unreachable" if exc.code == "UNAVAILABLE" else exc.code
    return exc.code or "refused"


def _tried(tried: dict[str, str], hint: str | None) -> str:
    """``; tried a (standby, no leader known), b (unreachable); last leader
    hint: none`` for the final error's message."""
    named = [f"{address} ({why})" for address, why in tried.items() if address]
    if not named:
        return ""
    text = f"; tried {', '.join(named)}"
    if hint is not None:
        text += f"; last leader hint: {hint or 'none'}"
    return text
