"""Pacing of the agent's utterances into Pipecat (no Pipecat needed): cutting and playout gating.

A full-duplex model produces one 80 ms frame of agent audio every 80 ms for the whole call,
silence included. Pipecat thinks in *utterances* (TTSStartedFrame ... TTSStoppedFrame, bot
started/stopped speaking), so `UtteranceTracker` cuts the continuous stream into them, and
`PlayoutGate` keeps the output transport from queueing more than one frame ahead of playback.
(When the caller talks is silero-vad's business: personaplex_backends.CallerSpeech.)
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum

import numpy as np

SILENCE_DB = -120.0


def level_db(pcm: np.ndarray) -> float:
    """RMS level of float32 PCM in dBFS (full scale = 1.0); SILENCE_DB for empty or digital silence."""
    if pcm.size == 0:
        return SILENCE_DB
    rms = float(np.sqrt(np.mean(np.square(pcm, dtype=np.float64))))
    return max(SILENCE_DB, 20.0 * math.log10(rms)) if rms > 0 else SILENCE_DB


class Edge(Enum):
    """What a frame did to the utterance state."""

    NONE = "none"  # outside an utterance, still outside (the frame is not played)
    STARTED = "started"  # this frame opens an utterance
    CONTINUED = "continued"  # inside an utterance
    ENDED = "ended"  # this frame is the last of the utterance (the hangover ran out)


@dataclass
class UtteranceTracker:
    """Cuts the agent's continuous output into utterances.

    An utterance starts at the first frame that is *active*: its level is at least `threshold_db`
    or it carries a text piece. It ends after `hangover_frames` frames in a row that are not
    active; those quiet frames still belong to it, so a short pause between words stays inside
    one utterance and the tail of the last word is not cut.
    """

    threshold_db: float = -45.0
    hangover_frames: int = 6  # 480 ms at 80 ms per frame

    def __post_init__(self) -> None:
        if self.hangover_frames < 1:
            raise ValueError(f"hangover_frames must be >= 1, got {self.hangover_frames}")
        self.speaking = False
        self._quiet_run = 0

    def update(self, pcm: np.ndarray | None, text: str | None = None) -> Edge:
        """Account for one 80 ms frame (`pcm`, with the text piece it carried), or for a text
        piece that arrived on its own (`pcm` None: it keeps the utterance open, counts no time)."""
        active = bool(text) or (pcm is not None and level_db(pcm) >= self.threshold_db)
        if not self.speaking:
            if not active:
                return Edge.NONE
            self.speaking = True
            self._quiet_run = 0
            return Edge.STARTED
        if active:
            self._quiet_run = 0
            return Edge.CONTINUED
        if pcm is None:
            return Edge.CONTINUED
        self._quiet_run += 1
        if self._quiet_run >= self.hangover_frames:
            self.reset()
            return Edge.ENDED
        return Edge.CONTINUED

    def reset(self) -> None:
        """Forget the current utterance (after an interruption, or when a session ends)."""
        self.speaking = False
        self._quiet_run = 0


class PlayoutGate:
    """Keeps at most `max_ahead_s` of pushed audio waiting downstream of the service.

    Pipecat's output transports play audio in real time against the monotonic clock. The gate
    models that playout: audio pushed at time t plays from max(t, end of the audio before it).
    A frame is let through only while the audio still waiting to play is at most `max_ahead_s`
    (one 80 ms frame by default), so a burst from the backend (network jitter, a stalled event
    loop) is dropped instead of sitting in the transport's queue, where it would delay every
    later frame and play stale speech after the model has already stopped for a barge-in.
    `max_ahead_s=None` disables the gate (offline pipelines that do not play in real time).
    """

    def __init__(self, max_ahead_s: float | None, clock: Callable[[], float] = time.monotonic):
        self.max_ahead_s = max_ahead_s
        self._clock = clock
        self._playout_end = 0.0
        self.dropped = 0

    def backlog_s(self) -> float:
        """Seconds of pushed audio that have not played yet (by the model of real-time playout)."""
        return max(0.0, self._playout_end - self._clock())

    def admit(self, duration_s: float) -> bool:
        """Whether a frame of `duration_s` may be pushed now; if so, it is counted as pushed."""
        now = self._clock()
        if self.max_ahead_s is not None and self._playout_end - now > self.max_ahead_s + 1e-3:
            self.dropped += 1
            return False
        self._playout_end = max(self._playout_end, now) + duration_s
        return True

    def reset(self) -> None:
        """Downstream dropped its queue (an interruption): nothing is waiting any more."""
        self._playout_end = 0.0
