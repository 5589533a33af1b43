"""Framework-free counters, gauges and histograms, and the one snapshot format they share.

Everything here is plain Python so the engine side stays free of web dependencies. Every
instrument is thread-safe: the inference thread writes, any thread reads.

A *snapshot* (`InstrumentSet.snapshot()`) is a JSON-able dict `{name: {"kind", "help", "label",
"value"}}` of every instrument of a set: an engine worker sends its manager's over the wire as
it is, and `server/metrics.py` turns snapshots (each with labels such as the worker's id, a
`LabelledSnapshot`) into Prometheus series in one place.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# Seconds; chosen around the 80 ms frame budget (tick) and typical prefill times.
TICK_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0)
PREFILL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Counter:
    """Monotonic count, optionally split by one label (e.g. a close reason).

    `allowed` bounds the label's values (a Prometheus series per value): any other value is
    counted under "other", so text a client chose can never mint new series.
    """

    kind = "counter"

    def __init__(self, name: str, help: str, label: str | None = None, allowed: frozenset[str] | None = None):
        self.name, self.help, self.label = name, help, label
        self.allowed = allowed
        self._lock = threading.Lock()
        self._values: dict[str, float] = {} if label else {"": 0.0}

    def inc(self, amount: float = 1.0, label: str = "") -> None:
        if self.allowed is not None and label not in self.allowed:
            label = "other"
        with self._lock:
            self._values[label] = self._values.get(label, 0.0) + amount

    @property
    def value(self) -> float:
        """Total over all labels."""
        with self._lock:
            return sum(self._values.values())

    def values(self) -> dict[str, float]:
        """Per-label values (a single "" key when the counter has no label)."""
        with self._lock:
            return dict(self._values)

    def snapshot(self) -> Any:
        return self.values() if self.label else self.value


class Gauge:
    """A value that goes up and down (active slots, queue length, cache bytes)."""

    kind = "gauge"

    def __init__(self, name: str, help: str):
        self.name, self.help = name, help
        self._value = 0.0

    def set(self, value: float) -> None:
        self._value = float(value)  # a single float store is atomic under the GIL

    @property
    def value(self) -> float:
        return self._value

    def snapshot(self) -> float:
        return self._value


class Histogram:
    """Cumulative-bucket histogram in the Prometheus shape (upper bounds, +Inf implied)."""

    kind = "histogram"

    def __init__(self, name: str, help: str, buckets: Sequence[float]):
        self.name, self.help = name, help
        self.buckets = tuple(sorted(buckets))
        self._lock = threading.Lock()
        self._counts = [0] * (len(self.buckets) + 1)  # last = above every bound
        self._sum = 0.0
        self._count = 0
        self._max = 0.0

    def observe(self, value: float) -> None:
        with self._lock:
            self._counts[bisect.bisect_left(self.buckets, value)] += 1
            self._sum += value
            self._count += 1
            self._max = max(self._max, value)

    @property
    def count(self) -> int:
        return self._count

    @property
    def sum(self) -> float:
        return self._sum

    def cumulative(self) -> list[tuple[float, int]]:
        """[(upper_bound, observations <= bound)], ending with (inf, count)."""
        with self._lock:
            out, running = [], 0
            for bound, n in zip((*self.buckets, float("inf")), self._counts, strict=True):
                running += n
                out.append((bound, running))
            return out

    def snapshot(self) -> dict[str, Any]:
        cumulative = self.cumulative()
        with self._lock:
            mean = self._sum / self._count if self._count else 0.0
            return {
                "count": self._count,
                "sum": self._sum,
                "mean": mean,
                "max": self._max,
                "buckets": {("+Inf" if b == float("inf") else repr(b)): n for b, n in cumulative},
            }


Instrument = Counter | Gauge | Histogram
Snapshot = dict[str, dict[str, Any]]


@dataclass(frozen=True)
class LabelledSnapshot:
    """A snapshot and the labels its series carry (e.g. `{"worker": "w0"}`; `{}` for the
    process's own instruments)."""

    labels: dict[str, str]
    instruments: Snapshot


def snapshot_of(instruments: Iterable[Instrument]) -> Snapshot:
    return {
        inst.name: {
            "kind": inst.kind,
            "help": inst.help,
            "label": getattr(inst, "label", None),
            "value": inst.snapshot(),
        }
        for inst in instruments
    }


def values_of(snapshot: Snapshot) -> dict[str, Any]:
    """{name: value} of a snapshot (a labelled counter's value is {label: count})."""
    return {name: entry["value"] for name, entry in snapshot.items()}


class InstrumentSet:
    """Base of the dataclasses that hold instruments: every field that is one is exported."""

    def instruments(self) -> Iterator[Instrument]:
        """Every instrument, for an exporter (each has .name, .help, .kind)."""
        for value in vars(self).values():
            if isinstance(value, Counter | Gauge | Histogram):
                yield value

    def snapshot(self) -> Snapshot:
        return snapshot_of(self.instruments())


# The label values the session metrics may carry (anything else is counted as "other").
# Close reasons: the session layer's own, plus the generic ones transports pass to `close`.
CLOSE_REASONS = frozenset(
    {
        "client",  # the transport closed it (caller left, hung up, finished)
        "input_ended",
        "max_duration",
        "idle",
        "persona_error",
        "engine_error",
        "engine_lost",  # the engine (worker) serving it went away
        "frontend_lost",  # (engine worker) the front-end holding it went away
        "shutdown",
        "saturated",  # waiting for a slot when the process ran out of real-time headroom (shed)
        "refused",  # the transport refused the caller after opening (bad input, too fast...)
        "slow_client",
        "transport_error",
        "other",
    }
)
# Why an open or a reservation was refused.
REJECT_REASONS = frozenset(
    {
        "full",
        "queue_full",
        "reserve_full",
        "bad_ticket",
        "saturated",
        "draining",
        "persona",
        "ticket",
        "other",
    }
)
# Audio a call lost, or silence put in it, to keep the frame clock: by where and why
# (docs/capacity.md has the table). Engine side here; the phone call adds its playout's.
DROP_REASONS = frozenset({"jitter_buffer", "input_bound", "slow_consumer", "other"})
INSERT_REASONS = frozenset({"late_input", "other"})
ENGINE_METHODS = frozenset({"start", "step", "release", "snapshot", "restore", "other"})
TICKET_OUTCOMES = frozenset({"issued", "redeemed", "cancelled", "expired", "refused", "other"})


@dataclass
class SessionMetrics(InstrumentSet):
    """Every number the SessionManager keeps. Names follow Prometheus conventions (no prefix:
    the server adds `personaplex_`)."""

    ticks: Counter
    tick_seconds: Histogram
    tick_overruns: Counter
    active_slots: Gauge
    queued_sessions: Gauge
    late_frames: Counter
    prefill_seconds: Histogram
    restore_seconds: Histogram
    cache_hits: Counter
    cache_misses: Counter
    cache_evictions: Counter
    cache_bytes: Gauge
    cache_entries: Gauge
    dropped_output_frames: Counter
    dropped_input_samples: Counter
    jitter_dropped_frames: Counter
    catchup_frames: Counter
    catchup_silent_frames: Counter
    audio_dropped: Counter
    audio_inserted: Counter
    sessions_opened: Counter
    sessions_rejected: Counter
    sessions_closed: Counter
    engine_errors: Counter
    slot_failures: Counter
    reserved_slots: Gauge
    tickets: Counter

    @classmethod
    def create(cls) -> SessionMetrics:
        return cls(
            ticks=Counter("ticks_total", "Batched engine steps run"),
            tick_seconds=Histogram("tick_seconds", "Wall time of one batched engine step", TICK_BUCKETS),
            tick_overruns=Counter(
                "tick_overruns_total", "Times the realtime clock fell behind and skipped ahead"
            ),
            active_slots=Gauge("active_slots", "Engine slots held by sessions"),
            queued_sessions=Gauge("queued_sessions", "Sessions waiting for a slot"),
            late_frames=Counter(
                "late_frames_total", "Frames where a session's input was late and silence was fed"
            ),
            prefill_seconds=Histogram(
                "prefill_seconds", "Wall time of a system prompt prefill (cache miss)", PREFILL_BUCKETS
            ),
            restore_seconds=Histogram(
                "restore_seconds", "Wall time of a persona cache restore (cache hit)", PREFILL_BUCKETS
            ),
            cache_hits=Counter("persona_cache_hits_total", "Slot starts served from the persona cache"),
            cache_misses=Counter("persona_cache_misses_total", "Slot starts that ran the system prompt"),
            cache_evictions=Counter("persona_cache_evictions_total", "Persona cache entries evicted"),
            cache_bytes=Gauge("persona_cache_bytes", "Bytes held by the persona cache"),
            cache_entries=Gauge("persona_cache_entries", "Entries in the persona cache"),
            dropped_output_frames=Counter(
                "dropped_output_frames_total", "Output frames dropped because a consumer was slow"
            ),
            dropped_input_samples=Counter(
                "dropped_input_samples_total",
                "Input samples dropped (backlog over its bound, or trimmed by the jitter buffer)",
            ),
            jitter_dropped_frames=Counter(
                "jitter_dropped_frames_total",
                "Spare input frames the realtime jitter buffer dropped to bring latency back down",
            ),
            catchup_frames=Counter(
                "catchup_frames_total",
                "Start-burst input frames consumed by extra engine steps between ticks",
            ),
            catchup_silent_frames=Counter(
                "catchup_silent_frames_total",
                "Silent output frames of catch-up steps, not delivered (time already past)",
            ),
            audio_dropped=Counter(
                "audio_dropped_seconds_total",
                "Call audio dropped to keep the frame clock, by reason",
                label="reason",
                allowed=DROP_REASONS,
            ),
            audio_inserted=Counter(
                "audio_inserted_seconds_total",
                "Silence put into calls to keep the frame clock, by reason",
                label="reason",
                allowed=INSERT_REASONS,
            ),
            sessions_opened=Counter("sessions_opened_total", "Sessions admitted or queued"),
            sessions_rejected=Counter(
                "sessions_rejected_total",
                "Opens and reservations refused (no slot, a bad ticket, no real-time headroom), by reason",
                label="reason",
                allowed=REJECT_REASONS,
            ),
            sessions_closed=Counter(
                "sessions_closed_total", "Sessions ended, by reason", label="reason", allowed=CLOSE_REASONS
            ),
            engine_errors=Counter(
                "engine_errors_total",
                "Exceptions raised by the engine",
                label="method",
                allowed=ENGINE_METHODS,
            ),
            slot_failures=Counter(
                "slot_failures_total", "Sessions ended because the engine failed a step for their slot"
            ),
            reserved_slots=Gauge("reserved_slots", "Slots held by reservation tickets not yet redeemed"),
            tickets=Counter(
                "reservation_tickets_total",
                "Reservation tickets, by what became of them",
                label="outcome",
                allowed=TICKET_OUTCOMES,
            ),
        )
