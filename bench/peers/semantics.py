"""The run-lease rules of docs/SPEC.md §5.1-§5.2, once per peer.

A record holds: status, fencing token, lease (owner, expiry, ttl), attempt,
version, checkpoint and outcome. The rules:

* **acquire(run, owner, ttl)**: no record -> create (running, token 1, attempt
  1). Terminal -> refused ``terminal``; suspended -> ``suspended``; a live
  lease (now < expires) held by another owner -> ``held``. Otherwise token + 1,
  a fresh lease, attempt + 1 only when it takes over a lease that existed
  (unless the same owner re-acquires its own live lease).
* **renew / checkpoint / finish / release(run, owner, token)**: the fence
  check first: the record exists (else ``not_found``), its token and its
  lease owner are the handle's (else ``lost``). Renew moves the expiry to now
  + ttl, checkpoint also sets the checkpoint, finish -> completed and release
  -> queued, both dropping the lease. Finish and release converge: a record
  already in the target status under the same token is returned unchanged.

Expiry uses the server's clock where the peer has one (PostgreSQL's
``statement_timestamp()``, Redis's ``TIME`` inside the script, fencepost's
system clock); etcd has no server time in a transaction, so its client's
clock decides (one machine here, so one clock). Times are in milliseconds,
as fencepost stores them, except PostgreSQL's own ``timestamptz``.

Here: the rules in Python (the etcd client runs them between its Range and
its Txn), the SQL the PostgreSQL client sends (one statement per command) and
the Lua scripts the Redis client sends (one EVALSHA per command).
"""

from __future__ import annotations

import time
from typing import Any

TERMINAL = frozenset({"completed", "failed", "cancelled"})


class Refused(Exception):
    """The backend refused a command for a lease reason, not a failure.

    ``reason`` is one of held, lost, terminal, suspended, not_found, conflict.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def now_ms() -> int:
    return time.time_ns() // 1_000_000


Record = dict[str, Any]


def decide_acquire(rec: Record | None, now: int, owner: str, ttl_ms: int) -> Record:
    if rec is None:
        return {
            "status": "running", "token": 1, "owner": owner, "acquired": now,
            "expires": now + ttl_ms, "ttl": ttl_ms, "attempt": 1, "version": 1,
            "created": now, "updated": now,
        }
    status = rec["status"]
    if status in TERMINAL:
        raise Refused("terminal")
    if status == "suspended":
        raise Refused("suspended")
    holder = rec.get("owner")
    live = holder is not None and now < rec["expires"]
    if live and holder != owner:
        raise Refused("held")
    takeover = holder is not None and not (live and holder == owner)
    return {
        **rec, "status": "running", "token": rec["token"] + 1, "owner": owner,
        "acquired": now, "expires": now + ttl_ms, "ttl": ttl_ms,
        "attempt": rec["attempt"] + (1 if takeover else 0),
        "version": rec["version"] + 1, "updated": now,
    }


def _fence(rec: Record | None, owner: str, token: int) -> Record:
    if rec is None:
        raise Refused("not_found")
    if rec["token"] != token or rec.get("owner") != owner:
        raise Refused("lost")
    return rec


def decide_renew(
    rec: Record | None, now: int, owner: str, token: int, ttl_ms: int | None = None
) -> Record:
    rec = _fence(rec, owner, token)
    ttl = ttl_ms if ttl_ms is not None else rec["ttl"]
    return {**rec, "expires": now + ttl, "version": rec["version"] + 1, "updated": now}


def decide_checkpoint(
    rec: Record | None, now: int, owner: str, token: int, key: str, snapshot: int
) -> Record:
    rec = _fence(rec, owner, token)
    return {
        **rec, "expires": now + rec["ttl"], "ckpt": [key, snapshot, now],
        "version": rec["version"] + 1, "updated": now,
    }


def _drop_lease(rec: Record, now: int, status: str, **extra: Any) -> Record:
    out = {**rec, **extra, "status": status, "version": rec["version"] + 1, "updated": now}
    for k in ("owner", "acquired", "expires"):
        out.pop(k, None)
    return out


def decide_finish(rec: Record | None, now: int, owner: str, token: int) -> Record | None:
    """The new record, or None when the same handle already finished it."""
    if rec is not None and rec["status"] == "completed" and rec["token"] == token:
        return None
    rec = _fence(rec, owner, token)
    return _drop_lease(rec, now, "completed", outcome="ok")


def decide_release(rec: Record | None, now: int, owner: str, token: int) -> Record | None:
    if rec is not None and rec["status"] == "queued" and rec["token"] == token:
        return None
    rec = _fence(rec, owner, token)
    return _drop_lease(rec, now, "queued")


# -- PostgreSQL: one statement per command, autocommit, synchronous_commit=on --

PG_USER = "bench"  # the database role (trust authentication, 127.0.0.1 only)

PG_SCHEMA = """
CREATE TABLE IF NOT EXISTS runs (
    run_id       text PRIMARY KEY,
    status       text NOT NULL,
    token        bigint NOT NULL,
    owner        text,
    acquired_at  timestamptz,
    expires_at   timestamptz,
    ttl_ms       integer NOT NULL,
    attempt      bigint NOT NULL,
    version      bigint NOT NULL,
    ckpt_key     text,
    ckpt_version bigint,
    ckpt_saved   timestamptz,
    outcome      text,
    created_at   timestamptz NOT NULL,
    updated_at   timestamptz NOT NULL
)
"""

# statement_timestamp() is one value per statement, taken after the client
# sent it: the expiry written is never earlier than the client's send + ttl.
# ON CONFLICT re-checks the WHERE on the latest row version under its lock.
PG_ACQUIRE = """
INSERT INTO runs AS r (run_id, status, token, owner, acquired_at, expires_at, ttl_ms,
                       attempt, version, created_at, updated_at)
