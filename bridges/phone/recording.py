"""A call's stereo recording as the caller heard it: the caller left, the agent right, 16-bit WAV.

The file's rate is the line's: 8 kHz for a narrowband call, 16 kHz when either direction is
wideband (a channel that comes at the other rate is resampled to it). Both channels are on the
caller's timeline. Sample 0 is the caller's first payload and each later payload follows the
one before, a payload the carrier numbered but never sent leaving its length of silence. Each
agent payload sits where the carrier starts playing it (the pacer's model of the carrier's
buffer, playback_buffer.PlaybackClock), so a late frame is heard, and recorded, as a gap.

Written incrementally: about once a second everything older than a short margin (caller audio
may still fill it) goes to the file and the WAV header's two sizes are rewritten, so a server
killed mid-call leaves a file that plays up to its last second or so.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from personaplex_voice.audio.mulaw import float_to_int16
from personaplex_voice.audio.resample import BlockResampler

CHANNELS = 2
FLUSH_EVERY_S = 1.0
_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")


def _wav_header(data_bytes: int, rate: int) -> bytes:
    block = CHANNELS * 2
    return _HEADER.pack(
        b"RIFF", 36 + data_bytes, b"WAVE", b"fmt ", 16, 1, CHANNELS, rate, rate * block, block, 16,
        b"data", data_bytes,
    )  # fmt: skip


class _Channel:
    """One channel's samples from the file's end on (int16, silence where nothing came yet), in a
    buffer that grows by doubling (a payload lands every 20 ms; no copy of the whole each time)."""

    def __init__(self, line_rate: int, rate: int):
        self.resampler = BlockResampler(line_rate, rate) if line_rate != rate else None
        self._buf = np.zeros(rate, np.int16)
        self.length = 0  # samples held (the rest of `_buf` is silence, ready to be written into)

    def samples(self, pcm: np.ndarray) -> np.ndarray:
        if self.resampler is not None:
            pcm = self.resampler.process(pcm)
        return float_to_int16(pcm)

    def _reserve(self, n: int) -> None:
        if n > len(self._buf):
            grown = np.zeros(max(n, 2 * len(self._buf)), np.int16)
            grown[: self.length] = self._buf[: self.length]
            self._buf = grown

    def put(self, rel: int, data: np.ndarray) -> None:
        end = rel + len(data)
        self._reserve(end)
        self._buf[rel:end] = data
        self.length = max(self.length, end)

    def take(self, n: int) -> np.ndarray:
        self._reserve(n)
        out = self._buf[:n].copy()
        rest = max(0, self.length - n)
        self._buf[:rest] = self._buf[n : n + rest]
        self._buf[rest : max(self.length, n)] = 0
        self.length = rest
        return out


class CallRecording:
    def __init__(
        self, path: Path, rate: int = 8000, caller_rate: int | None = None, agent_rate: int | None = None
    ):
        self.path = path
        self.rate = rate
        self.margin = rate // 4  # audio this recent may still change (a late caller payload, the agent ahead)
        self.max_ahead = 10 * rate  # agent audio further ahead of the caller's than this is not kept
        self._file: BinaryIO | None = path.open("wb")
        self._file.write(_wav_header(0, rate))
        self._file.flush()
        self.samples = 0  # frames (sample pairs) in the file
        self._left = _Channel(caller_rate or rate, rate)
        self._right = _Channel(agent_rate or rate, rate)
        self._t0: float | None = None  # monotonic time of the caller's first payload
        self._last_chunk: int | None = None
        self._rebase = False  # a new stream: place its first payload at the wall clock
        self._caller_end = 0  # absolute position after the caller's latest payload
        self._last_flush = 0.0
        self.dropped_samples = 0  # audio that came for a stretch already written

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def position(self, monotonic: float) -> int:
        """The timeline position (samples) of a monotonic time."""
        return 0 if self._t0 is None else round((monotonic - self._t0) * self.rate)

    def new_stream(self) -> None:
        """The call continues on a new stream (its chunk numbers start again)."""
        self._rebase = self._t0 is not None

    def caller(self, pcm: np.ndarray, chunk: int | None, now: float) -> None:
        """One caller payload (float32 at the caller's line rate)."""
        data = self._left.samples(pcm)
        pos = self._caller_end
        if self._t0 is None:
            self._t0, self._last_flush = now, now
        elif self._rebase:
            self._rebase = False
            pos = max(self._caller_end, self.position(now))
        elif chunk is not None and self._last_chunk is not None and chunk > self._last_chunk + 1:
            pos += (chunk - self._last_chunk - 1) * len(data)  # the missing payloads: silence
        if chunk is not None:
            self._last_chunk = chunk
        self._put(self._left, pos, data)
        self._caller_end = max(self._caller_end, pos + len(data))
        if now - self._last_flush >= FLUSH_EVERY_S:
            self._last_flush = now
            self.flush(self._caller_end - self.margin)

    def agent(self, pcm: np.ndarray, plays_at: float) -> None:
        """One agent payload (float32 at the agent's line rate) the carrier plays at `plays_at`."""
        data = self._right.samples(pcm)
        if self._t0 is None:
            return  # the agent speaks only once the caller's audio flows
        pos = self.position(plays_at)
        if pos - self._caller_end > self.max_ahead:
            self.dropped_samples += len(data)
            return
        self._put(self._right, pos, data)

    def _put(self, channel: _Channel, pos: int, data: np.ndarray) -> None:
        rel = pos - self.samples
        if rel < 0:
            self.dropped_samples += min(len(data), -rel)
            data, rel = data[-rel:], 0
        if len(data):
            channel.put(rel, data)

    def flush(self, upto: int) -> None:
        """Write everything before timeline position `upto` and rewrite the header."""
        n = upto - self.samples
        if n <= 0 or self._file is None:
            return
        frames = np.empty((n, CHANNELS), np.int16)
        frames[:, 0] = self._left.take(n)
        frames[:, 1] = self._right.take(n)
        self._file.write(frames.astype("<i2", copy=False).tobytes())
        self.samples += n
        data_bytes = self.samples * CHANNELS * 2
        self._file.seek(4)
        self._file.write(struct.pack("<I", 36 + data_bytes))
        self._file.seek(40)
        self._file.write(struct.pack("<I", data_bytes))
        self._file.seek(0, 2)
        self._file.flush()  # to the OS: a killed process loses nothing written here

    def close(self, now: float) -> float:
        """Write the rest and close. The agent channel ends at `now` (what the carrier still held
        of ours was cleared, never heard). Returns the recording's length in seconds."""
        if self._file is None:
            return self.samples / self.rate
        heard_until = self.position(now) if self._t0 is not None else 0
        right_end = self.samples + self._right.length
        self.flush(max(self._caller_end, min(right_end, heard_until)))
        self._file.close()
        self._file = None
        return self.samples / self.rate
