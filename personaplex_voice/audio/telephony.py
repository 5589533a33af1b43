"""The phone network's sample formats beside μ-law: G.711 A-law and 16-bit linear PCM (L16).

Carriers name byte order differently, so L16 here never assumes one: every call says `big_endian`.
RTP's L16 (RFC 3551 §4.5.11, and the carriers that send RTP payloads as they are) is big-endian,
"network byte order"; the raw PCM that other carriers put in WebSocket messages is little-endian,
the order of the machines that produce it. Decoding gives float32 in [-1, 1), encoding rounds and
clips like `mulaw.float_to_int16`.
"""

from __future__ import annotations

import warnings

import numpy as np

from .mulaw import float_to_int16, int16_to_float

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # see mulaw.py: audioop-lts on 3.13+
    import audioop

__all__ = ["ALAW_SILENCE", "alaw_decode", "alaw_encode", "l16_decode", "l16_encode"]

# The A-law byte for a zero sample (A-law inverts even bits: 0x55 ^ 0x80).
ALAW_SILENCE = 0xD5

_BIG = np.dtype(">i2")
_LITTLE = np.dtype("<i2")


def alaw_encode(pcm: np.ndarray) -> bytes:
    """Float32 mono samples in [-1, 1] to one G.711 A-law byte per sample."""
    return audioop.lin2alaw(float_to_int16(pcm).tobytes(), 2)


def alaw_decode(data: bytes) -> np.ndarray:
    """G.711 A-law bytes to float32 samples in [-1, 1)."""
    linear = audioop.alaw2lin(bytes(data), 2)
    return int16_to_float(np.frombuffer(linear, dtype=np.int16))


def l16_encode(pcm: np.ndarray, *, big_endian: bool) -> bytes:
    """Float32 mono samples to 16-bit signed PCM, two bytes a sample in the given byte order."""
    return float_to_int16(pcm).astype(_BIG if big_endian else _LITTLE, copy=False).tobytes()


def l16_decode(data: bytes, *, big_endian: bool) -> np.ndarray:
    """16-bit signed PCM in the given byte order to float32 in [-1, 1). An odd trailing byte (half
    a sample) is an error: the caller's framing is broken, not the audio."""
    if len(data) % 2:
        raise ValueError(f"L16 data must hold whole 2-byte samples, got {len(data)} bytes")
    samples = np.frombuffer(bytes(data), dtype=_BIG if big_endian else _LITTLE)
    return samples.astype(np.float32) / 32768.0
