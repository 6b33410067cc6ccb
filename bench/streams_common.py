"""Helpers shared by the stream benchmarks (bench/streams_*.py); not a test utility.

* ``start_fencepost``: a fresh ``fencepost serve --durability full`` with a
  metrics port, via ``e2e.start_target`` (the server the e2e bench measures).
* ``CpuWindow``: the CPU used over a window, in cores, split into the server,
  our client processes, kernel threads + interrupts, and **others** (the other
  engineers' processes on this shared machine), plus ``os.getloadavg()`` at
  both ends. It reuses ``e2e._CpuSnapshot``, so the split is the e2e bench's.
* ``error_reason``: the ``google.rpc.ErrorInfo`` reason of a failed call.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import e2e
import grpc
import psutil
from benchlib import ServerProcess, percentile, scrape_counters
from google.rpc import error_details_pb2, status_pb2

WRITER_COUNTERS = e2e.WRITER_COUNTERS
COMMIT_SECONDS = e2e.COMMIT_SECONDS


def start_fencepost(workdir: Path, tag: int) -> tuple[ServerProcess, int]:
    """fencepost at --durability full on a fresh database, with a metrics port."""
    srv, metrics_port = e2e.start_target("fencepost", workdir, tag)
    assert metrics_port is not None
    return srv, metrics_port


def scrape_gauge(port: int, name: str) -> float:
    return scrape_counters(port, [name])[name]


@dataclass
class WriterDelta:
    commands: float
    batches: float
    commit_s: float

    @property
    def mean_batch(self) -> float:
        return self.commands / self.batches if self.batches else 0.0

    @property
    def batch_ms(self) -> float:
        return self.commit_s / self.batches * 1000 if self.batches else 0.0


def writer_counters(port: int) -> dict[str, float]:
    return scrape_counters(port, WRITER_COUNTERS)


def writer_delta(m0: dict[str, float], m1: dict[str, float]) -> WriterDelta:
    return WriterDelta(
        commands=m1["fencepost_writer_commands"] - m0["fencepost_writer_commands"],
        batches=m1["fencepost_writer_batches"] - m0["fencepost_writer_batches"],
        commit_s=m1[COMMIT_SECONDS] - m0[COMMIT_SECONDS],
    )


@dataclass
class CpuUse:
    """CPU over a window, in cores (CPU seconds per wall second; the machine has 2)."""

    seconds: float
    server: float
    clients: float  # our client processes (this one included when it is a client)
    kernel: float  # kernel threads and interrupts
    machine: float  # everything, ours included
    loadavg_before: tuple[float, float, float]
    loadavg_after: tuple[float, float, float]

    @property
    def others(self) -> float:
        """Other users' processes: the noise of the shared machine."""
        return max(0.0, self.machine - self.server - self.clients - self.kernel)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "others": self.others}

    def line(self) -> str:
        return (f"cpu (cores) server {self.server:4.2f} clients {self.clients:4.2f} "
                f"kernel {self.kernel:4.2f} others {self.others:4.2f}; load average "
                f"{self.loadavg_before[0]:.2f} -> {self.loadavg_after[0]:.2f}")


def _proc_cpu(pid: int) -> float:
    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    # children_* stay 0 for our processes (none of them fork workers)
    return float(t.user + t.system)


class CpuWindow:
    """Snapshot at ``__init__``; ``stop()`` returns the CPU used since, in cores.

    Processes that exit inside the window are under-counted (their time is
    lost), so take both snapshots while the measured processes run.
    """

    def __init__(self, server_pid: int, client_pids: Iterable[int]) -> None:
        self.server_pid = server_pid
        self.client_pids = list(client_pids)
        self.load0 = os.getloadavg()
        self.t0 = time.monotonic()
        self.snap0 = e2e._CpuSnapshot.take()
        self.server0 = _proc_cpu(server_pid)
        self.clients0 = {pid: _proc_cpu(pid) for pid in self.client_pids}

    def stop(self) -> CpuUse:
        server1 = _proc_cpu(self.server_pid)
        clients1 = {pid: _proc_cpu(pid) for pid in self.client_pids}
        snap1 = e2e._CpuSnapshot.take()
        dt = max(1e-9, time.monotonic() - self.t0)
        return CpuUse(
            seconds=dt,
            server=(server1 - self.server0) / dt,
            clients=sum(clients1[p] - self.clients0[p] for p in self.client_pids) / dt,
            kernel=snap1.kernel_since(self.snap0) / dt,
            machine=(snap1.busy - self.snap0.busy) / dt,
            loadavg_before=self.load0,
            loadavg_after=os.getloadavg(),
        )


def error_reason(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """ErrorInfo.reason in a failed call's trailing metadata ('' if none)."""
    for key, value in metadata or ():
        if key == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                info = error_details_pb2.ErrorInfo()
                if detail.Unpack(info):
                    return info.reason
    return ""


async def aio_error_reason(call: grpc.aio.Call) -> str:
    return error_reason(await call.trailing_metadata())


def distribution_ms(values_s: Sequence[float]) -> dict[str, float]:
    """min/p50/p90/p99/max in ms of values in seconds (not necessarily sorted)."""
    v = sorted(values_s)
    if not v:
        return {"n": 0}
    return {
        "n": len(v),
        "min_ms": v[0] * 1000,
        "p50_ms": percentile(v, 50) * 1000,
        "p90_ms": percentile(v, 90) * 1000,
        "p99_ms": percentile(v, 99) * 1000,
        "max_ms": v[-1] * 1000,
    }


def fmt_load(load: Sequence[float]) -> str:
    return "/".join(f"{x:.2f}" for x in load)
