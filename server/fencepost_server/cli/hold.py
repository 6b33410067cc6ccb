"""``fencepost hold``: run a command while holding a run's lease (``flock``,
``etcdctl lock``, ``consul lock`` for fencepost).

    fencepost hold RUN_ID [--ttl TTL] [--wait] [--release] [--grace S] -- CMD ARGS...

1. Acquire RUN_ID (with ``--wait``: until it is acquirable; a lease held by
   another owner, a lock-delay or a suspension is waited out, a finished run
   is refused).
2. Run CMD with ``FENCEPOST_RUN_ID``, ``FENCEPOST_OWNER``,
   ``FENCEPOST_FENCING_TOKEN`` and ``FENCEPOST_ADDR`` (the leader's address)
   in its environment, and ``FENCEPOST_ENDPOINTS`` when ``--endpoints`` named
   several; the lease is renewed in the background while it runs, on
   whichever coordinator leads. SIGINT, SIGTERM and
   SIGHUP sent to ``hold`` are passed on to CMD.
3. When CMD exits: finish the run ``completed`` (status 0) or ``failed`` with
   the outcome code ``EXIT_<status>`` (a CMD killed by signal N has status
   128+N), or with ``--release`` give it back (queued); then exit with CMD's
   status.
4. When the lease is lost while CMD runs (an operator cancelled or deleted
   the run, another owner took it over) or can no longer be assumed held
   (no renewal answered before its safe-until: the coordinator is down or
   unreachable), CMD gets SIGTERM, then SIGKILL after ``--grace`` seconds,
   and ``hold`` exits 4. Downstream writes that check the fencing token
   refuse CMD from the moment the fence moved, whatever CMD still does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from datetime import UTC, datetime
from typing import Any, TextIO

import fencepost
from fencepost import LeaseHeldError, LeaseLostError, RunSuspendedError

from ..config import parse_duration_ms
from .common import EXIT_LOST, positive_int, security

DEFAULT_GRACE_S = 10.0
MAX_WAIT_STEP_S = 1.0  # --wait re-tries at least this often, watching the run in between
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _grace(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 <= value <= 3600:
        raise argparse.ArgumentTypeError(f"must be between 0 and 3600 (got {text})")
    return value


def _ttl_ms(text: str) -> int:
    """``--ttl``: plain milliseconds (``30000``), or a duration (``30s``, ``2m``, ``500ms``)."""
    if text.strip().isdigit():
        return positive_int(text)
    try:
        return parse_duration_ms(text, "--ttl")
    except RuntimeError:
        raise argparse.ArgumentTypeError(
            f"not milliseconds or a duration such as 30s or 2m: {text!r}") from None


def add_hold_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    p = sub.add_parser(
        "hold",
        parents=[common],
        help="run a command while holding a run's lease (flock for fencepost)",
        description=__doc__.split("\n\n", 2)[2] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("run_id", metavar="RUN_ID")
    p.add_argument(
        "--ttl", dest="ttl_ms", type=_ttl_ms, metavar="TTL",
        help="lease ttl: milliseconds, or a duration such as 30s or 2m (default 60000)",
    )
    p.add_argument(
        "--wait", action="store_true", help="block until the run is acquirable instead of failing"
    )
    p.add_argument(
        "--release",
        action="store_true",
        help="when CMD exits, give the run back (queued) instead of finishing it",
    )
    p.add_argument(
        "--grace",
        type=_grace,
        default=DEFAULT_GRACE_S,
        help=f"seconds between SIGTERM and SIGKILL when the lease is lost "
        f"(default {DEFAULT_GRACE_S:g})",
    )
    p.add_argument("--owner", help="lease owner (default: host:pid)")


def run_hold(args: argparse.Namespace, retry: fencepost.RetryPolicy, err: TextIO) -> int:
    return asyncio.run(_hold(args, retry, err))


def _say(err: TextIO, text: str) -> None:
    err.write(f"fencepost hold: {text}\n")
    err.flush()


async def _hold(args: argparse.Namespace, retry: fencepost.RetryPolicy, err: TextIO) -> int:
    kwargs: dict[str, Any] = {"retry": retry, **security(args)}
    if args.ttl_ms is not None:
        kwargs["default_ttl_ms"] = args.ttl_ms
    async with fencepost.Client(args.endpoints, owner=args.owner, **kwargs) as client:
        lease = await _acquire(client, args, err)
        env = dict(
            os.environ,
            FENCEPOST_RUN_ID=lease.run_id,
            FENCEPOST_OWNER=lease.owner,
            FENCEPOST_FENCING_TOKEN=str(lease.fencing_token),
            FENCEPOST_ADDR=client.address,  # the leader
        )
        if len(args.endpoints) > 1:
            env["FENCEPOST_ENDPOINTS"] = ",".join(args.endpoints)
        try:
            proc = await asyncio.create_subprocess_exec(*args.cmd, env=env)
        except OSError as exc:
            _say(err, f"cannot run {args.cmd[0]!r}: {exc.strerror or exc}")
            with contextlib.suppress(fencepost.FencepostError):
                await lease.release()
            return 127 if isinstance(exc, FileNotFoundError) else 126
        loop = asyncio.get_running_loop()
        for sig in _FORWARDED:
            loop.add_signal_handler(sig, _forward, proc, sig)
        try:
            return await _supervise(lease, proc, args, err)
        finally:
            for sig in _FORWARDED:
                loop.remove_signal_handler(sig)


def _forward(proc: asyncio.subprocess.Process, sig: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _status(returncode: int) -> int:
    return 128 - returncode if returncode < 0 else returncode


async def _supervise(
    lease: fencepost.Lease,
    proc: asyncio.subprocess.Process,
    args: argparse.Namespace,
    err: TextIO,
) -> int:
    exited = asyncio.ensure_future(proc.wait())
    at_risk = asyncio.ensure_future(lease.at_risk_event.wait())
    try:
        await asyncio.wait({exited, at_risk}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        at_risk.cancel()
    if not (lease.is_lost or lease.at_risk) and exited.done():
        return await _settle(lease, _status(exited.result()), args, err)
    if lease.is_lost:
        why = f"lost the lease on {lease.run_id!r} ({lease.lost_reason})"
    else:
        why = (
            f"the lease on {lease.run_id!r} can no longer be assumed held (no renewal "
            "answered before its safe-until; is the coordinator reachable?)"
        )
    if proc.returncode is None:
        _say(err, f"{why}; stopping the command (SIGTERM, SIGKILL after {args.grace:g}s)")
        _forward(proc, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(exited), args.grace)
        except TimeoutError:
            _forward(proc, signal.SIGKILL)
            await exited
    else:
        _say(err, why)
    if not lease.is_lost:  # at risk only: give it back if the server answers quickly
        with contextlib.suppress(fencepost.FencepostError, TimeoutError):
            await asyncio.wait_for(lease.release(), 2.0)
    return EXIT_LOST


async def _settle(
    lease: fencepost.Lease, status: int, args: argparse.Namespace, err: TextIO
) -> int:
    """After CMD exited on its own: finish or release the run; CMD's status."""
    try:
        if args.release:
            await lease.release()
        elif status == 0:
            await lease.finish("completed")
        else:
            await lease.finish("failed", f"EXIT_{status}", f"{args.cmd[0]} exited with {status}")
    except LeaseLostError as exc:
        _say(err, f"lost the lease on {lease.run_id!r} before the command's end was recorded "
                  f"({exc.message})")
        return EXIT_LOST
    return status


