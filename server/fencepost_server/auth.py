"""Identity and authorization: who a caller is, which role each RPC needs, and
which lease owners a caller may use (docs/SECURITY.md).

* **Principal.** With mutual TLS, the client certificate's SPIFFE id (exactly
  one URI SAN), else its first DNS SAN, else its CN (``--identity-from``
  picks one source only). A bearer token (``authorization: Bearer ...``,
  stored as its SHA-256 hex digest in the policy file) names a principal too,
  on any listener, and wins over the certificate when both are presented.
* **Roles.** ``RPC_ROLES`` is the one table of which role each RPC needs;
  ``COMMAND_ROLES`` the same for the commands of ``Ledger.Execute``. ``admin``
  may call everything. Without a policy file every caller has every role.
* **Owners.** When callers have identities (mutual TLS or tokens), a
  non-admin caller may only use an owner equal to its principal or starting
  with ``principal/``. ``OWNER_FIELDS`` names every owner-bearing field of
  every request message, so the unary calls, Execute's commands and the
  engine store share one check; KeepAlive checks its ``hello``.

``Guard`` checks every servicer method first (rpc/interceptors.py):
it authenticates, checks the role and the request's owners, and makes the
principal visible to the handler and the tasks it starts (``current()``).
Health and reflection are registered elsewhere and stay open.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import logging
import tomllib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from fencepost._security import is_loopback as _host_is_loopback

from .core.errors import Code, LedgerError, owner_bound_ok, owner_not_permitted
from .scope import REQUEST_SCOPE

log = logging.getLogger("fencepost.auth")

ADMIN, OPERATOR, WORKER = "admin", "operator", "worker"
ROLES = (ADMIN, OPERATOR, WORKER)
ALL_ROLES = frozenset(ROLES)
IDENTITY_SOURCES = ("auto", "spiffe", "dns", "cn")

_W, _O = frozenset({WORKER}), frozenset({OPERATOR})
_WO = _W | _O
_ADMIN_ONLY: frozenset[str] = frozenset()

# RPC (full method name) -> the roles besides admin that may call it.
RPC_ROLES: dict[str, frozenset[str]] = {
    **{
        f"/fencepost.v1.Ledger/{m}": _W
        for m in ("Acquire", "Renew", "RecordCheckpoint", "Suspend", "Finish", "Release",
                  "KeepAlive")
    },
    "/fencepost.v1.Ledger/Cancel": _O,
    "/fencepost.v1.Ledger/RequestResume": _O,
    "/fencepost.v1.Ledger/GetRun": _WO,
    "/fencepost.v1.Ledger/ValidateFence": _WO,
    "/fencepost.v1.Ledger/Shards": _WO,
    "/fencepost.v1.Ledger/MoveShard": _O,
    "/fencepost.v1.Ledger/ListRuns": _O,
    "/fencepost.v1.Ledger/WatchRuns": _O,
    "/fencepost.v1.Ledger/DeleteRun": _ADMIN_ONLY,
    # Execute carries commands of every role: each is checked (COMMAND_ROLES).
    "/fencepost.v1.Ledger/Execute": _WO,
    # Transact too: each of its commands is checked as on Execute.
    "/fencepost.v1.Ledger/Transact": _WO,
    **{
        f"/fencepost.v1.RunStore/{m}": _ADMIN_ONLY
        for m in ("Describe", "Get", "Create", "CompareAndSet", "Delete")
    },
    # TEST-ONLY (--test-hooks): moves the server's clock.
    "/fencepost.v1.TestHooks/JumpClock": _ADMIN_ONLY,
}
ENGINE_STORE_RPCS = (
    "CreateRun", "GetRun", "UpdateRun", "ListRuns", "ClaimRun", "RenewClaim", "AppendStep",
    "ListSteps", "SaveCheckpoint", "LatestCheckpoint", "ClaimKey", "AcquireLock",
    "ReleaseLock", "GetEffect", "PutEffect", "KvGet", "KvSet", "DocList", "DocUpsert",
    "DocDelete", "PutArtifact", "GetArtifact", "ReadArtifact", "ListArtifacts",
    "DeleteArtifact",
)
RPC_ROLES.update({f"/fencepost.v1.EngineStore/{m}": _W for m in ENGINE_STORE_RPCS})

# Execute command kind -> the roles besides admin that may send it (its RPC's).
COMMAND_ROLES: dict[str, frozenset[str]] = {
    **{k: _W for k in ("acquire", "renew", "record_checkpoint", "suspend", "finish",
                       "release")},
    "cancel": _O,
    "request_resume": _O,
    "delete_run": _ADMIN_ONLY,
    "transaction": _WO,  # and then each of its commands (check_owners)
    **{k: _W for k in ("create_run", "update_run", "claim_run", "renew_claim", "append_step",
                       "save_checkpoint", "claim_key", "acquire_lock", "release_lock",
                       "put_effect", "kv_set", "doc_upsert", "doc_delete")},
}

# Request message -> its owner-bearing fields (dotted paths; an unset
# optional field or message is not checked).
OWNER_FIELDS: dict[str, tuple[str, ...]] = {
    **{f"fencepost.v1.{m}Request": ("owner",)
       for m in ("Acquire", "Renew", "RecordCheckpoint", "Suspend", "Finish", "Release")},
    "fencepost.v1.EngineClaimRunRequest": ("owner",),
    "fencepost.v1.EngineRenewClaimRequest": ("owner",),
    "fencepost.v1.EngineAcquireLockRequest": ("owner",),
    "fencepost.v1.EngineReleaseLockRequest": ("owner",),
    "fencepost.v1.EngineUpdateRunRequest": ("expect_owner",),
    # the raw seam writes a lease's owner directly
    "fencepost.v1.CreateRequest": ("run.lease.owner",),
    # CompareAndSet: decided by the writer (bound_to; keeping the holder is no grant)
    "fencepost.v1.KeepAliveHello": ("owner",),
}


def role_needed(allowed: frozenset[str]) -> str:
    """ErrorInfo ``role``: the roles any of which would do, comma-separated."""
    return ",".join(sorted(allowed)) if allowed else ADMIN


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling. ``name`` is "" when the server asks no credentials."""

    name: str
    roles: frozenset[str]
    bound: bool  # owner binding applies (identities are on and it is no admin)

    def may_use_owner(self, owner: str) -> bool:
        return not self.bound or owner_bound_ok(self.name, owner)


