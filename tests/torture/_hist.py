"""Tiny builders for hand-written histories (times in ms, records minimal)."""

from __future__ import annotations

from typing import Any

from torture.history import RUNNING, Op

_n = [0]


def rec(v: int, tok: int = 1, owner: str | None = "A", status: int = RUNNING,
        rev: int | None = None, run: str = "r", **extra: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"schema": 1, "run_id": run, "version": v, "status": status,
                         "attempt": 1, "fencing_token": tok, "created_at": 0,
                         "updated_at": v, "revision": v if rev is None else rev}
    if owner is not None:
        d["lease"] = [owner, 0, 1000, 1000, 0]
    d.update(extra)
    return d


def op(f: str, inv: float, cmp: float | None, st: str = "ok", r: dict[str, Any] | None = None,
       *, run: str = "r", code: str = "", client: str = "", x: dict[str, Any] | None = None,
       **a: Any) -> Op:
    _n[0] += 1
    return Op(id=f"o{_n[0]}", client=client or f"c{_n[0]}", run=run, f=f,
              inv=int(inv * 1e6), cmp=None if cmp is None else int(cmp * 1e6),
              st=st, code=code, a=a, rec=r, x=x or {})
