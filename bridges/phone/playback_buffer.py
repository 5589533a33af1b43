"""Real-time pacing of outbound audio, and the call's playback bookkeeping.

The carrier plays what we send at real time and buffers the rest, so every millisecond it holds
is heard as delay, and is still played after the agent has gone quiet (a caller who barges in
keeps hearing the old words). The pacer models the carrier's buffer as a clock: `play_end` is
when the audio sent so far will have finished playing if playback starts the moment a message
arrives. A 20 ms message goes out when the carrier's buffer has room under the *target* (the
cushion + one message), never past `max_queued_s`: messages leave every 20 ms, not in 80 ms
bursts.

When the carrier's buffer is empty (the call's start, or the engine fell behind) it is first
refilled with a cushion of silence (40 ms by default): the engine's 80 ms frames may then come
that much late without a gap in what the caller hears. Marks the carrier echoes (Twilio's and
Telnyx's `mark`, Plivo's `playedStream`, Vonage's `websocket:notify`) give a second, measured
estimate of its buffer.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

CHUNK_S = 0.020  # one media message
FRAME_S = 0.080  # one engine frame


def percentile(values: list[float] | deque[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return float(ordered[index])


@dataclass
class PlaybackClock:
    """Model of the carrier's playback buffer for our audio (monotonic seconds)."""

    max_queued_s: float = 0.100  # hard limit of what the carrier may hold
    target_s: float = 0.060  # send when the buffer will stay at or under this
    message_s: float = CHUNK_S  # audio per message (longer where the carrier limits messages)
    play_end: float = 0.0  # when everything sent so far has played out
    started: bool = False
    underruns: int = 0  # messages that arrived after the previous one had finished playing
    sent_s: float = 0.0  # audio sent in total (seconds)
    max_seen_queue_s: float = 0.0

    def queued(self, now: float) -> float:
        return max(0.0, self.play_end - now)

    def wait_before_send(self, now: float) -> float:
        """Seconds to wait before one more message fits under the target."""
        return max(0.0, self.queued(now) + self.message_s - min(self.target_s, self.max_queued_s))

    def needs_prime(self, now: float) -> bool:
        """True when the buffer ran dry: start (again) with a cushion of silence."""
        return not self.started or now >= self.play_end

    def sent(self, now: float, duration_s: float | None = None) -> None:
        duration_s = self.message_s if duration_s is None else duration_s
        if self.started and now > self.play_end + 1e-3:
            self.underruns += 1
        self.started = True
        self.play_end = max(self.play_end, now) + duration_s
        self.sent_s += duration_s
        self.max_seen_queue_s = max(self.max_seen_queue_s, self.play_end - now)

    def cleared(self, now: float) -> None:
        """The carrier dropped its buffer (we sent `clear`)."""
        self.play_end = now


@dataclass
class MarkTracker:
    """Marks we sent (name -> audio seconds sent up to it) and what their echoes tell us."""

    pending: dict[str, float] = field(default_factory=dict)
    acked: int = 0
    sent: int = 0
    played_s: float = 0.0  # audio confirmed played
    queued_at_ack_s: deque[float] = field(default_factory=lambda: deque(maxlen=2000))

    def add(self, name: str, sent_s: float) -> None:
        self.pending[name] = sent_s
        self.sent += 1
        while len(self.pending) > 256:  # never echoed (e.g. after a clear)
            self.pending.pop(next(iter(self.pending)))

    def echo(self, name: str, total_sent_s: float) -> bool:
        """A mark came back: audio up to it has played. False for names we never sent."""
        at = self.pending.pop(name, None)
        if at is None:
            return False
        self.acked += 1
        self.played_s = max(self.played_s, at)
        self.queued_at_ack_s.append(max(0.0, total_sent_s - at))
        return True

    def drop_all(self) -> None:
        self.pending.clear()


@dataclass
class FrameJitter:
    """Lateness of each outbound frame against the call's ideal 80 ms grid (ms).

    The grid starts at the first frame; jitter of frame n is its send time minus the grid time,
    minus the smallest such offset seen (packet delay variation, ITU-T Y.1540 style).
    """

    period_s: float = 0.080
    t0: float | None = None
    offsets: deque[float] = field(default_factory=lambda: deque(maxlen=5000))
    min_offset: float = 0.0
    count: int = 0

    def frame(self, now: float) -> None:
        if self.t0 is None:
            self.t0 = now
        offset = now - (self.t0 + self.count * self.period_s)
        self.count += 1
        self.min_offset = min(self.min_offset, offset)
        self.offsets.append(offset)

    def p99_ms(self) -> float:
        return percentile([o - self.min_offset for o in self.offsets], 99) * 1000

    def p50_ms(self) -> float:
        return percentile([o - self.min_offset for o in self.offsets], 50) * 1000
