"""The run's progress on stderr: calls done, seconds of call audio simulated, and how many times
faster than real time that is (a bar on a terminal, one line per call done otherwise)."""

from __future__ import annotations

import sys
import time
from typing import TextIO

from .call import FRAME_S


class Progress:
    def __init__(self, total_calls: int, *, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.total = total_calls
        self.calls = 0
        self.frames = 0
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self._started = time.perf_counter()
        self._bar = None
        self._drawn = 0.0
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total_calls, unit="call", desc="eval", file=self.stream, mininterval=0.3)

    @property
    def audio_s(self) -> float:
        return self.frames * FRAME_S

    @property
    def x_realtime(self) -> float:
        wall = time.perf_counter() - self._started
        return self.audio_s / wall if wall > 0 else 0.0

    def _postfix(self) -> str:
        return f"{self.audio_s:.1f} s audio, {self.x_realtime:.1f}x real time"

    def frame(self) -> None:
        self.frames += 1
        if self._bar is not None:
            now = time.perf_counter()
            if now - self._drawn > 0.3:
                self._drawn = now
                self._bar.set_postfix_str(self._postfix(), refresh=True)

    def call_done(self, call_id: str, error: str | None = None) -> None:
        self.calls += 1
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(1)
        elif self.enabled:
            how = f"failed: {error}" if error else "done"
            print(
                f"eval: call {self.calls}/{self.total} {call_id} {how} ({self._postfix()})", file=self.stream
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
