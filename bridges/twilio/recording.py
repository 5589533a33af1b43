"""A call's stereo recording as the caller heard it: the caller left, the agent right, 8 kHz WAV.

Both channels are on the caller's timeline. Sample 0 is the caller's first `media` payload and
each later payload sits at its chunk number (Twilio numbers them; a missing one is silence).
Each agent payload sits where Twilio starts playing it (the pacer's model of Twilio's buffer,
playback_buffer.PlaybackClock), so a late frame is heard, and recorded, as a gap. 8 kHz is what
the phone line carries both ways; nothing is lost by not resampling.

Written incrementally: about once a second everything older than a short margin (caller audio
may still fill it) goes to the file and the WAV header's two sizes are rewritten, so a server
killed mid-call leaves a file that plays up to its last second or so.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

from personaplex_voice.audio.mulaw import ULAW_SILENCE, float_to_int16, ulaw_decode

RATE = 8000
CHUNK = 160  # samples of one 20 ms payload
CHANNELS = 2
FLUSH_EVERY_S = 1.0
MARGIN = RATE // 4  # audio this recent may still change (a late caller payload, the agent ahead)
MAX_AHEAD = 10 * RATE  # agent audio further ahead of the caller's than this is not kept
_HEADER = struct.Struct("<4sI4s4sIHHIIHH4sI")


def _wav_header(data_bytes: int) -> bytes:
    block = CHANNELS * 2
    return _HEADER.pack(
        b"RIFF", 36 + data_bytes, b"WAVE", b"fmt ", 16, 1, CHANNELS, RATE, RATE * block, block, 16,
        b"data", data_bytes,
    )  # fmt: skip


class CallRecording:
    def __init__(self, path: Path):
        self.path = path
        self._file: BinaryIO | None = path.open("wb")
        self._file.write(_wav_header(0))
        self._file.flush()
        self.samples = 0  # frames (sample pairs) in the file
        # μ-law bytes from `samples` on, not yet written (silence where nothing came yet)
        self._left = bytearray()
        self._right = bytearray()
        self._t0: float | None = None  # monotonic time of the caller's first payload
        self._chunk0 = 1
        self._base = 0  # timeline position of the current stream's first payload
        self._rebase = False  # a new stream: place its first payload at the wall clock
        self._caller_end = 0  # absolute position after the caller's latest payload
        self._last_flush = 0.0
        self.dropped_samples = 0  # audio that came for a stretch already written

    @property
    def started(self) -> bool:
        return self._t0 is not None

    def position(self, monotonic: float) -> int:
        """The timeline position (samples) of a monotonic time."""
        return 0 if self._t0 is None else round((monotonic - self._t0) * RATE)

    def new_stream(self) -> None:
        """The call continues on a new stream (its chunk numbers start again)."""
        self._rebase = self._t0 is not None

    def caller(self, ulaw: bytes, chunk: int | None, now: float) -> None:
        if self._t0 is None:
            self._t0, self._chunk0, self._last_flush = now, chunk or 1, now
        elif self._rebase:
            self._rebase = False
            self._base, self._chunk0 = max(self._caller_end, self.position(now)), chunk or 1
        pos = self._base + (chunk - self._chunk0) * CHUNK if chunk is not None else self._caller_end
        self._put(self._left, pos, ulaw)
        self._caller_end = max(self._caller_end, pos + len(ulaw))
        if now - self._last_flush >= FLUSH_EVERY_S:
            self._last_flush = now
            self.flush(self._caller_end - MARGIN)

    def agent(self, ulaw: bytes, plays_at: float) -> None:
        if self._t0 is None:
            return  # the agent speaks only once the caller's audio flows
        pos = self.position(plays_at)
        if pos - self._caller_end > MAX_AHEAD:
            self.dropped_samples += len(ulaw)
            return
        self._put(self._right, pos, ulaw)

    def _put(self, buf: bytearray, pos: int, data: bytes) -> None:
        rel = pos - self.samples
        if rel < 0:
            self.dropped_samples += min(len(data), -rel)
            data, rel = data[-rel:], 0
        if not data:
            return
        if len(buf) < rel:
            buf.extend(bytes([ULAW_SILENCE]) * (rel - len(buf)))
        buf[rel : rel + len(data)] = data

    def flush(self, upto: int) -> None:
        """Write everything before timeline position `upto` and rewrite the header."""
        n = upto - self.samples
        if n <= 0 or self._file is None:
            return
        for buf in (self._left, self._right):
            if len(buf) < n:
                buf.extend(bytes([ULAW_SILENCE]) * (n - len(buf)))
        frames = np.empty((n, CHANNELS), np.int16)
        frames[:, 0] = float_to_int16(ulaw_decode(bytes(self._left[:n])))
        frames[:, 1] = float_to_int16(ulaw_decode(bytes(self._right[:n])))
        del self._left[:n], self._right[:n]
        self._file.write(frames.tobytes())
        self.samples += n
        data_bytes = self.samples * CHANNELS * 2
        self._file.seek(4)
        self._file.write(struct.pack("<I", 36 + data_bytes))
        self._file.seek(40)
        self._file.write(struct.pack("<I", data_bytes))
        self._file.seek(0, 2)
        self._file.flush()  # to the OS: a killed process loses nothing written here

    def close(self, now: float) -> float:
        """Write the rest and close. The agent channel ends at `now` (what Twilio still held of
        ours was cleared, never heard). Returns the recording's length in seconds."""
        if self._file is None:
            return self.samples / RATE
        heard_until = self.position(now) if self._t0 is not None else 0
        right_end = self.samples + len(self._right)
        self.flush(max(self._caller_end, min(right_end, heard_until)))
        self._file.close()
        self._file = None
        return self.samples / RATE
