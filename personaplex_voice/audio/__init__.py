"""Transport audio, pure numpy DSP (no torch, no sockets): G.711 μ-law and A-law, L16 in either
byte order, a low-delay streaming resampler, the Ogg-Opus stream codec (libopus loaded at first
use), re-framing helpers and file I/O."""

from .framing import ChunkBuffer, FrameBuffer
from .mulaw import ulaw_decode, ulaw_encode
from .opus import OggError, OggOpusReader, OggOpusWriter
from .opus_library import OpusUnavailableError, require_opus
from .resample import StreamingResampler
from .telephony import alaw_decode, alaw_encode, l16_decode, l16_encode

# The one-shot `resample` function stays in `audio.resample` (not re-exported here): a package
# attribute named like the submodule would shadow it for `import personaplex_voice.audio.resample`.

__all__ = [
    "ChunkBuffer",
    "FrameBuffer",
    "OggError",
    "OggOpusReader",
    "OggOpusWriter",
    "OpusUnavailableError",
    "StreamingResampler",
    "alaw_decode",
    "alaw_encode",
    "l16_decode",
    "l16_encode",
    "require_opus",
    "ulaw_decode",
    "ulaw_encode",
]
