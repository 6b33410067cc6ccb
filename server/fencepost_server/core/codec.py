"""Results and refusals as plain data, for the durable request-id cache (docs/SPEC.md §5.5).

A repeated request id is answered with exactly the original answer, also after
a restart, so answers are stored as JSON-able dicts. Pure.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import fields
from typing import Any

from . import ledger as L
from .errors import Code, LedgerError
from .records import record_from_dict, record_to_dict


def fingerprint(cmd: L.Command, scope: str = "") -> str:
    """A digest of the command without its request id: a reused id with a
    different request is refused rather than answered with a stale answer.
    ``scope`` is the principal that sent it when identities are on: the same
    request from another principal is another request, refused alike. It is
    left out when "" (no identities), and when a raw swap's ``bound_to``
    already names it, so those fingerprints are the ones they always were.

    The digest is of the command's dataclass ``repr`` with ``request_id=''``
    (and without a ``fence`` or ``bound_to`` that is None) — stable
    across releases, since stored fingerprints must still match after an
    upgrade — built field by field (``_repr_without_request_id``): the
    generated ``__repr__`` behind ``dataclasses.replace`` cost 10 us a command."""
    text = _repr_without_request_id(cmd)
    if scope and getattr(cmd, "bound_to", None) != scope:
        text += f"|scope={scope!r}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


_REPR_FIELDS: dict[type, tuple[str, tuple[str, ...]]] = {}
_NONE_LEFT_OUT = frozenset({"fence", "bound_to"})


def _repr_without_request_id(cmd: Any) -> str:
    """Exactly ``repr(dataclasses.replace(cmd, request_id=""))``, without the copy."""
    cls = type(cmd)
    spec = _REPR_FIELDS.get(cls)
    if spec is None:
        names = tuple(f.name for f in fields(cls) if f.repr)
        spec = _REPR_FIELDS[cls] = (cls.__qualname__, names)
    qualname, names = spec
    # An absent fence or binding is left out, so that such a command's
    # fingerprint is the one it had before commands could carry them.
    parts = [
        "request_id=''" if name == "request_id" else f"{name}={value!r}"
        for name in names
        if (value := getattr(cmd, name)) is not None or name not in _NONE_LEFT_OUT
    ]
    return f"{qualname}({', '.join(parts)})"


_BY_NAME: dict[str, Callable[[dict[str, Any]], Any]] = {}
_BY_TYPE: dict[type, tuple[str, Callable[[Any], dict[str, Any]]]] = {}


def register(
    name: str,
    cls: type,
    to_dict: Callable[[Any], dict[str, Any]],
    from_dict: Callable[[dict[str, Any]], Any],
) -> None:
    """Teach the cache another result type (the engine store's results)."""
    _BY_NAME[name] = from_dict
    _BY_TYPE[cls] = (name, to_dict)


def encode(answer: Any) -> dict[str, Any]:
    extra = _BY_TYPE.get(type(answer))
    if extra is not None:
        return {"t": "x", "k": extra[0], "v": extra[1](answer)}
    match answer:
        case LedgerError():
            d: dict[str, Any] = {"t": "error", "code": answer.code.value, "msg": answer.message}
            if answer.field is not None:
                d["field"] = answer.field
            if answer.metadata:
                d["meta"] = answer.metadata
            if answer.record is not None:
                d["r"] = record_to_dict(answer.record)
            return d
        case L.Created():
            return {"t": "created", "ok": answer.created, "r": record_to_dict(answer.record)}
        case L.Swapped():
            d = {"t": "swapped", "ok": answer.swapped}
            if answer.record is not None:
                d["r"] = record_to_dict(answer.record)
            return d
        case L.Deleted():
            return {
                "t": "deleted",
                "ok": answer.deleted,
                "rev": answer.revision,
                "tok": answer.fencing_token,
            }
        case _:
            return {"t": "record", "r": record_to_dict(answer)}


def decode(d: dict[str, Any]) -> Any:
    if d["t"] == "x":
        return _BY_NAME[d["k"]](d["v"])
    rec = record_from_dict(d["r"]) if "r" in d else None
    match d["t"]:
        case "error":
            return LedgerError(Code(d["code"]), d["msg"], rec, d.get("field"), d.get("meta"))
        case "created":
            assert rec is not None
            return L.Created(d["ok"], rec)
        case "swapped":
            return L.Swapped(d["ok"], rec)
        case "deleted":
            return L.Deleted(d["ok"], d["rev"], d["tok"])
        case _:
            assert rec is not None
            return rec


register(
    "ledger.transaction",
    L.TransactionDone,
    lambda done: {"results": [encode(r) for r in done.results]},
    lambda d: L.TransactionDone(tuple(decode(r) for r in d["results"])),
)
