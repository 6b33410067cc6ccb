"""``/metrics`` on the HTTP side port: Prometheus conventions, the values
after real traffic, and docs/OPERATIONS.md listing exactly what is exposed."""

from __future__ import annotations

import asyncio
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import fencepost
from fencepost.v1 import ledger_pb2 as pb
from fencepost.v1 import ledger_pb2_grpc
from fencepost_server import metrics as metrics_module
from fencepost_server.core import ledger as L
from fencepost_server.testing.server import ServerThread

DOC = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"


def scrape(server: ServerThread) -> str:
    with urllib.request.urlopen(server.http_url + "/metrics", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        return str(resp.read().decode())


def families(text: str) -> dict[str, Any]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def value(text: str, name: str, **labels: str) -> float:
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    raise AssertionError(f"no sample {name}{labels}")


def exposed(text: str) -> set[tuple[str, str, frozenset[str]]]:
    """(name as exposed, type, label names) of every family."""
    out = set()
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        labels = {k for s in fam.samples for k in s.labels if k != "le"}
        out.add((name, fam.type, frozenset(labels)))
    return out


def documented() -> set[tuple[str, str, frozenset[str]]]:
    """The table under "## Metrics" in docs/OPERATIONS.md."""
    text = DOC.read_text()
    section = text[text.index("## Metrics"):]
    section = section[: section.index("\n## ", 4)]
    rows = set()
    for line in section.splitlines():
        m = re.match(r"\|\s*`(fencepost_\w+)`\s*\|\s*(\w+)\s*\|([^|]*)\|", line)
        if m:
            labels = frozenset(re.findall(r"`(\w+)`", m.group(3)))
            rows.add((m.group(1), m.group(2), labels))
    return rows


def test_traffic_shows_in_the_metrics(server: ServerThread, channel: grpc.Channel) -> None:
    stub = ledger_pb2_grpc.LedgerStub(channel)
    clock = server.clock
    stub.Acquire(pb.AcquireRequest(run_id="m-taken", owner="a", lease_ttl_ms=1000))
    stub.Acquire(pb.AcquireRequest(run_id="m-expired", owner="a", lease_ttl_ms=1000))
    stub.Acquire(pb.AcquireRequest(run_id="m-delay", owner="a", lease_ttl_ms=1000,
                                   lock_delay_ms=60_000))
    stub.Acquire(pb.AcquireRequest(run_id="m-live", owner="a", lease_ttl_ms=600_000))
    with pytest.raises(grpc.RpcError):
        stub.GetRun(pb.GetRunRequest(run_id="m-missing"))
    clock.advance(2000)
    stub.Acquire(pb.AcquireRequest(run_id="m-taken", owner="b"))  # a takeover after expiry
    stub.Renew(pb.RenewRequest(run_id="m-live", owner="a", fencing_token=1))

    text = scrape(server)
    assert value(text, "fencepost_renewals_from_memory_total") == 1
    assert value(text, "fencepost_lease_expiries_flushed_total") == 0  # the cycle is 30 s
    assert value(text, "fencepost_takeovers_total") == 1
    assert value(text, "fencepost_lease_expiries_total") == 3  # m-taken, m-expired, m-delay
    assert value(text, "fencepost_leases", state="live") == 2  # m-taken (b), m-live
    assert value(text, "fencepost_runs") == 4
    assert value(text, "fencepost_leases", state="expired") == 1
    assert value(text, "fencepost_leases", state="lock_delay") == 1
    assert value(text, "fencepost_rpc_duration_seconds_count", service="Ledger",
                 method="Acquire", code="OK") == 5
    assert value(text, "fencepost_rpc_duration_seconds_count", service="Ledger",
                 method="GetRun", code="NOT_FOUND") == 1
    commits = value(text, "fencepost_writer_commit_duration_seconds_count")
    batches = value(text, "fencepost_writer_batches_total")
    sizes = value(text, "fencepost_writer_batch_size_sum")
    stub.Acquire(pb.AcquireRequest(run_id="m-one-more", owner="a"))
    later = scrape(server)  # one command, one batch: every writer series moves by one
    assert value(later, "fencepost_writer_commit_duration_seconds_count") == commits + 1
    assert value(later, "fencepost_writer_batches_total") == batches + 1
    assert value(later, "fencepost_writer_batch_size_sum") == sizes + 1
    # one caller at a time is never held for a group commit
    assert value(later, "fencepost_writer_held_batches_total") == 0
    assert value(later, "fencepost_writer_held_in_vain_total") == 0
    assert value(text, "fencepost_build_info", version=fencepost_version()) == 1
    assert "m-taken" not in text and '"a"' not in text  # never a run id or owner label
    again = scrape(server)
    assert value(again, "fencepost_lease_expiries_total") == 3  # counted once
    stub.Acquire(pb.AcquireRequest(run_id="m-expired", owner="b"))
    assert value(scrape(server), "fencepost_lease_expiries_total") == 3
    assert value(scrape(server), "fencepost_takeovers_total") == 2


def test_a_scrape_counts_in_chunks_and_an_expiry_ended_meanwhile_counts_once(
    server: ServerThread, channel: grpc.Channel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first scrape counts leases a chunk at a time, the loop free in
    between; a takeover of an expired lease committed meanwhile counts that
    expiry once, and the scrape answers with the lease as it is now."""
    monkeypatch.setattr(metrics_module, "LEASE_SCAN_CHUNK", 2)
    stub = ledger_pb2_grpc.LedgerStub(channel)
    for i in range(6):
        stub.Acquire(pb.AcquireRequest(run_id=f"e{i}", owner="a", lease_ttl_ms=1000))
    stub.Acquire(pb.AcquireRequest(run_id="live", owner="a", lease_ttl_ms=600_000))
    server.clock.advance(2000)
    m = server.app.metrics  # type: ignore[union-attr]
    assert m is not None

    async def scrape_while_one_is_taken_over() -> tuple[str, bool]:
        scan = m.leases.count()  # what render_async runs, a chunk per step
        next(scan)  # the first chunk counted; the loop is free
        taken = await m.writer.submit(L.Acquire("e5", "b"))  # e5 not reached yet
        assert taken.lease.owner == "b"
        chunks = sum(1 for _ in scan)
        return (await m.render_async()).decode(), chunks > 0

    text, yielded = server.call(scrape_while_one_is_taken_over)
    assert yielded  # it counted in several chunks, the takeover between two
    assert value(text, "fencepost_lease_expiries_total") == 6  # e5 once, not twice
    assert value(text, "fencepost_leases", state="expired") == 5
    assert value(text, "fencepost_leases", state="live") == 2  # e5 (b), live
    again = scrape(server)
    assert value(again, "fencepost_lease_expiries_total") == 6
    assert value(again, "fencepost_leases", state="expired") == 5


def fencepost_version() -> str:
    from importlib.metadata import version

    return version("fencepost")


async def test_revocations_by_reason_and_open_streams(server: ServerThread) -> None:
    async with fencepost.Client(server.address, owner="w") as client:
        lease = await client.acquire("m-cancel")  # over Execute
        # the background renewer opens the KeepAlive stream on its own time
        deadline = time.monotonic() + 10
        while value(text := scrape(server), "fencepost_open_streams", kind="keepalive") != 1:
            assert time.monotonic() < deadline, "no KeepAlive stream opened within 10 s"
            await asyncio.sleep(0.02)
        assert value(text, "fencepost_open_streams", kind="execute") == 1
        await client.cancel("m-cancel")
        await lease.lost.wait()
    deadline = time.monotonic() + 5
    while value(scrape(server), "fencepost_open_streams", kind="keepalive") != 0:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    text = scrape(server)
    assert value(text, "fencepost_revocations_total", reason="cancelled") == 1
    assert value(text, "fencepost_revocations_total", reason="taken_over") == 0


def test_operations_md_lists_exactly_what_the_endpoint_exposes(
    server: ServerThread, channel: grpc.Channel
) -> None:
    ledger_pb2_grpc.LedgerStub(channel).Acquire(pb.AcquireRequest(run_id="m", owner="a"))
    text = scrape(server)
    doc = documented()
    assert doc, "no metrics table found in docs/OPERATIONS.md"
    assert exposed(text) == doc


def test_unknown_paths_are_404_and_the_metrics_only_listener(make_server: Any) -> None:
    with make_server(metrics_listen="127.0.0.1:0") as srv:
        app = srv.app
        assert app is not None and app.dashboard is not None
        dash_port, metrics_port = app.dashboard.ports
        for path in ("/nope", "/metrics/x", "/api/nothing"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{dash_port}{path}", timeout=10)
            assert e.value.code == 404
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as r:
            assert b"fencepost_runs" in r.read()
        for path in ("/", "/api/runs"):
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}{path}", timeout=10)
            assert e.value.code == 404


def test_metrics_port_still_serves_on_loopback(make_server: Any) -> None:
    from fencepost_devtools.ports import free_port

    port = free_port()
    with make_server(metrics_port=port, http_listen=""):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            assert b"fencepost_writer_queue_depth" in r.read()


def test_the_grafana_dashboard_only_queries_documented_series() -> None:
    import json

    dash = json.loads((DOC.parent / "grafana-dashboard.json").read_text())
    names = {name for name, _, _ in documented()}
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    for expr in exprs:
        for used in re.findall(r"fencepost_\w+", expr):
            base = re.sub(r"_(bucket|count|sum)$", "", used)
            assert used in names or base in names, (used, expr)


def test_a_taken_http_port_stops_the_start_unless_it_is_the_default(
    make_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import socket

    from fencepost_server.config import Settings

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(RuntimeError, match="could not listen"):
            make_server("a", http_listen=f"127.0.0.1:{port}").start()
        # the default address, taken: here a port this test holds, not the
        # real default, which other processes of the suite (a `make serve`,
        # this test for the other store) take and let go of at any moment
        monkeypatch.setattr(Settings, "http_listen", f"127.0.0.1:{port}")
        with make_server("b", http_listen=Settings.http_listen) as srv:
            assert srv.app is not None and srv.app.http_port == 0  # served without it
            with grpc.insecure_channel(srv.address) as ch:
                ledger_pb2_grpc.LedgerStub(ch).Acquire(pb.AcquireRequest(run_id="x", owner="o"))
