"""Prometheus metrics on a side port: writer queue depth, batches, commit time."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import REGISTRY, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from .writer import Writer


class WriterCollector(Collector):
    def __init__(self, writer: Writer) -> None:
        self.writer = writer

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        w = self.writer
        yield GaugeMetricFamily(
            "fencepost_writer_queue_depth", "Commands waiting for the writer", value=w.queue_depth
        )
        yield CounterMetricFamily(
            "fencepost_writer_batches", "Group commits", value=w.stats.batches
        )
        yield CounterMetricFamily(
            "fencepost_writer_commands", "Commands committed", value=w.stats.commands
        )
        yield CounterMetricFamily(
            "fencepost_writer_failed_commits", "Commits that failed", value=w.stats.failed_commits
        )
        yield CounterMetricFamily(
            "fencepost_writer_commit_seconds", "Time spent in batches", value=w.stats.commit_seconds
        )
        yield GaugeMetricFamily("fencepost_revision", "Server revision", value=w.state.revision)
        yield GaugeMetricFamily("fencepost_runs", "Runs stored", value=len(w.state.index))


def start_metrics(port: int, writer: Writer, host: str = "127.0.0.1") -> None:
    REGISTRY.register(WriterCollector(writer))
    start_http_server(port, addr=host)
