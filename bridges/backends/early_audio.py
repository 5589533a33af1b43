"""`EarlyAudio`: a caller's audio from before its session is ready, kept for it.

A bridge hears the caller from the moment the call starts, but its session needs a moment (the
system prompt, a queue, a reconnect). Dropping that audio loses the caller's first words; the
session keeps it instead (docs/sessions.md: a start burst is absorbed by catch-up steps, never
trimmed), so the bridge holds it meanwhile and hands it over, in order, once the session is
ready. Bounded like a session's own input: past `max_s` the oldest audio goes, counted.
"""

from __future__ import annotations

from collections import deque

import numpy as np

from personaplex_voice.engine.base import SAMPLE_RATE
from personaplex_voice.engine.scheduler.config import DEFAULT_START_BURST_S

# What a session keeps and catches up from before it runs (its start burst, `start_burst_s`: 5 s
# by default), so a slow prompt load or a short queue wait loses none of the caller's words;
# holding more here would only be dropped there.
DEFAULT_MAX_S = DEFAULT_START_BURST_S


class EarlyAudio:
    """24 kHz mono float32 PCM waiting for a session; `dropped_samples` counts what the bound cut."""

    def __init__(self, max_s: float = DEFAULT_MAX_S):
        self.max_samples = max(1, round(max_s * SAMPLE_RATE))
        self._pieces: deque[np.ndarray] = deque()
        self._samples = 0
        self.dropped_samples = 0

    def __len__(self) -> int:
        return self._samples

    def add(self, pcm: np.ndarray) -> None:
        piece = np.array(pcm, dtype=np.float32, copy=True).reshape(-1)  # callers reuse buffers
        if not piece.size:
            return
        self._pieces.append(piece)
        self._samples += piece.size
        excess = self._samples - self.max_samples
        while excess > 0:
            oldest = self._pieces[0]
            if oldest.size <= excess:
                self._pieces.popleft()
                cut = oldest.size
            else:
                self._pieces[0] = oldest[excess:]
                cut = excess
            self._samples -= cut
            self.dropped_samples += cut
            excess -= cut

    def take(self) -> np.ndarray:
        """Everything held, oldest first, as one array (empty when nothing is)."""
        if not self._pieces:
            return np.zeros(0, np.float32)
        out = np.concatenate(list(self._pieces))
        self._pieces.clear()
        self._samples = 0
        return out
