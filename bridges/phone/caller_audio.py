"""The caller's side of one stream: media payloads -> the session, phased against its ticks.

Each payload is decoded and, once the pieces complete one of the engine's 80 ms frames,
resampled to 24 kHz and pushed (audio_path.InboundAudio). Ahead of the caller's first payload
goes a little silence, phased against the engine's frame clock, so that each frame is complete
`inbound_slack_ms` before the tick that takes it: a message that comes that much late leaves
the agent no gap.

What the caller says before the session is ready (its system prompt is being prefilled) is kept
here, up to `EARLY_AUDIO_S`, and pushed right behind that silence when it is: the session
absorbs the burst with catch-up steps (docs/sessions.md), and the phase the silence sets up is
kept because the silence is computed then, for the burst it precedes.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

from personaplex_voice.audio.budget import TokenBucket
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

from .audio_path import InboundAudio
from .carrier import MULAW_8K, AudioFormat, ProtocolError
from .playback_buffer import CHUNK_S, FRAME_S

# Caller audio kept while the session gets ready: with the silence ahead of it (at most a frame
# and the slack) it stays within the 1 s a session keeps before it runs (max_input_s).
EARLY_AUDIO_S = 0.8


class CallerAudio:
    def __init__(self, inbound_slack_ms: float, fmt: AudioFormat = MULAW_8K):
        self.slack_ms = inbound_slack_ms
        self.inbound = InboundAudio(fmt)
        self.frames_in = 0
        self._early = bytearray()  # media before the session was ready, the newest EARLY_AUDIO_S
        self._early_dropped_bytes = 0
        self.gaps = 0  # chunks the carrier numbered but we never got
        self.last_chunk = 0
        self.last_media = time.monotonic()  # carriers send caller audio all along, silence included
        self.last_pcm: np.ndarray | None = None  # the latest frame pushed (for level meters)
        self._cushioned = False
        self._bucket_for(fmt)

    def _bucket_for(self, fmt: AudioFormat) -> None:
        # The line carries `rate` samples a second; allow 1.5x that, and a 10 s burst after a stall.
        per_s = fmt.rate * fmt.bytes_per_sample
        self._pace = TokenBucket(1.5 * per_s, 10 * per_s)

    def set_format(self, fmt: AudioFormat) -> None:
        """The stream says how its audio comes (its start message), before any of it came."""
        if fmt != self.inbound.format:
            self.inbound = InboundAudio(fmt)
            self._bucket_for(fmt)

    @property
    def format(self) -> AudioFormat:
        return self.inbound.format

    @property
    def _early_limit(self) -> int:
        fmt = self.format
        limit = round(EARLY_AUDIO_S * fmt.rate) * fmt.bytes_per_sample
        return limit - limit % fmt.bytes_per_sample

    @property
    def dropped(self) -> int:
        """20 ms messages' worth of caller audio lost before the session was ready (past the bound)."""
        return self._early_dropped_bytes // self.format.chunk_bytes

    def feed(self, payload: bytes, chunk: int | None, session: Any | None) -> None:
        """One media payload; `session` is None until it is ready (the payload is then kept for
        it). Raises ProtocolError for audio far faster than real time (decoding it is our CPU)."""
        if not self._pace.take(len(payload)):
            raise ProtocolError("caller audio arrives much faster than real time")
        self.frames_in += 1
        self.last_media = time.monotonic()
        if chunk is not None:
            if self.last_chunk and chunk > self.last_chunk + 1:
                self.gaps += chunk - self.last_chunk - 1
            self.last_chunk = max(self.last_chunk, chunk)
        if session is None:
            self._early += payload
            excess = len(self._early) - self._early_limit
            if excess > 0:
                excess += (-excess) % self.format.bytes_per_sample  # whole samples only
                del self._early[:excess]
                self._early_dropped_bytes += excess
            return
        if not self._cushioned:
            self._cushioned = True
            early, self._early = bytes(self._early), bytearray()
            message_s = self.inbound.engine_samples(len(payload)) / SAMPLE_RATE or CHUNK_S
            if message_s > FRAME_S:
                # Pieces longer than a frame leave whole frames queued between ticks: the
                # session must take them for the cushion they are, not for a start burst.
                expect = getattr(session, "expect_input_pieces", None)
                if expect is not None:
                    expect(message_s)
            early_samples = round(self.inbound.engine_samples(len(early)))
            cushion = self.cushion_samples(session.seconds_to_next_tick(), message_s, early_samples)
            session.push(self.inbound.lead(cushion))
            payload = early + payload
        pcm = self.inbound.feed(payload)
        if pcm is not None:
            session.push(pcm)
            self.last_pcm = pcm

    def cushion_samples(
        self, to_tick_s: float | None, message_s: float = CHUNK_S, early_samples: int = 0
    ) -> int:
        """Silence to push ahead of the caller's first message so that, just before each engine
        tick, the session holds one full frame plus `inbound_slack_ms` of audio.

        Messages bring 20 ms each on most carriers; the ticks come every 80 ms, the next one in
        `to_tick_s`. Before it, this message and floor(to_tick / 20 ms) more will have come. With
        the engine's clock idle (None) this session's first full frame starts it at once, so the
        ticks fall on this message's phase: before each later one the session holds the cushion
        plus the messages since the last. A carrier that sends longer messages (Exotel: about
        100 ms) needs the least cushion that keeps a frame complete `inbound_slack_ms` before
        every tick, found by `long_message_cushion_ms`. `early_samples` of kept audio go between
        this silence and the message: what they add comes off the silence (the session catches
        whole frames of it up, keeping the phase).
        """
        frame_ms, chunk_ms = FRAME_S * 1000, CHUNK_S * 1000
        if message_s * 1000 > chunk_ms + 0.5:
            cushion_ms = long_message_cushion_ms(to_tick_s, message_s * 1000, frame_ms, self.slack_ms)
        elif to_tick_s is None:
            cushion_ms = frame_ms + self.slack_ms
        else:
            to_tick_ms = (to_tick_s * 1000) % frame_ms
            arriving_ms = chunk_ms + chunk_ms * (to_tick_ms // chunk_ms)
            cushion_ms = (frame_ms + self.slack_ms - arriving_ms) % frame_ms
        cushion = round(cushion_ms * SAMPLE_RATE / 1000)
        if early_samples <= cushion:
            return cushion - early_samples
        return (cushion - early_samples) % FRAME_SIZE

    def metrics(self) -> dict[str, int]:
        return {
            "frames_in": self.frames_in,
            "inbound_dropped_before_ready": self.dropped,
            "inbound_gaps": self.gaps,
        }


def long_message_cushion_ms(
    to_tick_s: float | None, message_ms: float, frame_ms: float, slack_ms: float
) -> float:
    """The least silence (ms, to 1 ms) ahead of a carrier's first long message (longer than 20 ms;
    one arrives every `message_ms`, this one now) that keeps every engine frame complete
    `slack_ms` before the tick that takes it, from the session's first stepped tick on.

    The ticks come every `frame_ms`, the next in `to_tick_s` (None: the engine's clock is idle,
    and this push, a full frame at least, starts it now). A session is stepped from the first
    tick that finds a full frame; after that each tick takes one frame. A message that arrives
    exactly at a tick counts as arriving after it. Checked over two of the pattern's periods
    (every pattern of two fixed rates repeats), the smallest cushion that passes is returned:
    any more would only be delay (and spare frames the jitter buffer would trim)."""
    first_tick = 0.0 if to_tick_s is None else (to_tick_s * 1000) % frame_ms
    period = _lcm_ms(message_ms, frame_ms)
    ticks = int(2 * period / frame_ms) + 3
    low = max(0.0, frame_ms - message_ms) if to_tick_s is None else 0.0
    for cushion in range(int(low), int(2 * frame_ms + message_ms + slack_ms) + 2):
        if _keeps_frames(cushion, first_tick, message_ms, frame_ms, slack_ms, ticks, to_tick_s is None):
            return float(cushion)
    return (
        2 * frame_ms + message_ms + slack_ms
    )  # not reached: a cushion of two frames and a message always does


def _keeps_frames(
    cushion: float,
    first_tick: float,
    message_ms: float,
    frame_ms: float,
    slack_ms: float,
    ticks: int,
    idle: bool,
) -> bool:
    def arrived(by: float, strict: bool = True) -> float:
        """Audio (ms) in the session by time `by` (this push at 0, one message each message_ms)."""
        if by < 0 or (strict and by == 0 and not idle):
            return 0.0
        later = max(0, math.ceil(by / message_ms) - 1) if by > 0 else 0
        return cushion + message_ms * (1 + later)

    taken = 0.0
    started = False
    for n in range(ticks):
        tick = first_tick + n * frame_ms
        if not started:
            started = arrived(tick) - taken >= frame_ms
        elif arrived(tick - slack_ms) - taken < frame_ms:
            return False
        if started:
            taken += frame_ms
    return started


def _lcm_ms(a: float, b: float) -> float:
    """The least common multiple of two durations, at 1 ms resolution."""
    x, y = max(1, round(a)), max(1, round(b))
    return float(x * y // math.gcd(x, y))
