"""`StartBurst`: audio a realtime session holds beyond real time at its start is kept, not trimmed.

A caller's first audio often reaches a session before the session is stepped: pushed while the
system prompt is prefilled or the call waits in the queue, or queued by the client while it
connected and sent all at once after the handshake (LiveKit's published PersonaPlex plugin does
exactly that). The jitter buffer (`scheduler.SpareTrimmer`) would take that backlog for late
input that arrived after all and drop it, a second into the caller's first sentence.

This policy says, after each tick, how many of a session's spare whole frames belong to such a
start burst: those are exempt from trimming, and the scheduler consumes them with extra
*catch-up* steps when the tick budget leaves room, so the call's latency comes back down without
losing a word. The burst is bounded (`limit_frames`, the session's input bound); a client that
keeps sending faster than real time exhausts it and is trimmed as before (counted).

A catch-up step's output comes out faster than real time: it is the agent's side of time that
has already passed. A transport that plays just in time (a phone line) would hold it as lasting
delay, so `worth_delivering` keeps only the frames that carry something (speech, a text piece):
the model's silence from a catch-up step is not delivered.

It is pure bookkeeping (no clock, no lock): the session keeps one per call and calls it from the
inference thread. See docs/sessions.md ("Audio before the session runs").
"""

from __future__ import annotations

import numpy as np

# Agent output quieter than this (RMS, dBFS) is the model's silence: the level the Pipecat
# service and the LiveKit model take as the agent speaking.
SILENCE_DBFS = -45.0
_SILENCE_RMS = 10 ** (SILENCE_DBFS / 20)


class StartBurst:
    """One session's start-burst allowance.

    `limit_frames`: the most whole frames a start burst may hold (what is left of it is the
    *allowance*; each frame a catch-up step takes uses one up). `window_ticks`: the ticks, from
    the session's first, during which a burst may still arrive in full (a client flushes its
    queue right after the handshake, and those messages land over a few ms, around the first
    tick). After the window the allowance only shrinks: to the spare frames actually queued at
    each tick, so later late-and-then-arrived input is the jitter buffer's business again.
    """

    def __init__(self, limit_frames: int, window_ticks: int):
        self._allowance = max(0, limit_frames)
        self._window = max(0, window_ticks)
        self._ticks = 0
        self.owed = 0  # burst frames queued at the last tick that no catch-up step took yet

    def after_tick(self, spare: int) -> int:
        """A tick took (or missed) the session's frame and `spare` whole frames stay queued:
        how many of them are start burst (exempt from the jitter buffer, owed a catch-up step)."""
        self._ticks += 1
        if self._ticks > self._window:
            self._allowance = min(self._allowance, spare)
        self.owed = min(spare, self._allowance)
        return self.owed

    def take(self) -> bool:
        """A catch-up step wants one frame of the burst: True (and counted) while one is owed."""
        if self.owed <= 0:
            return False
        self.owed -= 1
        self._allowance -= 1
        return True


def worth_delivering(pcm: np.ndarray, text: str | None) -> bool:
    """A catch-up step's output frame carries something: a text piece, or sound above silence."""
    if text:
        return True
    return float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64)))) >= _SILENCE_RMS
