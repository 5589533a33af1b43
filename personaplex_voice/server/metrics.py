"""Prometheus export: the SessionManager's instruments plus the server's own, under `personaplex_`.

The manager keeps framework-free instruments (`personaplex_voice.metrics`); a custom collector
reads them at scrape time, so nothing is copied on the hot path. Each app gets its own
`CollectorRegistry`, so several apps in one process (tests) never clash.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from personaplex_voice.metrics import Counter, Gauge, Histogram

PREFIX = "personaplex_"


@dataclass
class ServerMetrics:
    """What only the transport sees: bytes on the wire and refusals, by kind."""

    bytes_in: Counter
    bytes_out: Counter
    messages_in: Counter
    connections: Counter
    errors: Counter
    open_connections: Gauge

    @classmethod
    def create(cls) -> ServerMetrics:
        return cls(
            bytes_in=Counter("chat_bytes_in_total", "WebSocket payload bytes received on /api/chat"),
            bytes_out=Counter("chat_bytes_out_total", "WebSocket payload bytes sent on /api/chat"),
            messages_in=Counter("chat_messages_in_total", "Messages received on /api/chat, by kind", "kind"),
            connections=Counter("chat_connections_total", "WebSocket connections accepted on /api/chat"),
            errors=Counter("chat_errors_total", "Sessions ended with a 0x05 error, by kind", "kind"),
            open_connections=Gauge("chat_open_connections", "WebSockets currently open on /api/chat"),
        )

    def instruments(self) -> Iterator[Counter | Gauge | Histogram]:
        for value in vars(self).values():
            if isinstance(value, Counter | Gauge | Histogram):
                yield value


def _families(instruments: Iterable[Any]) -> Iterator[Metric]:
    for inst in instruments:
        name = PREFIX + inst.name
        if isinstance(inst, Counter):
            # prometheus-client appends `_total` to counters itself.
            family = CounterMetricFamily(
                name.removesuffix("_total"), inst.help, labels=[inst.label] if inst.label else None
            )
            for label, value in sorted(inst.values().items()):
                family.add_metric([label] if inst.label else [], value)
            yield family
        elif isinstance(inst, Gauge):
            yield GaugeMetricFamily(name, inst.help, value=inst.value)
        elif isinstance(inst, Histogram):
            buckets = [("+Inf" if b == float("inf") else repr(b), n) for b, n in inst.cumulative()]
            yield HistogramMetricFamily(name, inst.help, buckets=buckets, sum_value=inst.sum)


class InstrumentCollector(Collector):
    """Reads instruments from callables at scrape time (the manager may appear after startup)."""

    def __init__(self, sources: Iterable[Callable[[], Iterable[Any]]]):
        self._sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        for source in self._sources:
            yield from _families(source())


def build_registry(
    server: ServerMetrics, manager_instruments: Callable[[], Iterable[Any]]
) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(InstrumentCollector([server.instruments, manager_instruments]))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
