"""The two audio conversions of a phone call, with their state, for any carrier's format.

Inbound: the carrier's payloads (μ-law, A-law or L16, 8 or 16 kHz) -> float32 at 24 kHz for
`Session.push`. Outbound: the engine's 80 ms frames at 24 kHz -> the stream's outbound format,
cut into 20 ms payloads (the size every carrier here plays smoothly).

The codecs are `personaplex_voice.audio`'s; this module only picks them by `AudioFormat` and
keeps the resamplers' state across messages. With no format given it is Twilio's: μ-law 8 kHz.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from personaplex_voice.audio.mulaw import ULAW_SILENCE, ulaw_decode, ulaw_encode
from personaplex_voice.audio.resample import BlockResampler
from personaplex_voice.audio.telephony import ALAW_SILENCE, alaw_decode, alaw_encode, l16_decode, l16_encode
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

from .carrier import MULAW_8K, AudioFormat

CHUNK_BYTES = MULAW_8K.chunk_bytes  # 160 μ-law bytes: one 20 ms message at 8 kHz (Twilio's size)


@dataclass(frozen=True)
class Codec:
    """Bytes <-> float32 at the format's own rate."""

    decode: Callable[[bytes], np.ndarray]
    encode: Callable[[np.ndarray], bytes]
    silence: bytes  # one sample's worth of a zero sample


def codec_for(fmt: AudioFormat) -> Codec:
    if fmt.codec == "pcmu":
        return Codec(ulaw_decode, ulaw_encode, bytes([ULAW_SILENCE]))
    if fmt.codec == "pcma":
        return Codec(alaw_decode, alaw_encode, bytes([ALAW_SILENCE]))
    big = fmt.big_endian
    return Codec(
        lambda data: l16_decode(data, big_endian=big),
        lambda pcm: l16_encode(pcm, big_endian=big),
        b"\x00\x00",
    )


def silence_chunk(fmt: AudioFormat) -> bytes:
    """One 20 ms message of silence in `fmt`."""
    return codec_for(fmt).silence * (fmt.chunk_bytes // fmt.bytes_per_sample)


class _Identity:
    """The resampler of a stream already at the engine's rate (Exotel's 24 kHz)."""

    delay_samples = 0.0

    def process(self, x: np.ndarray) -> np.ndarray:
        return np.asarray(x, np.float32)

    def reset(self) -> None:
        pass


def _resampler(in_rate: int, out_rate: int) -> BlockResampler | _Identity:
    return _Identity() if in_rate == out_rate else BlockResampler(in_rate, out_rate)


class InboundAudio:
    """Carrier payloads -> float32 24 kHz, streaming (filter state kept across messages).

    `feed` hands audio on only when it completes one of the session's 80 ms frames: the engine
    cannot step a partial frame anyway, so holding the pieces back costs no delay and converts
    once per frame instead of once per 20 ms message. `lead` puts silence ahead of the call.
    """

    def __init__(self, fmt: AudioFormat = MULAW_8K) -> None:
        self.format = fmt
        self._codec = codec_for(fmt)
        self._resampler = _resampler(fmt.rate, SAMPLE_RATE)
        # Engine samples per whole group of line samples (3 per 8 kHz sample, 3 per two at 16 kHz):
        # silence in whole groups keeps the frame arithmetic exact.
        self._period = SAMPLE_RATE // math.gcd(SAMPLE_RATE, fmt.rate)
        self._pending = bytearray()
        self.produced = 0  # 24 kHz samples handed on, lead included

    def lead(self, samples: int) -> np.ndarray:
        samples -= samples % self._period
        self.produced += samples
        return np.zeros(samples, np.float32)

    def engine_samples(self, payload_bytes: int) -> float:
        """24 kHz samples that `payload_bytes` of the line's audio become."""
        return payload_bytes / self.format.bytes_per_sample * SAMPLE_RATE / self.format.rate

    def feed(self, payload: bytes) -> np.ndarray | None:
        self._pending += payload
        to_frame_end = (-self.produced) % FRAME_SIZE or FRAME_SIZE
        if self.engine_samples(len(self._pending)) < to_frame_end:
            return None
        whole = len(self._pending) - len(self._pending) % self.format.bytes_per_sample
        out = self.convert(bytes(self._pending[:whole]))
        del self._pending[:whole]
        self.produced += len(out)
        return out

    def convert(self, payload: bytes) -> np.ndarray:
        return self._resampler.process(self._codec.decode(payload))

    def decode(self, payload: bytes) -> np.ndarray:
        """The payload at its own rate (for the recording), without touching the stream's state."""
        return self._codec.decode(payload[: len(payload) - len(payload) % self.format.bytes_per_sample])

    @property
    def waiting(self) -> int:
        """Line samples held until they complete a frame."""
        return len(self._pending) // self.format.bytes_per_sample

    @property
    def delay_samples(self) -> float:
        """Filter delay in 24 kHz samples."""
        return self._resampler.delay_samples


class OutboundAudio:
    """float32 24 kHz -> list of 20 ms payloads in the outbound format; a remainder waits for the
    next frame."""

    def __init__(self, fmt: AudioFormat = MULAW_8K) -> None:
        self.format = fmt
        self._codec = codec_for(fmt)
        self._resampler = _resampler(SAMPLE_RATE, fmt.rate)
        self._chunk = fmt.chunk_bytes
        self._pending = b""

    def convert(self, pcm_24k: np.ndarray) -> list[bytes]:
        data = self._pending + self._codec.encode(self._resampler.process(pcm_24k))
        whole = len(data) - len(data) % self._chunk
        self._pending = data[whole:]
        return [data[i : i + self._chunk] for i in range(0, whole, self._chunk)]

    def decode(self, payload: bytes) -> np.ndarray:
        """A payload of ours back to float32 at the line's rate (for the recording)."""
        return self._codec.decode(payload)

    def reset(self) -> None:
        """Forget buffered audio (after a `clear`: the next utterance starts fresh)."""
        self._resampler.reset()
        self._pending = b""

    @property
    def delay_samples(self) -> float:
        """Filter delay in samples of the line's rate."""
        return self._resampler.delay_samples
