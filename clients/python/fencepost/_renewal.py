"""Background lease renewal, behind a small seam.

The client talks to a ``Renewer`` only through ``start(lease)``,
``stop(lease)`` and ``aclose()``. Today's implementation, ``UnaryRenewer``,
runs one task per lease that calls the unary ``Renew`` at a third of the
lease's ttl (etcd's habit). The KeepAlive stream (SPEC §6.1) will be another
``Renewer`` that multiplexes every lease of a client over one stream; nothing
outside this module will change.

Every task has an owner: the renewer keeps it until ``stop`` or ``aclose``
cancels and awaits it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Protocol

from ._errors import FencepostError, LeaseLostError, StorageUnavailableError, UnavailableError
from ._retry import RetryPolicy

if TYPE_CHECKING:
    from ._client import Lease

log = logging.getLogger("fencepost.renewal")


class Renewer(Protocol):
    def start(self, lease: Lease) -> None:
        """Begin keeping ``lease`` alive (idempotent)."""

    async def stop(self, lease: Lease) -> None:
        """Stop renewing ``lease`` and wait until no renewal is in flight."""

    async def aclose(self) -> None:
        """Stop every renewal; ``start`` does nothing afterwards."""


class UnaryRenewer:
    """One task per lease, calling the unary ``Renew`` every ttl/3.

    - RUN_LEASE_LOST: the lease's ``lost`` event is set (by the fenced call)
      and renewal stops.
    - No answer (UNAVAILABLE, deadline, STORAGE_UNAVAILABLE): keep trying,
      with backoff bounded by ttl/3, until told to stop.
    - Any other refusal (terminal, not running...): renewal stops.
    """

    def __init__(self, retry: RetryPolicy) -> None:
        self._retry = retry
        self._tasks: dict[Lease, asyncio.Task[None]] = {}
        self._closed = False

    def start(self, lease: Lease) -> None:
        if self._closed or lease in self._tasks:
            return
        self._tasks[lease] = asyncio.create_task(
            self._run(lease), name=f"fencepost-renew:{lease.run_id}"
        )

    async def stop(self, lease: Lease) -> None:
        task = self._tasks.pop(lease, None)
        if task is not None:
            task.cancel()
            # asyncio.wait does not raise the task's cancellation into us, but
            # our own cancellation still propagates.
            await asyncio.wait({task})

    async def aclose(self) -> None:
        self._closed = True
        tasks = list(self._tasks.values())
        self._tasks.clear()
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    async def _run(self, lease: Lease) -> None:
        interval = lease.ttl_ms / 3000
        backoff = self._retry.backoffs()
        delay = interval
        while True:
            await asyncio.sleep(delay)
            if lease.is_lost or not lease.is_active:
                return
            interval = lease.ttl_ms / 3000
            try:
                await lease._renew_in_background(RetryPolicy.no_retry(max(interval, 0.1)))
            except LeaseLostError:
                log.warning("lease on %r lost (token %d)", lease.run_id, lease.fencing_token)
                return
            except (UnavailableError, StorageUnavailableError) as exc:
                delay = min(backoff.next(), interval)
                log.info("renewal of %r got no answer (%s); retrying", lease.run_id, exc)
                continue
            except FencepostError as exc:
                log.warning("renewal of %r stopped: %s", lease.run_id, exc)
                return
            except Exception:
                log.exception("renewal of %r crashed", lease.run_id)
                return
            backoff = self._retry.backoffs()
            delay = interval
