"""The persona cache's LRU-by-bytes policy and the framework-free metric instruments."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest

from personaplex_voice.engine.persona_cache import PersonaCache
from personaplex_voice.metrics import Counter, Histogram, SessionMetrics, values_of


@dataclass
class Blob:
    nbytes: int


def test_cache_evicts_least_recently_used_until_it_fits():
    cache = PersonaCache(max_bytes=100)
    assert cache.put("a", Blob(40)) == 0
    assert cache.put("b", Blob(40)) == 0
    assert cache.get("a") is not None  # "a" is now the most recently used
    assert cache.put("c", Blob(40)) == 1  # evicts "b", not "a"
    assert "a" in cache and "b" not in cache and "c" in cache
    assert cache.nbytes == 80 and len(cache) == 2
    assert cache.put("d", Blob(90)) == 2  # needs the whole budget
    assert list(cache._entries) == ["d"] and cache.nbytes == 90
    assert cache.get("a") is None
    assert (cache.hits, cache.misses, cache.evictions) == (1, 1, 3)


def test_cache_replaces_a_key_and_skips_oversized_and_disabled():
    cache = PersonaCache(max_bytes=100)
    cache.put("a", Blob(30))
    cache.put("a", Blob(50))
    assert cache.nbytes == 50 and len(cache) == 1
    assert cache.put("huge", Blob(101)) == 0 and "huge" not in cache and "a" in cache
    off = PersonaCache(max_bytes=0)
    assert not off.enabled
    off.put("a", Blob(1))
    assert off.get("a") is None and len(off) == 0
    with pytest.raises(ValueError):
        PersonaCache(max_bytes=-1)


def test_histogram_buckets_are_cumulative_with_inf():
    hist = Histogram("h", "help", buckets=(0.01, 0.1))
    for value in (0.005, 0.01, 0.05, 3.0):
        hist.observe(value)
    assert hist.cumulative() == [(0.01, 2), (0.1, 3), (float("inf"), 4)]
    snap = hist.snapshot()
    assert snap["count"] == 4 and snap["max"] == 3.0 and snap["buckets"]["+Inf"] == 4
    assert snap["sum"] == pytest.approx(3.065)


def test_counters_with_labels_and_the_metrics_snapshot():
    counter = Counter("c_total", "help", label="reason")
    counter.inc(label="idle")
    counter.inc(2, label="client")
    assert counter.values() == {"idle": 1.0, "client": 2.0} and counter.value == 3.0
    metrics = SessionMetrics.create()
    names = [inst.name for inst in metrics.instruments()]
    assert len(names) == len(set(names))
    assert all(inst.help and inst.kind in ("counter", "gauge", "histogram") for inst in metrics.instruments())
    metrics.sessions_closed.inc(label="idle")
    metrics.active_slots.set(3)
    snap = metrics.snapshot()
    assert snap["sessions_closed_total"] == {
        "kind": "counter",
        "help": "Sessions ended, by reason",
        "label": "reason",
        "value": {"idle": 1.0},
    }
    assert json.loads(json.dumps(snap)) == snap  # it crosses the cluster's wire as it is
    values = values_of(snap)
    assert values["active_slots"] == 3.0 and snap["active_slots"]["kind"] == "gauge"
    assert values["ticks_total"] == 0.0 and values["tick_seconds"]["count"] == 0