OPEN = Principal("", ALL_ROLES, bound=False)
_current: contextvars.ContextVar[Principal] = contextvars.ContextVar(
    "fencepost_principal", default=OPEN
)


def current() -> Principal:
    """The principal of the RPC being handled (OPEN outside a guarded call)."""
    return _current.get()


def denied(allowed: frozenset[str], principal: Principal, what: str) -> LedgerError:
    role = role_needed(allowed)
    return LedgerError(
        Code.PERMISSION_DENIED,
        f"{what} needs the role {role.replace(',', ' or ')}; {principal.name!r} has "
        f"{', '.join(sorted(principal.roles)) or 'no role'}",
        metadata={"role": role, "principal": principal.name},
    )


def check_role(principal: Principal, allowed: frozenset[str], what: str) -> None:
    if ADMIN in principal.roles or principal.roles & allowed:
        return
    raise denied(allowed, principal, what)


def check_owner(principal: Principal, owner: str, field_name: str) -> None:
    if not principal.may_use_owner(owner):
        raise owner_not_permitted(principal.name, owner, field_name)


def _get_path(msg: Any, path: str) -> str | None:
    *parents, leaf = path.split(".")
    for name in parents:
        if not msg.HasField(name):
            return None
        msg = getattr(msg, name)
    desc = msg.DESCRIPTOR.fields_by_name[leaf]
    if desc.has_presence and not msg.HasField(leaf):
        return None
    value: str = getattr(msg, leaf)
    return value


def check_owners(principal: Principal, request: Any, prefix: str = "") -> None:
    """Refuse a request naming an owner the principal may not use (and, for
    a transaction, a command its role may not send)."""
    if not principal.bound:  # no identities, or an admin: every role, any owner
        return
    descriptor = getattr(request, "DESCRIPTOR", None)
    if descriptor is None:  # Malformed: the handler refuses it
        return
    if descriptor.full_name == "fencepost.v1.TransactionRequest":
        check_transaction(principal, request, prefix)
        return
    for path in OWNER_FIELDS.get(descriptor.full_name, ()):
        owner = _get_path(request, path)
        if owner is not None:
            check_owner(principal, owner, prefix + path)


def check_transaction(principal: Principal, request: Any, prefix: str = "") -> None:
    """Every command of a transaction (Ledger.Transact, or Execute's
    ``transaction``) as if sent alone: its RPC's role, then its owners."""
    for i, cmd in enumerate(request.commands):
        kind = cmd.WhichOneof("kind")
        if kind is None or kind not in COMMAND_ROLES:
            continue  # refused by the handler (empty, or a nested transaction)
        check_role(principal, COMMAND_ROLES[kind], f"the {kind} command")
        check_owners(principal, getattr(cmd, kind), prefix=f"{prefix}commands[{i}].{kind}.")


