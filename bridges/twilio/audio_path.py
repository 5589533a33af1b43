"""The two audio conversions of a phone call, with their state.

Inbound: Twilio's base64 μ-law at 8 kHz -> float32 at 24 kHz for `Session.push`.
Outbound: the engine's 80 ms frames at 24 kHz -> μ-law at 8 kHz cut into 20 ms (160-byte)
payloads, the size Twilio's own media messages have.
"""

from __future__ import annotations

import numpy as np

from personaplex_voice.audio.mulaw import ulaw_decode, ulaw_encode
from personaplex_voice.audio.resample import BlockResampler
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

TWILIO_RATE = 8000
CHUNK_MS = 20
CHUNK_BYTES = TWILIO_RATE * CHUNK_MS // 1000  # 160 μ-law bytes per media message
_UP = SAMPLE_RATE // TWILIO_RATE  # 3 engine samples per telephone sample


class InboundAudio:
    """μ-law 8 kHz bytes -> float32 24 kHz, streaming (filter state kept across messages).

    `feed` hands audio on only when it completes one of the session's 80 ms frames: the engine
    cannot step a partial frame anyway, so holding the pieces back costs no delay and converts
    once per frame instead of once per 20 ms message. `lead` puts silence ahead of the call.
    """

    def __init__(self) -> None:
        self._resampler = BlockResampler(TWILIO_RATE, SAMPLE_RATE)
        self._pending = bytearray()
        self.produced = 0  # 24 kHz samples handed on, lead included

    def lead(self, samples: int) -> np.ndarray:
        samples -= samples % _UP  # whole 8 kHz periods keep the frame arithmetic exact
        self.produced += samples
        return np.zeros(samples, np.float32)

    def feed(self, ulaw: bytes) -> np.ndarray | None:
        self._pending += ulaw
        to_frame_end = (-self.produced) % FRAME_SIZE or FRAME_SIZE
        if len(self._pending) * _UP < to_frame_end:
            return None
        out = self.convert(bytes(self._pending))
        self._pending.clear()
        self.produced += len(out)
        return out

    def convert(self, ulaw: bytes) -> np.ndarray:
        return self._resampler.process(ulaw_decode(ulaw))

    @property
    def waiting(self) -> int:
        """8 kHz samples held until they complete a frame."""
        return len(self._pending)

    @property
    def delay_samples(self) -> float:
        """Filter delay in 24 kHz samples."""
        return self._resampler.delay_samples


class OutboundAudio:
    """float32 24 kHz -> list of 160-byte μ-law payloads; a remainder waits for the next frame."""

    def __init__(self) -> None:
        self._resampler = BlockResampler(SAMPLE_RATE, TWILIO_RATE)
        self._pending = b""

    def convert(self, pcm_24k: np.ndarray) -> list[bytes]:
        data = self._pending + ulaw_encode(self._resampler.process(pcm_24k))
        whole = len(data) - len(data) % CHUNK_BYTES
        self._pending = data[whole:]
        return [data[i : i + CHUNK_BYTES] for i in range(0, whole, CHUNK_BYTES)]

    def reset(self) -> None:
        """Forget buffered audio (after a `clear`: the next utterance starts fresh)."""
        self._resampler.reset()
        self._pending = b""

    @property
    def delay_samples(self) -> float:
        """Filter delay in 8 kHz samples."""
        return self._resampler.delay_samples
