"""When the caller starts talking over the agent: the call's barge-in detector.

PersonaPlex listens while it talks and decides itself whether to stop; what it already said and
we already sent is another matter: the carrier (or our outbox) still holds it, and the caller
would hear the agent go on for that long. So when the caller *starts* talking while some of the
agent's talking is still to be heard, the call drops it (playout.py: `clear`, `FLUSH_MEDIA`,
`killAudio`, or on AudioSocket simply not sending it).

The detector sees the caller's audio message by message (20 ms, at the line's rate, silence
included: carriers send the line all along). A talk spurt starts with `voiced_ms` of messages
at least `threshold_db` loud after at least `quiet_before_ms` of quieter ones. A spurt that
starts while the agent can be heard barges in; after that the next barge-in waits until the
caller has been quiet `rearm_quiet_ms` (a pause between sentences, not between syllables), so
one sentence spoken over the agent clears once. Durations are counted in audio, not in wall-clock
time: the same audio gives the same decisions, however late it arrives.

It runs where the carrier asks for it (`barge_in = True`: Asterisk) or where
PERSONAPLEX_PHONE_BARGE_IN says so for every carrier. Elsewhere the carrier's buffer of ours is
simply kept short (playback_buffer.py): the agent stops for the caller within ~100 ms anyway.
"""

from __future__ import annotations

import math

import numpy as np


class BargeIn:
    def __init__(
        self,
        threshold_db: float = -35.0,
        voiced_ms: float = 40.0,
        quiet_before_ms: float = 40.0,
        rearm_quiet_ms: float = 300.0,
    ):
        self.threshold = 10 ** (threshold_db / 10)  # as a mean square
        self.voiced_s = voiced_ms / 1000
        self.quiet_before_s = quiet_before_ms / 1000
        self.rearm_quiet_s = rearm_quiet_ms / 1000
        self._quiet = math.inf  # seconds of quiet caller audio since the last loud message
        self._loud = 0.0  # seconds of loud audio in a row
        self._talking = False  # inside a talk spurt
        self._armed = True
        self.spurts = 0

    def feed(self, pcm: np.ndarray, seconds: float) -> bool:
        """One caller message (float samples at the line's rate) lasting `seconds`. True when a
        talk spurt starts with it and a barge-in may fire (then call `fired`)."""
        loud = bool(len(pcm)) and float(np.dot(pcm, pcm)) / len(pcm) >= self.threshold
        if not loud:
            self._quiet += seconds
            self._loud = 0.0
            if self._quiet >= self.quiet_before_s:
                self._talking = False
            if self._quiet >= self.rearm_quiet_s:
                self._armed = True
            return False
        self._loud += seconds
        if self._loud < self.voiced_s:
            return False
        self._quiet = 0.0
        if self._talking:
            return False
        self._talking = True
        self.spurts += 1
        return self._armed

    def fired(self) -> None:
        """The call barged in on this spurt: the next one needs a pause between sentences first."""
        self._armed = False
