"""Re-chunking: arbitrary pushes in, fixed-size pieces out.

``FrameBuffer`` turns audio arriving in any chunk size into the engine's exact 1920-sample frames
(or any other size); ``ChunkBuffer`` does the same for bytes, e.g. 160-byte μ-law chunks (20 ms at
8 kHz), the size Twilio plays smoothly.
"""

from __future__ import annotations

import numpy as np

__all__ = ["ChunkBuffer", "FrameBuffer"]


class FrameBuffer:
    """FIFO of float32 samples that hands them out in frames of exactly ``frame_size``.

    With ``max_samples`` it is bounded: a push beyond the bound drops the oldest samples (the
    newest audio is what a live call needs) and returns how many it dropped.
    """

    def __init__(self, frame_size: int, max_samples: int | None = None) -> None:
        if frame_size <= 0:
            raise ValueError(f"frame_size must be positive, got {frame_size}")
        if max_samples is not None and max_samples < 0:
            raise ValueError(f"max_samples must be >= 0, got {max_samples}")
        self.frame_size = frame_size
        self.max_samples = max_samples
        self._data = np.zeros(4 * frame_size, dtype=np.float32)
        self._start = 0  # first waiting sample in _data
        self._end = 0  # one past the last waiting sample

    def __len__(self) -> int:
        """Samples waiting (including a partial frame)."""
        return self._end - self._start

    def push(self, x: np.ndarray) -> int:
        """Append (a copy of) ``x``; returns the oldest samples dropped to stay within ``max_samples``."""
        x = np.asarray(x, dtype=np.float32).reshape(-1)
        dropped = 0
        if self.max_samples is not None:
            dropped = max(0, len(self) + len(x) - self.max_samples)
            if dropped:
                from_waiting = min(dropped, len(self))
                self.drop_oldest(from_waiting)
                x = x[dropped - from_waiting :]  # the push alone is over the bound: keep its tail
        if self._end + len(x) > len(self._data):
            waiting = self._data[self._start : self._end]
            capacity = max(len(self._data), 2 * (len(waiting) + len(x)))
            data = np.empty(capacity, dtype=np.float32) if capacity > len(self._data) else self._data
            data[: len(waiting)] = waiting  # compacting in place is safe: the copy moves left
            self._data, self._start, self._end = data, 0, len(waiting)
        self._data[self._end : self._end + len(x)] = x
        self._end += len(x)
        return dropped

    def pop(self) -> np.ndarray | None:
        """The next full frame (a fresh array), or None while fewer than ``frame_size`` samples wait."""
        if len(self) < self.frame_size:
            return None
        frame = self._data[self._start : self._start + self.frame_size].copy()
        self._start += self.frame_size
        if self._start == self._end:
            self._start = self._end = 0
        return frame

    def pop_all(self) -> list[np.ndarray]:
        """Every full frame waiting; a partial frame stays."""
        frames = []
        while (frame := self.pop()) is not None:
            frames.append(frame)
        return frames

    def pop_padded(self) -> np.ndarray | None:
        """The partial frame waiting, padded with zeros to a full frame (end of stream); None if empty."""
        if len(self) == 0:
            return None
        frame = np.zeros(self.frame_size, dtype=np.float32)
        n = min(len(self), self.frame_size)
        frame[:n] = self._data[self._start : self._start + n]
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return frame

    def drop_oldest(self, n: int) -> int:
        """Discard up to ``n`` of the oldest samples; returns how many went."""
        n = max(0, min(n, len(self)))
        self._start += n
        if self._start == self._end:
            self._start = self._end = 0
        return n

    def clear(self) -> None:
        self._start = self._end = 0


class ChunkBuffer:
    """FIFO of bytes handed out in chunks of exactly ``chunk_size`` (default: 160 μ-law bytes)."""

    def __init__(self, chunk_size: int = 160) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.chunk_size = chunk_size
        self._data = bytearray()

    def __len__(self) -> int:
        return len(self._data)

    def push(self, data: bytes) -> None:
        self._data += data

    def pop(self) -> bytes | None:
        if len(self._data) < self.chunk_size:
            return None
        chunk = bytes(self._data[: self.chunk_size])
        del self._data[: self.chunk_size]
        return chunk

    def pop_all(self) -> list[bytes]:
        n = len(self._data) // self.chunk_size * self.chunk_size
        body, self._data = bytes(self._data[:n]), self._data[n:]
        return [body[i : i + self.chunk_size] for i in range(0, n, self.chunk_size)]

    def pop_padded(self, fill: int = 0xFF) -> bytes | None:
        """The partial chunk waiting, padded with ``fill`` (μ-law silence by default); None if empty."""
        if not self._data:
            return None
        chunk = bytes(self._data[: self.chunk_size])
        del self._data[: len(chunk)]
        return chunk + bytes([fill]) * (self.chunk_size - len(chunk))

    def clear(self) -> None:
        self._data.clear()
