"""Every knob of ``fencepost serve``, read in one place: flags > environment >
defaults. A value that cannot work is refused here (SettingsError, ConfigError:
exit 2), naming the flag or variable, before anything opens."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from .addresses import host_entry, split_address
from .auth import IDENTITY_SOURCES, is_loopback
from .core.shards import MAX_SHARDS, MIN_SHARDS
from .storage import is_url
from .storage.sqlite import Durability


class ConfigError(RuntimeError):
    """Flags that cannot work together; the server does not start (exit 2)."""


def _flag(value: str) -> bool:
    return value.strip().lower() in ("1", "true", "yes", "on")


_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000, "d": 86_400_000}


def parse_duration_ms(text: str, what: str) -> int:
    """``"90s"``, ``"30m"``, ``"12h"``, ``"7d"``, ``"500ms"`` or plain seconds
    (``"3600"``) -> ms; RuntimeError naming ``what`` for anything else."""
    t = text.strip().lower()
    for unit in ("ms", "s", "m", "h", "d"):
        if t.endswith(unit) and t[: -len(unit)].strip().isdigit():
            value = int(t[: -len(unit)]) * _UNITS_MS[unit]
            break
    else:
        value = int(t) * 1000 if t.isdigit() else 0
    if value <= 0:
        raise RuntimeError(
            f"{what}: {text!r} is not a positive duration (for example 90s, 30m, 12h, 7d)"
        )
    return value


@dataclass(frozen=True)
class Settings:
    """Every knob, read in one place (flags > environment > defaults)."""

    listen: str = "127.0.0.1:50051"
    db_path: str = "./fencepost.db"
    durability: Durability = Durability.FULL
    # The database's shard count (docs/SPEC.md §13), fixed at its first start;
    # None: the stored count (a new database gets core.shards.DEFAULT_SHARDS).
    shards: int | None = None
    log_level: str = "INFO"
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 1024
    shutdown_grace_s: float = 5.0
    max_batch: int = 1024
    # Group-commit window under load (writer/commit_delay.py); 0 turns it off.
    commit_delay_ms: float = 8.0
    request_retention_s: int = 15 * 60
    history_revisions: int = 100_000
    history_max_age_s: int = 0  # 0: no age limit on the watch history
    prune_every_s: float = 30.0
    stream_queue_limit: int = 65_536  # messages a stream may lag before it is dropped
    metrics_port: int = 0  # 0: no metrics endpoint
    # Delete runs finished longer ago than this (upkeep/retention.py): "90s", "30m",
    # "12h", "7d" or seconds; "" keeps every finished run.
    retain_terminal: str = ""
    # Identity and limits (auth.py, docs/SECURITY.md).
    tls_cert: str = ""  # with tls_key: serve TLS only
    tls_key: str = ""
    client_ca: str = ""  # mutual TLS: every connection needs a certificate this CA signed
    authz: str = ""  # TOML policy: roles and bearer tokens
    identity_from: str = "auto"  # spiffe | dns | cn; auto: that order
    allow_insecure: bool = False  # plaintext on a non-loopback address
    health_listen: str = ""  # also serve only gRPC health here, plaintext (probes under TLS)
    max_tracked_per_stream: int = 100_000  # leases one KeepAlive stream may track
    max_inflight_per_stream: int = 4096  # unanswered commands per Execute stream
    # What one client's streams may hold (hub.ClientLimits): items queued
    # for a reader (stream_queue_limit per stream) and leases tracked.
    max_queued_per_connection: int = 131_072
    max_queued_per_principal: int = 262_144
    max_tracked_per_connection: int = 100_000
    max_tracked_per_principal: int = 1_000_000
    # The dashboard, its JSON API and /metrics (web/dashboard.py); "" turns it off.
    http_listen: str = "127.0.0.1:8233"
    # Only /metrics and /healthz, e.g. on 0.0.0.0 for a scraper; "" is off.
    metrics_listen: str = ""
    # Host names the dashboard answers besides its listen address and the
    # loopback names, and its event-stream bounds (web/dashboard.py, docs/SECURITY.md).
    http_allowed_hosts: tuple[str, ...] = ()
    http_max_event_streams: int = 1024  # open at once, every client together
    http_event_streams_per_client: int = 32  # per remote address, and per principal
    http_event_queue: int = 10_000  # changed runs one stream may lag before it is dropped
    # Coordinators on one PostgreSQL database (ha/, docs/OPERATIONS.md):
    # the address clients reach this one at ("": the listen address), the
    # leader row's lease and renewal interval, and the clock bound ("0": off).
    advertise: str = ""
    # Lead only the shards assigned to this coordinator, every coordinator of
    # the database started so (ha/sharded.py, docs/OPERATIONS.md)
    lead_shards: bool = False
    leader_lease: str = "5s"
    leader_renew: str = "1s"
    max_clock_skew: str = "500ms"
    # TEST-ONLY (torture harness): OffsetClock + the TestHooks service; never by default.
    test_hooks: bool = False
    test_clock_offset_ms: int = 0  # with test_hooks: start the clock this far ahead
    fault: str = ""  # with test_hooks: a deliberately broken build (FAULTS)
    # with test_hooks: "ADDR=0-31;ADDR=32-63", who leads which shard (hooks.static_ownership)
    test_shard_map: str = ""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> Settings:
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        mapping: dict[str, tuple[str, Any]] = {
            "FENCEPOST_LISTEN": ("listen", str),
            "FENCEPOST_DB": ("db_path", str),
            "FENCEPOST_DURABILITY": ("durability", Durability),
            "FENCEPOST_SHARDS": ("shards", int),
            "FENCEPOST_LOG_LEVEL": ("log_level", str),
            "FENCEPOST_MAX_MESSAGE_BYTES": ("max_message_bytes", int),
            "FENCEPOST_METRICS_PORT": ("metrics_port", int),
            "FENCEPOST_SHUTDOWN_GRACE_S": ("shutdown_grace_s", float),
            "FENCEPOST_COMMIT_DELAY_MS": ("commit_delay_ms", float),
            "FENCEPOST_HISTORY_REVISIONS": ("history_revisions", int),
            "FENCEPOST_HISTORY_MAX_AGE_S": ("history_max_age_s", int),
            "FENCEPOST_RETAIN_TERMINAL": ("retain_terminal", str),
            "FENCEPOST_TEST_HOOKS": ("test_hooks", _flag),
            "FENCEPOST_TEST_CLOCK_OFFSET_MS": ("test_clock_offset_ms", int),
            "FENCEPOST_FAULT": ("fault", str),
            "FENCEPOST_TEST_SHARD_MAP": ("test_shard_map", str),
            "FENCEPOST_LEAD_SHARDS": ("lead_shards", _flag),
            "FENCEPOST_TLS_CERT": ("tls_cert", str),
            "FENCEPOST_TLS_KEY": ("tls_key", str),
            "FENCEPOST_CLIENT_CA": ("client_ca", str),
            "FENCEPOST_AUTHZ": ("authz", str),
            "FENCEPOST_IDENTITY_FROM": ("identity_from", str),
            "FENCEPOST_ALLOW_INSECURE": ("allow_insecure", _flag),
            "FENCEPOST_HEALTH_LISTEN": ("health_listen", str),
            "FENCEPOST_MAX_CONCURRENT_STREAMS": ("max_concurrent_streams", int),
            "FENCEPOST_MAX_TRACKED_PER_STREAM": ("max_tracked_per_stream", int),
            "FENCEPOST_MAX_INFLIGHT_PER_STREAM": ("max_inflight_per_stream", int),
            "FENCEPOST_MAX_QUEUED_PER_STREAM": ("stream_queue_limit", int),
            "FENCEPOST_MAX_QUEUED_PER_CONNECTION": ("max_queued_per_connection", int),
            "FENCEPOST_MAX_QUEUED_PER_PRINCIPAL": ("max_queued_per_principal", int),
            "FENCEPOST_MAX_TRACKED_PER_CONNECTION": ("max_tracked_per_connection", int),
            "FENCEPOST_MAX_TRACKED_PER_PRINCIPAL": ("max_tracked_per_principal", int),
            "FENCEPOST_HTTP_LISTEN": ("http_listen", str),
            "FENCEPOST_METRICS_LISTEN": ("metrics_listen", str),
            "FENCEPOST_HTTP_ALLOWED_HOSTS": ("http_allowed_hosts", _comma_list),
            "FENCEPOST_HTTP_MAX_EVENT_STREAMS": ("http_max_event_streams", int),
            "FENCEPOST_HTTP_EVENT_STREAMS_PER_CLIENT": ("http_event_streams_per_client", int),
            "FENCEPOST_HTTP_EVENT_QUEUE": ("http_event_queue", int),
            "FENCEPOST_ADVERTISE": ("advertise", str),
            "FENCEPOST_LEADER_LEASE": ("leader_lease", str),
            "FENCEPOST_LEADER_RENEW": ("leader_renew", str),
            "FENCEPOST_MAX_CLOCK_SKEW": ("max_clock_skew", str),
        }
        for var, (name, typ) in mapping.items():
            if var in env and env[var] != "":
                try:
                    values[name] = typ(env[var])
                except ValueError:
                    raise SettingsError(
                        f"{var}={env[var]!r}: {_EXPECTED.get(name, 'not a number')}"
                    ) from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        for name, var in _CHECKS.items():
            if name in values:
                from_env = var in env and overrides.get(name) is None
                values[name] = _check(name, values[name], from_env)
        return cls(**values)


class SettingsError(ValueError):
    """A flag or environment value ``fencepost serve`` cannot use (exit 2)."""


# Flag and environment names of the values checked, for the messages.
_CHECKS = {
    "listen": "FENCEPOST_LISTEN",
    "durability": "FENCEPOST_DURABILITY",
    "shards": "FENCEPOST_SHARDS",
    "log_level": "FENCEPOST_LOG_LEVEL",
    "max_message_bytes": "FENCEPOST_MAX_MESSAGE_BYTES",
    "metrics_port": "FENCEPOST_METRICS_PORT",
    "shutdown_grace_s": "FENCEPOST_SHUTDOWN_GRACE_S",
    "commit_delay_ms": "FENCEPOST_COMMIT_DELAY_MS",
    "history_revisions": "FENCEPOST_HISTORY_REVISIONS",
    "history_max_age_s": "FENCEPOST_HISTORY_MAX_AGE_S",
    "http_listen": "FENCEPOST_HTTP_LISTEN",
    "metrics_listen": "FENCEPOST_METRICS_LISTEN",
    "http_allowed_hosts": "FENCEPOST_HTTP_ALLOWED_HOSTS",
    "retain_terminal": "FENCEPOST_RETAIN_TERMINAL",
    "leader_lease": "FENCEPOST_LEADER_LEASE",
    "leader_renew": "FENCEPOST_LEADER_RENEW",
    "max_clock_skew": "FENCEPOST_MAX_CLOCK_SKEW",
}
_FLAGS = {"shutdown_grace_s": "--shutdown-grace", "db_path": "--db"}
_EXPECTED = {
    "durability": "must be one of " + ", ".join(d.value for d in Durability),
    "test_hooks": "must be 1 or 0",
}
DEFAULT_PORT = 50051
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


def duration_ms(text: str, name: str = "") -> int:
    """A leadership duration in ms ("500ms", "5s", "1m" or seconds); the clock
    bound may also be "0" or "off" (no check). ValueError otherwise."""
    t = text.strip().lower()
    if name == "max_clock_skew" and t in ("0", "off", "0ms", "0s"):
        return 0
    try:
        return parse_duration_ms(t, name)
    except RuntimeError:
        raise ValueError("is not a positive duration (for example 500ms, 5s, 1m)") from None


def _check(name: str, value: Any, from_env: bool) -> Any:
    """The value normalised, or SettingsError naming the flag or variable."""
    where = _CHECKS[name] if from_env else _FLAGS.get(name, "--" + name.replace("_", "-"))
    try:
        return _normalise(name, value)
    except ValueError as exc:
        raise SettingsError(f"{where}={value!r}: {exc}") from None


def _normalise(name: str, value: Any) -> Any:
    if name == "http_allowed_hosts":
        hosts = (value,) if isinstance(value, str) else tuple(value)
        for h in hosts:
            host_entry(h)
        return tuple(h.strip().lower() for h in hosts)
    if name in ("listen", "http_listen", "metrics_listen"):
        if name != "listen" and str(value).strip().lower() in ("", "off", "0", "none"):
            return ""
        host, port = split_address(str(value), DEFAULT_PORT if name == "listen" else 8233)
        return f"{host}:{port}"
    if name == "durability":
        return Durability(value)
    if name == "retain_terminal":
        if str(value).strip():
            try:
                parse_duration_ms(str(value), "")
            except RuntimeError:
                raise ValueError(
                    "is not a positive duration (for example 90s, 30m, 12h, 7d)"
                ) from None
        return str(value).strip()
    if name in ("leader_lease", "leader_renew", "max_clock_skew"):
        duration_ms(str(value), name)
        return str(value).strip()
    if name == "log_level":
        if str(value).upper() not in LOG_LEVELS:
            raise ValueError(f"must be one of {', '.join(LOG_LEVELS)}")
        return str(value).upper()
    low, high = {
        "max_message_bytes": (1024, 2**31 - 1),
        "metrics_port": (0, 65535),
        "shutdown_grace_s": (0, 3600),
        "commit_delay_ms": (0, 100),
        "history_revisions": (1, 2**62),
        "history_max_age_s": (0, 2**40),
        "shards": (MIN_SHARDS, MAX_SHARDS),
    }[name]
    if not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}")
    return value


def check(s: Settings) -> None:
    """The flags that must agree with one another; ConfigError otherwise."""
    if bool(s.tls_cert) != bool(s.tls_key):
        raise ConfigError("--tls-cert and --tls-key go together")
    if s.client_ca and not s.tls_cert:
        raise ConfigError("--client-ca needs --tls-cert and --tls-key (mutual TLS is TLS)")
    if s.identity_from not in IDENTITY_SOURCES:
        raise ConfigError(f"--identity-from must be one of {', '.join(IDENTITY_SOURCES)}")
    for name, value in (("--max-message-bytes", s.max_message_bytes),
                        ("--max-concurrent-streams", s.max_concurrent_streams),
                        ("--max-tracked-per-stream", s.max_tracked_per_stream),
                        ("--max-inflight-per-stream", s.max_inflight_per_stream),
                        ("--http-max-event-streams", s.http_max_event_streams),
                        ("--http-event-streams-per-client", s.http_event_streams_per_client),
                        ("--http-event-queue", s.http_event_queue),
                        ("--max-queued-per-stream", s.stream_queue_limit),
                        ("--max-queued-per-connection", s.max_queued_per_connection),
                        ("--max-queued-per-principal", s.max_queued_per_principal),
                        ("--max-tracked-per-connection", s.max_tracked_per_connection),
                        ("--max-tracked-per-principal", s.max_tracked_per_principal)):
        if value < 1:
            raise ConfigError(f"{name} must be at least 1, not {value}")
    if is_url(s.db_path) and duration_ms(s.leader_renew) >= duration_ms(s.leader_lease):
        raise ConfigError(
            f"--leader-renew {s.leader_renew} must be shorter than --leader-lease "
            f"{s.leader_lease} (the leader renews several times per lease)"
        )
    if not s.tls_cert and not s.allow_insecure and not is_loopback(s.listen):
        raise ConfigError(
            f"refusing to serve plaintext on {s.listen}: anyone who can reach it could hold "
            "or fence any lease. Serve TLS (--tls-cert FILE --tls-key FILE, and --client-ca "
            "FILE for mutual TLS), listen on 127.0.0.1, or pass --allow-insecure if the "
            "network itself is trusted"
        )
    if (s.http_listen and not s.tls_cert and not s.allow_insecure
            and not is_loopback(s.http_listen)):
        raise ConfigError(
            f"refusing to serve the dashboard in plaintext on {s.http_listen}: it reads "
            "every run and cancels them. Serve TLS (--tls-cert/--tls-key, used by the "
            "dashboard too), keep --http-listen on 127.0.0.1, or pass --allow-insecure"
        )
