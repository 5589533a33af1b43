"""The caller's side of one stream: `media` payloads -> the session, phased against its ticks.

Each 20 ms payload is decoded and, once the pieces complete one of the engine's 80 ms frames,
resampled to 24 kHz and pushed (audio_path.InboundAudio). Ahead of the caller's first payload
goes a little silence, phased against the engine's frame clock, so that each frame is complete
`inbound_slack_ms` before the tick that takes it: a message that comes that much late leaves
the agent no gap.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from personaplex_voice.audio.budget import TokenBucket
from personaplex_voice.engine.base import SAMPLE_RATE

from .audio_path import TWILIO_RATE, InboundAudio
from .playback_buffer import CHUNK_S, FRAME_S
from .wire import ProtocolError


class CallerAudio:
    def __init__(self, inbound_slack_ms: float):
        self.slack_ms = inbound_slack_ms
        self.inbound = InboundAudio()
        self.frames_in = 0
        self.dropped = 0  # media before the session was ready
        self.gaps = 0  # chunks Twilio numbered but we never got
        self.last_chunk = 0
        self.last_media = time.monotonic()  # Twilio sends caller audio every 20 ms, silence included
        self.last_pcm: np.ndarray | None = None  # the latest frame pushed (for level meters)
        self._cushioned = False
        # Twilio sends 8,000 μ-law bytes a second; allow 1.5x that, and a 10 s burst after a stall.
        self._pace = TokenBucket(1.5 * TWILIO_RATE, 10 * TWILIO_RATE)

    def feed(self, ulaw: bytes, chunk: int | None, session: Any | None) -> None:
        """One `media` payload; `session` is None until it is ready (the payload is then dropped).
        Raises ProtocolError for audio far faster than real time (decoding it is our CPU)."""
        if not self._pace.take(len(ulaw)):
            raise ProtocolError("caller audio arrives much faster than real time")
        self.frames_in += 1
        self.last_media = time.monotonic()
        if chunk is not None:
            if self.last_chunk and chunk > self.last_chunk + 1:
                self.gaps += chunk - self.last_chunk - 1
            self.last_chunk = max(self.last_chunk, chunk)
        if session is None:
            self.dropped += 1
            return
        if not self._cushioned:
            self._cushioned = True
            session.push(self.inbound.lead(self.cushion_samples(session.seconds_to_next_tick())))
        pcm = self.inbound.feed(ulaw)
        if pcm is not None:
            session.push(pcm)
            self.last_pcm = pcm

    def cushion_samples(self, to_tick_s: float | None) -> int:
        """Silence to push ahead of the caller's first message so that, just before each engine
        tick, the session holds one full frame plus `inbound_slack_ms` of audio.

        Messages bring 20 ms each; the ticks come every 80 ms, the next one in `to_tick_s`.
        Before it, this message and floor(to_tick / 20 ms) more will have come. With the
        engine's clock idle (None) this session's first full frame starts it at once, so the
        ticks fall on this message's phase: before each later one the session holds the
        cushion plus the three messages since the last.
        """
        frame_ms, chunk_ms = FRAME_S * 1000, CHUNK_S * 1000
        if to_tick_s is None:
            cushion_ms = frame_ms + self.slack_ms
        else:
            to_tick_ms = (to_tick_s * 1000) % frame_ms
            arriving_ms = chunk_ms + chunk_ms * (to_tick_ms // chunk_ms)
            cushion_ms = (frame_ms + self.slack_ms - arriving_ms) % frame_ms
        return round(cushion_ms * SAMPLE_RATE / 1000)

    def metrics(self) -> dict[str, int]:
        return {
            "frames_in": self.frames_in,
            "inbound_dropped_before_ready": self.dropped,
            "inbound_gaps": self.gaps,
        }
