"""Prometheus export: every snapshot of the process (the server's own instruments and its session
host's: the embedded manager, or a front-end and the engine workers it heard) under `personaplex_`.

This is the one place instruments become Prometheus series. Sources give `LabelledSnapshot`s
(`personaplex_voice.metrics`) at scrape time, so nothing is copied on the hot path; snapshots of
one instrument with different labels (one per engine worker) become one family. Each app gets
its own `CollectorRegistry`, so several apps in one process (tests) never clash.
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

from personaplex_voice.metrics import Counter, Gauge, InstrumentSet, LabelledSnapshot

PREFIX = "personaplex_"

SnapshotSource = Callable[[], Iterable[LabelledSnapshot]]


@dataclass
class ServerMetrics(InstrumentSet):
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


def families(snapshots: Iterable[LabelledSnapshot]) -> Iterator[Metric]:
    """Prometheus families of `snapshots`; an instrument seen under several label sets (a worker
    each) is one family. Rows whose label names differ from the family's first are skipped."""
    grouped: dict[str, list[tuple[dict[str, str], dict[str, Any]]]] = {}
    for snapshot in snapshots:
        for name, entry in snapshot.instruments.items():
            grouped.setdefault(name, []).append((snapshot.labels, entry))
    for name, rows in grouped.items():
        first_labels, first = rows[0]
        outer = sorted(first_labels)
        rows = [
            (labels, entry)
            for labels, entry in rows
            if sorted(labels) == outer and entry.get("kind") == first.get("kind")
        ]
        family = _family(PREFIX + name, first, outer)
        if family is None:
            continue
        for labels, entry in rows:
            _add(family, entry, [labels[key] for key in outer])
        yield family


def _family(name: str, entry: dict[str, Any], outer: list[str]) -> Metric | None:
    kind, help, inner = entry.get("kind"), str(entry.get("help") or name), entry.get("label")
    names = outer + ([str(inner)] if inner else [])
    if kind == "counter":  # prometheus-client appends `_total` itself
        return CounterMetricFamily(name.removesuffix("_total"), help, labels=names)
    if kind == "gauge":
        return GaugeMetricFamily(name, help, labels=names)
    if kind == "histogram":
        return HistogramMetricFamily(name, help, labels=outer)
    return None


def _add(family: Metric, entry: dict[str, Any], values: list[str]) -> None:
    value = entry.get("value")
    if isinstance(family, HistogramMetricFamily):
        if isinstance(value, dict) and isinstance(value.get("buckets"), dict):
            buckets = sorted(
                ((bound, int(count)) for bound, count in value["buckets"].items()),
                key=lambda item: float("inf") if item[0] == "+Inf" else float(item[0]),
            )
            family.add_metric(values, buckets=buckets, sum_value=float(value.get("sum", 0.0)))
    elif isinstance(value, dict):  # a labelled counter or gauge: {label value: number}
        for key, number in sorted(value.items()):
            if isinstance(number, int | float):
                family.add_metric([*values, str(key)], float(number))  # type: ignore[attr-defined]
    elif isinstance(value, int | float):
        family.add_metric(values, float(value))  # type: ignore[attr-defined]


class SnapshotCollector(Collector):
    """Reads the sources at scrape time (the session host may appear after startup)."""

    def __init__(self, sources: Iterable[SnapshotSource]):
        self._sources = list(sources)

    def collect(self) -> Iterator[Metric]:
        snapshots = [snapshot for source in self._sources for snapshot in source()]
        yield from families(snapshots)


def build_registry(*sources: SnapshotSource) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(sources))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
