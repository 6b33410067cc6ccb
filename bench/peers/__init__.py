"""``make bench-peers``: fencepost against etcd, PostgreSQL and Redis.

The same run-lease semantics (docs/SPEC.md §5.1-§5.2: acquire creates or takes over a
free or expired lease with token + 1; renew, checkpoint, finish and release are
fenced by (token, owner)) implemented on each peer the way a client of that
peer would, and one load generator driving all of them in one invocation:

* ``semantics``: the decision rules, in Python (used as-is by the etcd client)
  and as the SQL and Lua the PostgreSQL and Redis clients send;
* ``backends``: one async client per backend (fencepost unary, fencepost over
  ``Ledger.Execute`` with a coalescing dispatcher, etcd, PostgreSQL, Redis);
* ``servers``: installing the peers when missing, starting each one on
  127.0.0.1 with durable settings in a temp dir, stopping it, its CPU;
* ``load``: the client processes (throughput and contention workloads);
* ``history``: the contention checker (double grants, double finishes,
  stale fenced writes accepted);
* ``cli``: the rounds, the table, the JSON.

Run it as ``.venv/bin/python bench/peers [--install] [--smoke] ...``.
"""
