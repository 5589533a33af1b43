"""The caller of one call: plays a scenario's script one 80 ms frame at a time.

Most steps are fixed audio (speech clips, silence, key presses). A barge-in is not: the caller
stays silent until the agent has been speaking for `after_agent_speech_ms`, which the call
measures from what the caller hears and tells `next_frame` each frame. The script logs what it
actually played (when each turn spoke, each pause, each key), which is what the measures and
the transcripts are built from.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE

from .measures import ScriptPause, ScriptTurn
from .speech import ClipBook
from .steps import BargeIn, Dtmf, Pause, Say, Silence, Step, Wav, speech_of, waits_for_answer

KEY_S = 0.2  # one key press on the line (100 ms tone and 100 ms gap, as phones dial)


@dataclass
class ScriptLog:
    """What the caller did, on the call's timeline (seconds)."""

    turns: list[ScriptTurn] = field(default_factory=list)
    pauses: list[ScriptPause] = field(default_factory=list)
    keys: list[tuple[float, str]] = field(default_factory=list)
    missed_barge_ins: list[tuple[str, int]] = field(default_factory=list)  # (turn label, ms)
    barge_cues: list[tuple[int, float, float]] = field(default_factory=list)  # (turn, waited from, cue at)


def _text_of(speech: Say | Wav) -> str:
    return speech.text if isinstance(speech, Say) else speech.path.name


class CallerScript:
    def __init__(self, script: tuple[Step, ...], clips: ClipBook):
        self.script = script
        self.clips = clips
        self.log = ScriptLog()
        self._numbers: list[int] = []  # each step's turn number (speech steps) or the last one before
        number = 0
        for step in script:
            if speech_of(step) is not None:
                number += 1
            self._numbers.append(number)
        self._i = 0  # current step
        self._pos = 0  # samples played of the current step (or of its speech, for a barge-in)
        self._t = 0  # samples played since the call started
        self._step_start = 0  # when the current step began
        self._cued = False  # the current barge-in's cue has come
        self._new_keys: list[tuple[float, str]] = []

    @property
    def finished(self) -> bool:
        return self._i >= len(self.script)

    @property
    def waiting_for_cue(self) -> bool:
        """A barge-in is waiting for the agent to speak: feed the call's SpeechClock."""
        return not self.finished and isinstance(self.script[self._i], BargeIn) and not self._cued

    def take_keys(self) -> list[tuple[float, str]]:
        """Keys pressed in the frames made since the last call: (time, key)."""
        keys, self._new_keys = self._new_keys, []
        return keys

    def next_frame(self, agent_speaking_ms: float = 0.0) -> np.ndarray:
        """The next 80 ms of the caller (silence once the script is over)."""
        out = np.zeros(FRAME_SIZE, np.float32)
        filled = 0
        while filled < FRAME_SIZE and not self.finished:
            filled += self._play(out, filled, agent_speaking_ms)
        self._t += FRAME_SIZE - filled  # past the end: silence
        return out

    def cut(self, at_s: float) -> None:
        """The call ended at `at_s` (an action): what had not been played never was."""
        self.log.turns = [
            ScriptTurn(t.number, t.kind, t.text, t.start, min(t.end, at_s), t.then)
            for t in self.log.turns
            if t.start < at_s
        ]
        self.log.pauses = [
            ScriptPause(p.after_turn, p.start, min(p.end, at_s)) for p in self.log.pauses if p.start < at_s
        ]
        self.log.keys = [k for k in self.log.keys if k[0] <= at_s]  # a key can end the call itself
        self._i = len(self.script)

    # ---- one step ----------------------------------------------------------------------------

    def _play(self, out: np.ndarray, filled: int, agent_speaking_ms: float) -> int:
        """Play from the current step into `out[filled:]`; returns the samples written (>= 1,
        or 0 when the step ended exactly here)."""
        step = self.script[self._i]
        room = FRAME_SIZE - filled
        if isinstance(step, BargeIn) and not self._cued:
            if agent_speaking_ms >= step.after_agent_speech_ms:
                self._cued = True
                self.log.barge_cues.append(
                    (self._numbers[self._i], self._step_start / SAMPLE_RATE, self._t / SAMPLE_RATE)
                )
                self._pos = 0
                return self._play(out, filled, agent_speaking_ms)
            if self._t - self._step_start >= step.max_wait_s * SAMPLE_RATE:
                label = f"turn {self._numbers[self._i]} (barge-in {_text_of(step.speech)!r})"
                self.log.missed_barge_ins.append((label, step.after_agent_speech_ms))
                return self._next(0)
            self._t += room  # waiting: silence to the frame's end (the cue is read once a frame)
            return room
        speech = speech_of(step)
        if speech is not None:
            clip = self.clips.get(speech)
            n = min(room, len(clip) - self._pos)
            out[filled : filled + n] = clip[self._pos : self._pos + n]
            start = self._t - self._pos
            self._pos += n
            self._t += n
            if self._pos >= len(clip):
                self._log_turn(step, speech, start)
                return self._next(n)
            return n
        if isinstance(step, Dtmf):
            total = round(len(step.keys) * KEY_S * SAMPLE_RATE)
            per_key = total // len(step.keys)
            for k in range(len(step.keys)):
                at = k * per_key
                if self._pos <= at < self._pos + room:
                    key = ((self._t + at - self._pos) / SAMPLE_RATE, step.keys[k])
                    self._new_keys.append(key)
                    self.log.keys.append(key)
        else:
            assert isinstance(step, Silence | Pause)
            total = round(step.seconds * SAMPLE_RATE)
        n = min(room, total - self._pos)
        self._pos += n
        self._t += n
        if self._pos >= total:
            if isinstance(step, Pause):
                self.log.pauses.append(
                    ScriptPause(self._numbers[self._i], self._step_start / SAMPLE_RATE, self._t / SAMPLE_RATE)
                )
            return self._next(n)
        return n

    def _log_turn(self, step: Step, speech: Say | Wav, start: int) -> None:
        following = self.script[self._i + 1] if self._i + 1 < len(self.script) else None
        if waits_for_answer(self.script, self._i):
            then = "answer"
        elif isinstance(following, Pause):
            then = "pause"
        else:
            then = "continue"
        kind = "barge_in" if isinstance(step, BargeIn) else ("say" if isinstance(speech, Say) else "wav")
        self.log.turns.append(
            ScriptTurn(
                self._numbers[self._i],
                kind,
                _text_of(speech),
                start / SAMPLE_RATE,
                self._t / SAMPLE_RATE,
                then,
            )
        )

    def _next(self, written: int) -> int:
        self._i += 1
        self._pos = 0
        self._step_start = self._t
        self._cued = False
        return written
