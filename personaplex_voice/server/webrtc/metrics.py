"""The WebRTC transport's own instruments (exported under `personaplex_webrtc_*` by /metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from personaplex_voice.metrics import Counter, Gauge, InstrumentSet

ERROR_KINDS = frozenset(
    {
        "auth",
        "origin",
        "bad_query",
        "persona",
        "bad_offer",
        "unavailable",
        "capacity",
        "saturated",
        "loading",
        "ice",
        "too_fast",
        "decode_cost",
        "connect_timeout",
        "peer_timeout",
        "session_ended",
        "internal",
    }
)
CONCEALMENT = frozenset({"fec", "plc", "dtx"})


@dataclass
class WebRTCMetrics(InstrumentSet):
    calls: Counter
    open_calls: Gauge
    errors: Counter
    caller_packets: Counter
    caller_lost_packets: Counter
    caller_late_packets: Counter
    caller_filled_seconds: Counter
    agent_packets: Counter
    agent_dropped_packets: Counter
    data_messages_in: Counter

    @classmethod
    def create(cls) -> WebRTCMetrics:
        return cls(
            calls=Counter("webrtc_calls_total", "WebRTC calls answered (WHIP and /api/offer)"),
            open_calls=Gauge("webrtc_open_calls", "WebRTC calls with a live peer connection"),
            errors=Counter(
                "webrtc_errors_total",
                "WebRTC calls refused or ended by the server, by kind",
                "kind",
                ERROR_KINDS,
            ),
            caller_packets=Counter("webrtc_caller_packets_total", "RTP packets of callers' audio received"),
            caller_lost_packets=Counter(
                "webrtc_caller_lost_packets_total", "RTP packets of callers' audio that never arrived"
            ),
            caller_late_packets=Counter(
                "webrtc_caller_late_packets_total",
                "Callers' RTP packets that arrived after their audio was concealed",
            ),
            caller_filled_seconds=Counter(
                "webrtc_caller_filled_seconds_total",
                "Callers' audio rebuilt or filled: fec (from the next packet), plc (concealed), dtx (pauses)",
                "how",
                CONCEALMENT,
            ),
            agent_packets=Counter("webrtc_agent_packets_total", "RTP packets of agent audio sent"),
            agent_dropped_packets=Counter(
                "webrtc_agent_dropped_packets_total",
                "Agent audio packets dropped because the peer could not take them",
            ),
            data_messages_in=Counter(
                "webrtc_data_messages_in_total", "Data channel messages received, by kind", "kind"
            ),
        )
