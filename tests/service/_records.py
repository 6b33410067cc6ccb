"""Builders for raw-seam records on the wire."""

from __future__ import annotations

from fencepost.v1 import record_pb2 as rpb

T0 = 1_700_000_000_000


def raw_run(
    run_id: str = "s1",
    version: int = 1,
    token: int = 1,
    *,
    status: int = 1,
    owner: str | None = None,
    now: int = T0,
) -> rpb.Run:
    run = rpb.Run(
        schema=1,
        run_id=run_id,
        version=version,
        status=status,  # type: ignore[arg-type]
        attempt=1,
        fencing_token=token,
    )
    run.created_at.FromMilliseconds(now)
    run.updated_at.FromMilliseconds(now)
    if owner is not None:
        run.lease.owner = owner
        run.lease.acquired_at.FromMilliseconds(now)
        run.lease.expires_at.FromMilliseconds(now + 10_000)
        run.lease.ttl_ms = 10_000
    return run


def bump(run: rpb.Run, **changes: object) -> rpb.Run:
    nxt = rpb.Run()
    nxt.CopyFrom(run)
    nxt.version = run.version + 1
    nxt.revision = 0
    for k, v in changes.items():
        setattr(nxt, k, v)
    return nxt