async def _acquire(
    client: fencepost.Client, args: argparse.Namespace, err: TextIO
) -> fencepost.Lease:
    told = False
    while True:
        try:
            return await client.acquire(args.run_id)
        except (LeaseHeldError, RunSuspendedError) as exc:
            if not args.wait:
                raise
            if not told:
                _say(err, f"waiting for {args.run_id!r}: {exc.message}")
                told = True
            await _wait_for_change(client, args.run_id, _wait_step(exc))


def _wait_step(exc: fencepost.FencepostError) -> float:
    """How long to watch before trying again: until the held lease (and its
    lock-delay) ends, at most MAX_WAIT_STEP_S."""
    rec = exc.record
    if rec is None or rec.lease is None:
        return MAX_WAIT_STEP_S
    ends = rec.lease.expires_at.timestamp() + rec.lease.lock_delay_ms / 1000
    return min(MAX_WAIT_STEP_S, max(0.05, ends - datetime.now(UTC).timestamp()))


async def _wait_for_change(client: fencepost.Client, run_id: str, wait_s: float) -> None:
    events = client.watch([run_id])
    try:
        await asyncio.wait_for(anext(events), wait_s)  # type: ignore[arg-type]
    except (TimeoutError, StopAsyncIteration):
        pass
    finally:
        await events.aclose()  # type: ignore[attr-defined]
