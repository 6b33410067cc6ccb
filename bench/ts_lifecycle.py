"""The TypeScript client beside the Python SDK, in the same run: bench/peers'
fleet and engine shapes, with TLS off and on.

    .venv/bin/python bench/ts_lifecycle.py [--seconds 5] [--concurrency 16] [--rounds 3]

Each run is bench/peers' lifecycle: acquire a new run, renew it three times,
record a checkpoint, finish it (six commands). ``fleet``: one client (one
owner) per worker, as each process of a fleet has its own; ``engine``: one
client for the whole process, CONCURRENCY runs in flight under its owner.
``tls``: mutual TLS (the server started with ``--tls-cert --tls-key
--client-ca``, the clients presenting a certificate whose principal owns
the runs); ``plain``: plaintext on loopback. Every measurement gets a fresh
server (SQLite, the same flags), both clients take turns round after round,
and the median of the rounds is reported, so that a busy machine slows all
of them alike. Bounded: 8 measurements a round, each SECONDS plus a warm-up.

Needs the TypeScript client built (`cd clients/typescript && npm ci && npm
run build`). A benchmark, not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchlib import BIN, HOST, REPO, free_port, machine, median, percentile, start_server

import fencepost

COMMANDS_PER_LIFECYCLE = 6
CLIENTS = ("typescript", "python")
SHAPES = ("fleet", "engine")
SECURITY = ("plain", "tls")
PRINCIPAL = "bench"  # the client certificate's identity: owners are "bench/..."


def make_pki(directory: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate for PRINCIPAL."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from torture.certs import CA

    ca = CA(directory)
    server = ca.server()
    client = ca.issue(PRINCIPAL, cn=PRINCIPAL)
    return {"ca": str(ca.cert), "server_cert": str(server.cert), "server_key": str(server.key),
            "cert": str(client.cert), "key": str(client.key)}


async def python_run(address: str, seconds: float, concurrency: int, shape: str,
                     transport: str, tls: fencepost.TLS | None) -> dict[str, Any]:
    def open_client(owner: str) -> fencepost.Client:
        return fencepost.Client(address, owner=owner, tls=tls, transport=transport)  # type: ignore[arg-type]

    clients = ([open_client(f"{PRINCIPAL}/c{i}") for i in range(concurrency)] if shape == "fleet"
               else [open_client(f"{PRINCIPAL}/engine")])
    latencies: list[float] = []
    seq = 0

    async def lifecycle(client: fencepost.Client, run_id: str) -> None:
        lease = await client.acquire(run_id, ttl_ms=60_000)
        for _ in range(3):
            await lease.renew()
        await lease.record_checkpoint(f"ckpt/{run_id}", 1)
        await lease.finish("completed")

    try:
        await asyncio.gather(*(lifecycle(c, f"py-warm-{i}") for i, c in enumerate(clients)))
        deadline = time.monotonic() + seconds

        async def worker(w: int) -> None:
            nonlocal seq
            client = clients[w % len(clients)]
            while time.monotonic() < deadline:
                t = time.perf_counter()
                seq += 1
                await lifecycle(client, f"py-{w}-{seq}")
                latencies.append((time.perf_counter() - t) * 1000)

        started = time.perf_counter()
        await asyncio.gather(*(worker(i) for i in range(concurrency)))
        elapsed = time.perf_counter() - started
    finally:
        for c in clients:
            await c.aclose()
    latencies.sort()
    return {"lifecycles": len(latencies), "seconds": elapsed,
            "p50_ms": percentile(latencies, 50), "p99_ms": percentile(latencies, 99)}


def one_run(client: str, shape: str, security: str, args: argparse.Namespace,
            pki: dict[str, str]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"{HOST}:{free_port()}"
        flags = (["--tls-cert", pki["server_cert"], "--tls-key", pki["server_key"],
                  "--client-ca", pki["ca"]] if security == "tls" else [])
        server = start_server(
            "fencepost",
            [str(BIN / "fencepost"), "serve", "--listen", address,
             "--db", str(Path(tmp) / "db"), *flags],
            Path(tmp) / "server.log",
        )
        try:
            server.wait_ready(r"fencepost serving on (\S+)")
            if client == "typescript":
                cfg = {"address": address, "seconds": args.seconds, "concurrency": args.concurrency,
                       "shape": shape, "transport": args.transport, "owner": PRINCIPAL,
                       **({"tls": {"ca": pki["ca"], "cert": pki["cert"], "key": pki["key"]}}
                          if security == "tls" else {})}
                out = subprocess.run(
                    ["node", str(REPO / "bench" / "ts_lifecycle.mjs"), json.dumps(cfg)],
                    check=True, capture_output=True, text=True, timeout=args.seconds + 120,
                ).stdout
                result = json.loads(out.strip().splitlines()[-1])
            else:
                tls = (fencepost.TLS(ca=pki["ca"], cert=pki["cert"], key=pki["key"])
                       if security == "tls" else None)
                result = asyncio.run(python_run(address, args.seconds, args.concurrency, shape,
                                                args.transport, tls))
        finally:
            server.stop()
    rate = result["lifecycles"] / result["seconds"] if result["seconds"] else 0.0
    return {"client": client, "shape": shape, "security": security, **result,
            "lifecycles_per_s": rate, "commands_per_s": rate * COMMANDS_PER_LIFECYCLE}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=5.0, help="each measurement's window")
    ap.add_argument("--concurrency", type=int, default=16, help="runs in flight (fleet: clients)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", choices=("stream", "unary"), default="stream")
    ap.add_argument("--json", type=Path, help="also write every measurement and the medians here")
    args = ap.parse_args(argv)
    for name in ("seconds", "concurrency", "rounds"):
        if not getattr(args, name) > 0:
            ap.error(f"--{name} must be > 0")
    print(json.dumps({"machine": machine(), "seconds": args.seconds,
                      "concurrency": args.concurrency, "rounds": args.rounds,
                      "transport": args.transport}), flush=True)
    results: list[dict[str, Any]] = []
    rates: dict[tuple[str, str, str], list[float]] = {}
    p99s: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as pki_dir:
        pki = make_pki(Path(pki_dir))
        for _ in range(args.rounds):
            for security in SECURITY:
                for shape in SHAPES:
                    for client in CLIENTS:
                        r = one_run(client, shape, security, args, pki)
                        key = (shape, security, client)
                        rates.setdefault(key, []).append(r["lifecycles_per_s"])
                        p99s.setdefault(key, []).append(r["p99_ms"])
                        results.append(r)
                        print(json.dumps(r), flush=True)
    print(f"median of {args.rounds} round(s), {args.concurrency} runs in flight, "
          f"{args.seconds:g} s each, transport {args.transport}; lifecycle = "
          f"{COMMANDS_PER_LIFECYCLE} commands:")
    print(f"{'shape':<8}{'security':<10}{'client':<12}{'lifecycles/s':>14}{'commands/s':>12}"
          f"{'p99 ms':>9}")
    summary = []
    for (shape, security, client), values in rates.items():
        m = median(values)
        p99 = median(p99s[(shape, security, client)])
        summary.append({"shape": shape, "security": security, "client": client,
                        "lifecycles_per_s": m, "p99_ms": p99})
        print(f"{shape:<8}{security:<10}{client:<12}{m:>14.0f}{m * COMMANDS_PER_LIFECYCLE:>12.0f}"
              f"{p99:>9.1f}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "args": {
            "seconds": args.seconds, "concurrency": args.concurrency, "rounds": args.rounds,
            "transport": args.transport}, "results": results, "summary": summary}, indent=1))


if __name__ == "__main__":
    main()
