"""Prometheus series of the engine workers, as a front-end last heard them.

Each worker sends its manager's metrics snapshot (`SessionMetrics.snapshot()`) once a second in
its STATUS, with their kinds in WELCOME. A front-end's `/metrics` exports them under the names an
embedded server uses (`personaplex_ticks_total`, `personaplex_late_frames_total`, ...) with a
`worker` label, plus per worker: `personaplex_engine_worker_up`, `..._restarts` and the slot
gauges. Every front-end shows every worker; scrape one front-end per host (or all, and
deduplicate on `worker`).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from personaplex_voice.server.metrics import PREFIX

if TYPE_CHECKING:
    from personaplex_voice.cluster.client import ClusterClient


class WorkerMetricsCollector(Collector):
    def __init__(self, client: ClusterClient):
        self._client = client

    def collect(self) -> Iterator[Metric]:
        links = self._client.links
        up = GaugeMetricFamily(
            PREFIX + "engine_worker_up", "1 while this front-end is connected", labels=["worker"]
        )
        restarts = GaugeMetricFamily(
            PREFIX + "engine_worker_restarts", "Times the engine worker was restarted", labels=["worker"]
        )
        slots = GaugeMetricFamily(
            PREFIX + "engine_worker_slots", "Engine worker slots by state", labels=["worker", "state"]
        )
        families: dict[str, Metric] = {}
        for link in links:
            worker = link.worker_id
            up.add_metric([worker], 1.0 if link.up else 0.0)
            restarts.add_metric([worker], float(link.info.get("generation") or 0))
            if not link.up:
                continue
            status = link.status
            capacity = float(status.get("capacity", 0))
            used, reserved = float(status.get("active", 0)), float(status.get("reserved", 0))
            slots.add_metric([worker, "used"], used)
            slots.add_metric([worker, "reserved"], reserved)
            slots.add_metric([worker, "free"], max(0.0, capacity - used - reserved))
            kinds = link.info.get("metric_kinds") or {}
            for name, value in link.metrics_snapshot.items():
                kind, label = (kinds.get(name) or [None, None])[:2]
                _add(families, name, kind, label, worker, value)
        yield up
        yield restarts
        yield slots
        yield from families.values()


def _add(families: dict[str, Metric], name: str, kind: Any, label: Any, worker: str, value: Any) -> None:
    full = PREFIX + name
    if kind == "counter":
        family = families.get(name)
        labels = ["worker", str(label)] if label else ["worker"]
        if family is None:
            family = families[name] = CounterMetricFamily(
                full.removesuffix("_total"), f"{name} (engine worker)", labels=labels
            )
        if label and isinstance(value, dict):
            for key, count in sorted(value.items()):
                family.add_metric([worker, str(key)], float(count))
        elif isinstance(value, int | float):
            family.add_metric([worker], float(value))
    elif kind == "gauge" and isinstance(value, int | float):
        family = families.get(name)
        if family is None:
            family = families[name] = GaugeMetricFamily(full, f"{name} (engine worker)", labels=["worker"])
        family.add_metric([worker], float(value))
    elif kind == "histogram" and isinstance(value, dict) and isinstance(value.get("buckets"), dict):
        family = families.get(name)
        if family is None:
            family = families[name] = HistogramMetricFamily(
                full, f"{name} (engine worker)", labels=["worker"]
            )
        buckets = sorted(
            ((bound, int(count)) for bound, count in value["buckets"].items()),
            key=lambda item: float("inf") if item[0] == "+Inf" else float(item[0]),
        )
        family.add_metric([worker], buckets=buckets, sum_value=float(value.get("sum", 0.0)))
