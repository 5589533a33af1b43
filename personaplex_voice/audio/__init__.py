"""Transport audio, pure numpy DSP (no torch, no sockets): G.711 μ-law, a low-delay streaming
resampler, the Ogg-Opus stream codec, re-framing helpers and file I/O."""

from .framing import ChunkBuffer, FrameBuffer
from .mulaw import ulaw_decode, ulaw_encode
from .opus import OggError, OggOpusReader, OggOpusWriter
from .resample import StreamingResampler, resample

__all__ = [
    "ChunkBuffer",
    "FrameBuffer",
    "OggError",
    "OggOpusReader",
    "OggOpusWriter",
    "StreamingResampler",
    "resample",
    "ulaw_decode",
    "ulaw_encode",
]
