"""G.711 μ-law encode/decode (8-bit telephony samples, as Twilio Media Streams carry them).

The codec itself is libc-speed C in ``audioop``: the stdlib module on Python < 3.13 and the
``audioop-lts`` package (same import name) from 3.13 on, where the stdlib one was removed.
"""

from __future__ import annotations

import warnings

import numpy as np

with warnings.catch_warnings():
    # Python 3.11/3.12 warn that the stdlib module is going away; audioop-lts replaces it on 3.13+.
    warnings.simplefilter("ignore", DeprecationWarning)
    import audioop

__all__ = ["ULAW_SILENCE", "float_to_int16", "int16_to_float", "ulaw_decode", "ulaw_encode"]

# The μ-law byte for a zero sample: what a transport sends to pad a short chunk with silence.
ULAW_SILENCE = 0xFF


def float_to_int16(pcm: np.ndarray) -> np.ndarray:
    """Float samples in [-1, 1] to int16, rounding and clipping (never wrapping) out-of-range input."""
    scaled = np.rint(np.asarray(pcm, dtype=np.float32) * 32768.0)
    return np.clip(scaled, -32768, 32767).astype(np.int16)


def int16_to_float(pcm: np.ndarray) -> np.ndarray:
    return np.asarray(pcm, dtype=np.int16).astype(np.float32) / 32768.0


def ulaw_encode(pcm: np.ndarray) -> bytes:
    """Float32 mono samples in [-1, 1] to one μ-law byte per sample."""
    return audioop.lin2ulaw(float_to_int16(pcm).tobytes(), 2)


def ulaw_decode(data: bytes) -> np.ndarray:
    """μ-law bytes to float32 samples in [-1, 1)."""
    linear = audioop.ulaw2lin(bytes(data), 2)
    return int16_to_float(np.frombuffer(linear, dtype=np.int16))
