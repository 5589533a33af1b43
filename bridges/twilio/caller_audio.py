"""The caller's side of one stream: `media` payloads -> the session, phased against its ticks.

Each 20 ms payload is decoded and, once the pieces complete one of the engine's 80 ms frames,
resampled to 24 kHz and pushed (audio_path.InboundAudio). Ahead of the caller's first payload
goes a little silence, phased against the engine's frame clock, so that each frame is complete
`inbound_slack_ms` before the tick that takes it: a message that comes that much late leaves
the agent no gap.

What the caller says before the session is ready (its system prompt is being prefilled) is kept
here, up to `EARLY_AUDIO_BYTES`, and pushed right behind that silence when it is: the session
absorbs the burst with catch-up steps (docs/sessions.md), and the phase the silence sets up is
kept because the silence is computed then, for the burst it precedes.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from personaplex_voice.audio.budget import TokenBucket
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

from .audio_path import CHUNK_BYTES, TWILIO_RATE, InboundAudio
from .playback_buffer import CHUNK_S, FRAME_S
from .wire import ProtocolError

# Caller audio kept while the session gets ready: with the silence ahead of it (at most a frame
# and the slack) it stays within the 1 s a session keeps before it runs (max_input_s).
EARLY_AUDIO_BYTES = TWILIO_RATE * 8 // 10  # 0.8 s of μ-law


class CallerAudio:
    def __init__(self, inbound_slack_ms: float):
        self.slack_ms = inbound_slack_ms
        self.inbound = InboundAudio()
        self.frames_in = 0
        self._early = bytearray()  # media before the session was ready, newest EARLY_AUDIO_BYTES
        self._early_dropped_bytes = 0
        self.gaps = 0  # chunks Twilio numbered but we never got
        self.last_chunk = 0
        self.last_media = time.monotonic()  # Twilio sends caller audio every 20 ms, silence included
        self.last_pcm: np.ndarray | None = None  # the latest frame pushed (for level meters)
        self._cushioned = False
        # Twilio sends 8,000 μ-law bytes a second; allow 1.5x that, and a 10 s burst after a stall.
        self._pace = TokenBucket(1.5 * TWILIO_RATE, 10 * TWILIO_RATE)

    @property
    def dropped(self) -> int:
        """20 ms messages' worth of caller audio lost before the session was ready (past the bound)."""
        return self._early_dropped_bytes // CHUNK_BYTES

    def feed(self, ulaw: bytes, chunk: int | None, session: Any | None) -> None:
        """One `media` payload; `session` is None until it is ready (the payload is then kept for
        it). Raises ProtocolError for audio far faster than real time (decoding it is our CPU)."""
        if not self._pace.take(len(ulaw)):
            raise ProtocolError("caller audio arrives much faster than real time")
        self.frames_in += 1
        self.last_media = time.monotonic()
        if chunk is not None:
            if self.last_chunk and chunk > self.last_chunk + 1:
                self.gaps += chunk - self.last_chunk - 1
            self.last_chunk = max(self.last_chunk, chunk)
        if session is None:
            self._early += ulaw
            excess = len(self._early) - EARLY_AUDIO_BYTES
            if excess > 0:
                del self._early[:excess]
                self._early_dropped_bytes += excess
            return
        if not self._cushioned:
            self._cushioned = True
            early, self._early = bytes(self._early), bytearray()
            early_samples = len(early) * (SAMPLE_RATE // TWILIO_RATE)
            cushion = self.cushion_samples(session.seconds_to_next_tick(), early_samples)
            session.push(self.inbound.lead(cushion))
            ulaw = early + ulaw
        pcm = self.inbound.feed(ulaw)
        if pcm is not None:
            session.push(pcm)
            self.last_pcm = pcm

    def cushion_samples(self, to_tick_s: float | None, early_samples: int = 0) -> int:
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
        cushion = round(cushion_ms * SAMPLE_RATE / 1000)
        # `early_samples` of kept audio go between this silence and the message: what they add
        # comes off the silence (the session catches whole frames of it up, keeping the phase).
        if early_samples <= cushion:
            return cushion - early_samples
        return (cushion - early_samples) % FRAME_SIZE

    def metrics(self) -> dict[str, int]:
        return {
            "frames_in": self.frames_in,
            "inbound_dropped_before_ready": self.dropped,
            "inbound_gaps": self.gaps,
        }
