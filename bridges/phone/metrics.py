"""What the phone call adds to the server's `/metrics`: callers refused, and audio its playout or
its early-audio bound dropped or filled with silence to keep the clock (the engine side's own are
the session host's: `audio_dropped_seconds_total` and `audio_inserted_seconds_total`).

One `PhoneMetrics` per phone service; the service adds it to the app's `metric_sources`, so the
server's one Prometheus converter exports it as `personaplex_phone_*`.
"""

from __future__ import annotations

from dataclasses import dataclass

from personaplex_voice.metrics import Counter, InstrumentSet

# Why an answer (or an in-stream admission) gave the caller no agent.
REFUSAL_REASONS = frozenset({"full", "saturated", "loading", "unconfigured", "ended", "other"})
# Audio the phone call dropped, or silence it (or the carrier) played, to keep the clock.
DROP_REASONS = frozenset({"playout_overflow", "early_audio", "other"})
INSERT_REASONS = frozenset({"playout_underrun", "other"})


@dataclass
class PhoneMetrics(InstrumentSet):
    refusals: Counter
    audio_dropped: Counter
    audio_inserted: Counter

    @classmethod
    def create(cls) -> PhoneMetrics:
        return cls(
            refusals=Counter(
                "phone_refusals_total",
                "Calls answered with no agent (busy, saturated, not configured), by reason",
                label="reason",
                allowed=REFUSAL_REASONS,
            ),
            audio_dropped=Counter(
                "phone_audio_dropped_seconds_total",
                "Call audio the phone call dropped (playout over its bound, caller audio before the "
                "session was ready beyond its bound), by reason",
                label="reason",
                allowed=DROP_REASONS,
            ),
            audio_inserted=Counter(
                "phone_audio_inserted_seconds_total",
                "Silence the caller heard mid-call because our audio came late (the carrier's buffer "
                "ran dry, then the cushion refilled), by reason",
                label="reason",
                allowed=INSERT_REASONS,
            ),
        )