VALUES ($1, 'running', 1, $2, statement_timestamp(),
        statement_timestamp() + $3::integer * interval '1 millisecond', $3::integer,
        1, 1, statement_timestamp(), statement_timestamp())
ON CONFLICT (run_id) DO UPDATE SET
    status = 'running',
    token = r.token + 1,
    owner = EXCLUDED.owner,
    acquired_at = statement_timestamp(),
    expires_at = EXCLUDED.expires_at,
    ttl_ms = EXCLUDED.ttl_ms,
    attempt = r.attempt + CASE
        WHEN r.owner IS NOT NULL
             AND NOT (r.owner = EXCLUDED.owner AND r.expires_at > statement_timestamp())
        THEN 1 ELSE 0 END,
    version = r.version + 1,
    updated_at = statement_timestamp()
WHERE r.status IN ('running', 'queued')
  AND (r.owner IS NULL OR r.owner = EXCLUDED.owner OR r.expires_at <= statement_timestamp())
RETURNING token
"""

_PG_FENCE = "WHERE run_id = $1 AND token = $2 AND owner = $3 RETURNING version"

PG_RENEW = f"""
UPDATE runs SET expires_at = statement_timestamp() + ttl_ms * interval '1 millisecond',
                version = version + 1, updated_at = statement_timestamp()
{_PG_FENCE}
"""

PG_CHECKPOINT = f"""
UPDATE runs SET expires_at = statement_timestamp() + ttl_ms * interval '1 millisecond',
                ckpt_key = $4, ckpt_version = $5, ckpt_saved = statement_timestamp(),
                version = version + 1, updated_at = statement_timestamp()
{_PG_FENCE}
"""

PG_FINISH = f"""
UPDATE runs SET status = 'completed', outcome = 'ok', owner = NULL, acquired_at = NULL,
                expires_at = NULL, version = version + 1, updated_at = statement_timestamp()
{_PG_FENCE}
"""

PG_RELEASE = f"""
UPDATE runs SET status = 'queued', owner = NULL, acquired_at = NULL, expires_at = NULL,
                version = version + 1, updated_at = statement_timestamp()
{_PG_FENCE}
"""

# Only after a refusal (no row updated): why, and whether it converged.
PG_WHY = "SELECT status, token, owner FROM runs WHERE run_id = $1"


# -- Redis: one Lua script per command (EVALSHA), appendfsync always ----------

_LUA_NOW = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

LUA_ACQUIRE = _LUA_NOW + """
local k, owner, ttl = KEYS[1], ARGV[1], tonumber(ARGV[2])
local r = redis.call('HMGET', k, 'status', 'token', 'owner', 'expires', 'attempt', 'version')
if not r[1] then
  redis.call('HSET', k, 'status', 'running', 'token', 1, 'owner', owner, 'acquired', now,
             'expires', now + ttl, 'ttl', ttl, 'attempt', 1, 'version', 1,
             'created', now, 'updated', now)
  return 1
end
local status = r[1]
if status == 'completed' or status == 'failed' or status == 'cancelled' then
  return redis.error_reply('REFUSED terminal')
end
if status == 'suspended' then return redis.error_reply('REFUSED suspended') end
local holder = r[3]
local live = holder and now < tonumber(r[4])
if live and holder ~= owner then return redis.error_reply('REFUSED held') end
local attempt = tonumber(r[5])
if holder and not (live and holder == owner) then attempt = attempt + 1 end
local token = tonumber(r[2]) + 1
redis.call('HSET', k, 'status', 'running', 'token', token, 'owner', owner, 'acquired', now,
           'expires', now + ttl, 'ttl', ttl, 'attempt', attempt,
           'version', tonumber(r[6]) + 1, 'updated', now)
return token
"""

_LUA_FENCE = """
local k, owner, token = KEYS[1], ARGV[1], tonumber(ARGV[2])
local r = redis.call('HMGET', k, 'status', 'token', 'owner', 'ttl', 'version')
if not r[1] then return redis.error_reply('REFUSED not_found') end
"""

_LUA_CHECK = """
if tonumber(r[2]) ~= token or r[3] ~= owner then return redis.error_reply('REFUSED lost') end
"""

LUA_RENEW = _LUA_NOW + _LUA_FENCE + _LUA_CHECK + """
redis.call('HSET', k, 'expires', now + tonumber(r[4]), 'version', tonumber(r[5]) + 1,
           'updated', now)
return 1
"""

LUA_CHECKPOINT = _LUA_NOW + _LUA_FENCE + _LUA_CHECK + """
redis.call('HSET', k, 'expires', now + tonumber(r[4]), 'ckpt_key', ARGV[3],
           'ckpt_version', ARGV[4], 'ckpt_saved', now, 'version', tonumber(r[5]) + 1,
           'updated', now)
return 1
"""

LUA_FINISH = _LUA_NOW + _LUA_FENCE + """
if r[1] == 'completed' and tonumber(r[2]) == token then return 0 end
""" + _LUA_CHECK + """
redis.call('HSET', k, 'status', 'completed', 'outcome', 'ok', 'version', tonumber(r[5]) + 1,
           'updated', now)
redis.call('HDEL', k, 'owner', 'acquired', 'expires')
return 1
"""

LUA_RELEASE = _LUA_NOW + _LUA_FENCE + """
if r[1] == 'queued' and tonumber(r[2]) == token then return 0 end
""" + _LUA_CHECK + """
redis.call('HSET', k, 'status', 'queued', 'version', tonumber(r[5]) + 1, 'updated', now)
redis.call('HDEL', k, 'owner', 'acquired', 'expires')
return 1
"""