def bound_to(principal: Principal) -> str | None:
    """The name a raw CompareAndSet's new lease owner, and the live holder of
    the run a raw swap or delete changes, are bound to (None: not bound). The
    writer judges it against the version the write replaces, after the
    request id: keeping that version's lease holder is no grant, and a retry
    of a write already made gets its answer, not a refusal."""
    return principal.name if principal.bound else None


def check_command(kind: str, request: Any) -> None:
    """One Execute command: its RPC's role, then its owners."""
    principal = current()
    check_role(principal, COMMAND_ROLES[kind], f"the {kind} command")
    check_owners(principal, request, prefix=f"{kind}.")


# -- the policy file -----------------------------------------------------------------


class PolicyError(ValueError):
    """The policy file is unreadable or malformed (the message names the key)."""


@dataclass(frozen=True)
class Policy:
    """``--authz FILE``: ``[roles]`` role -> principal patterns (exact or
    ``*`` globs); ``[tokens]`` principal -> SHA-256 hex of its bearer token."""

    roles: dict[str, tuple[str, ...]] | None = None  # None: every caller has every role
    tokens: dict[str, str] = field(default_factory=dict)  # digest -> principal

    @classmethod
    def load(cls, path: str | Path) -> Policy:
        try:
            data = tomllib.loads(Path(path).read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
            raise PolicyError(f"--authz {path}: {exc}") from None
        return cls.parse(data, str(path))

    @classmethod
    def parse(cls, data: dict[str, Any], where: str = "policy") -> Policy:
        unknown = set(data) - {"roles", "tokens"}
        if unknown:
            raise PolicyError(f"{where}: unknown table {sorted(unknown)[0]!r} "
                              "(known: roles, tokens)")
        roles: dict[str, tuple[str, ...]] | None = None
        if "roles" in data:
            raw = data["roles"]
            if not isinstance(raw, dict):
                raise PolicyError(f"{where}: [roles] must be a table")
            roles = {}
            for role, patterns in raw.items():
                if role not in ROLES:
                    raise PolicyError(f"{where}: roles.{role}: unknown role (known: "
                                      f"{', '.join(ROLES)})")
                if not isinstance(patterns, list) or not all(
                    isinstance(p, str) and p for p in patterns
                ):
                    raise PolicyError(f"{where}: roles.{role}: must be a list of "
                                      "non-empty principal patterns")
                roles[role] = tuple(patterns)
        tokens: dict[str, str] = {}
        raw_tokens = data.get("tokens", {})
        if not isinstance(raw_tokens, dict):
            raise PolicyError(f"{where}: [tokens] must be a table")
        for principal, digest in raw_tokens.items():
            if not isinstance(digest, str) or len(digest) != 64 or any(
                c not in "0123456789abcdef" for c in digest.lower()
            ):
                raise PolicyError(f"{where}: tokens.{principal}: must be the SHA-256 hex "
                                  "digest (64 hex digits) of the token")
            if digest.lower() in tokens:
                raise PolicyError(f"{where}: tokens.{principal}: the same digest as "
                                  f"tokens.{tokens[digest.lower()]}")
            tokens[digest.lower()] = principal
        return cls(roles, tokens)

    def roles_of(self, principal: str) -> frozenset[str]:
        if self.roles is None:
            return ALL_ROLES
        return frozenset(
            role for role, patterns in self.roles.items()
            if any(fnmatch.fnmatchcase(principal, p) for p in patterns)
        )


def token_digest(token: str) -> str:
    """What the ``[tokens]`` table stores for a bearer token."""
    return hashlib.sha256(token.encode()).hexdigest()


# -- the authenticator -----------------------------------------------------------------


class Authenticator:
    """Turns a call's TLS peer and metadata into a Principal."""

    def __init__(self, *, mtls: bool, policy: Policy | None, identity_from: str = "auto"):
        if identity_from not in IDENTITY_SOURCES:
            raise ValueError(f"--identity-from must be one of {', '.join(IDENTITY_SOURCES)}")
        self.mtls = mtls
        self.policy = policy or Policy()
        self.identity_from = identity_from
        self.has_policy = policy is not None
        # Identities are on: owner binding applies, and a caller without
        # credentials is refused.
        self.identities = mtls or bool(self.policy.tokens)
        self._cache: dict[str, Principal] = {}

    def _principal_named(self, name: str) -> Principal:
        p = self._cache.get(name)
        if p is None:
            roles = self.policy.roles_of(name)
            bound = not (self.has_policy and self.policy.roles is not None and ADMIN in roles)
            p = Principal(name, roles, bound)
            if len(self._cache) < 65_536:
                self._cache[name] = p
        return p

    def _from_certificate(self, ctx: Mapping[str, Iterable[bytes]]) -> str | None:
        def first(key: str) -> str | None:
            for value in ctx.get(key, ()):
                return value.decode()
            return None

        sources = {
            "spiffe": lambda: first("peer_spiffe_id"),
            "dns": lambda: first("peer_dns"),
            "cn": lambda: first("x509_common_name"),
        }
        order = ("spiffe", "dns", "cn") if self.identity_from == "auto" else (self.identity_from,)
        for source in order:
            name = sources[source]()
            if name:
                return name
        return None

    def authenticate(self, context: grpc.aio.ServicerContext) -> Principal:
        if not self.identities:
            return OPEN
        header = next((str(value) for key, value in context.invocation_metadata() or ()
                       if key == "authorization"), None)
        return self.identify(header, context.auth_context)

    def identify(self, authorization: str | None,
                 certificate: Callable[[], Mapping[str, Iterable[bytes]]]) -> Principal:
        """The principal of a call with this ``authorization`` header (None:
        absent) over a connection whose verified certificate ``certificate()``
        describes (gRPC's auth-context keys). The gRPC port and the dashboard
        share it, so both accept and refuse the same credentials."""
        if not self.identities:
            return OPEN
        if authorization is not None:
            scheme, _, token = authorization.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise LedgerError(Code.UNAUTHENTICATED,
                                  "the authorization header must be 'Bearer TOKEN'")
            name = self.policy.tokens.get(token_digest(token.strip()))
            if name is None:
                raise LedgerError(Code.UNAUTHENTICATED, "unknown bearer token")
            return self._principal_named(name)
        if self.mtls:
            name = self._from_certificate(certificate())
            if name is None:
                wanted = ("a SPIFFE id, DNS SAN or CN" if self.identity_from == "auto"
                          else self.identity_from)
                raise LedgerError(Code.UNAUTHENTICATED,
                                  f"the client certificate carries no identity ({wanted})")
            return self._principal_named(name)
        raise LedgerError(
            Code.UNAUTHENTICATED,
            "this server requires credentials: a client certificate or "
            "'authorization: Bearer TOKEN'",
        )


def certificate_fields(peercert: Mapping[str, Any] | None) -> dict[str, list[bytes]]:
    """A verified peer certificate as Python's ssl module gives it
    (``getpeercert()``), under the auth-context keys gRPC uses: a SPIFFE id
    only when it is the one URI SAN, as gRPC has it."""
    if not peercert:
        return {}
    sans = peercert.get("subjectAltName", ())
    uris = [v for k, v in sans if k == "URI"]
    out = {
        "peer_dns": [v.encode() for k, v in sans if k == "DNS"],
        "x509_common_name": [v.encode() for rdn in peercert.get("subject", ())
                             for k, v in rdn if k == "commonName"][:1],
    }
    if len(uris) == 1 and uris[0].lower().startswith("spiffe://"):
        out["peer_spiffe_id"] = [uris[0].encode()]
    return out



class Guard:
    """What every servicer method checks first (rpc/interceptors.py wraps each
    in one): authenticate, check its role and (unary requests) its owners,
    then make the principal ``current()`` for the call."""

    def __init__(self, authn: Authenticator, method: str, *, unary_request: bool) -> None:
        self.authn = authn
        self.allowed = RPC_ROLES.get(method, _ADMIN_ONLY)
        self.what = method.rsplit("/", 1)[-1]
        self.unary_request = unary_request

    def admit(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        """Raises the refusal (a LedgerError); sets the caller's principal otherwise."""
        principal = self.authn.authenticate(context)
        check_role(principal, self.allowed, self.what)
        if self.unary_request:
            check_owners(principal, request)
        _current.set(principal)
        REQUEST_SCOPE.set(principal.name)


# -- TLS -----------------------------------------------------------------------------


def is_loopback(listen: str) -> bool:
    """Whether a listen address only accepts local connections."""
    if listen.startswith(("unix:", "unix-abstract:")):
        return True
    return _host_is_loopback(listen)
