"""`ScriptedEngine`: an agent with exact, known turn-taking, for tests and dry runs of `eval`.

Each slot listens to its caller and behaves like a polite full-duplex agent whose timing is set
by two numbers:
- `respond_after_ms` after the caller's speech ends (no caller sound for that long), it starts
  saying its reply: a clip of agent speech, with the reply's words as text pieces spread over
  the clip as the real model's text runs alongside its audio;
- when the caller starts speaking while it speaks (a barge-in), it stops `stop_after_ms` later.

Both are exact to the sample (a reply may start and stop mid-frame), which is what lets the
tests check `eval`'s measures against known values. "Caller sound" is any sample at or above
`threshold` in magnitude: this engine is a fixture with a trivial detector on purpose; `eval`
measures with a real voice-activity detector. Replies are used in turn, one per answer.
With `greet`, every slot starts with its first reply, as an agent answering the phone.

Numpy only (no torch), built on the `LoopbackEngine`'s slot bookkeeping (voices, prefill,
snapshots), so it is a complete engine for the SessionManager.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona, StepOutput
from personaplex_voice.engine.loopback import LoopbackEngine


@dataclass(frozen=True)
class Reply:
    """What the agent says once: its words (the text stream) and its audio (24 kHz float32)."""

    text: str
    pcm: np.ndarray

    def word_offsets(self) -> list[tuple[int, str]]:
        """(sample offset into the clip, " word") for each word, spread evenly over the clip."""
        words = self.text.split()
        n = len(self.pcm)
        return [(i * n // len(words), " " + word) for i, word in enumerate(words)]


@dataclass
class _SlotTurns:
    """One slot's conversation state; times are sample counts since the slot started."""

    heard: int = 0  # input samples stepped so far
    last_sound_end: int = -1  # just past the caller's latest loud sample (-1: none yet)
    spoke_until: int = 0  # when the agent last stopped (or finished) speaking
    speaking: bool = False
    reply: int = 0  # index of the reply being said (or said last)
    clip_pos: int = 0
    stop_at: int | None = None  # set by a barge-in
    answers: int = 0
    words: list[tuple[int, str]] = field(default_factory=list)


class ScriptedEngine(LoopbackEngine):
    """See the module docstring. `replies` must hold at least one `Reply` with audio."""

    def __init__(
        self,
        num_slots: int = 4,
        *,
        replies: Sequence[Reply],
        respond_after_ms: float = 400.0,
        stop_after_ms: float = 200.0,
        greet: bool = False,
        threshold: float = 0.01,
        prefill_s: float = 0.0,
        name: str = "scripted",
    ):
        super().__init__(num_slots=num_slots, delay_frames=0, prefill_s=prefill_s, name=name)
        if not replies or any(len(r.pcm) == 0 or not r.text.split() for r in replies):
            raise ValueError("ScriptedEngine needs replies, each with words and audio")
        if respond_after_ms < 0 or stop_after_ms < 0:
            raise ValueError("respond_after_ms and stop_after_ms must be >= 0")
        self.replies = [Reply(r.text, np.asarray(r.pcm, np.float32)) for r in replies]
        self._offsets = [r.word_offsets() for r in self.replies]
        self.respond_after = round(respond_after_ms * SAMPLE_RATE / 1000)
        self.stop_after = round(stop_after_ms * SAMPLE_RATE / 1000)
        self.greet = greet
        self.threshold = threshold
        self._turns = [_SlotTurns() for _ in range(num_slots)]

    def _reset(self, slot: int, persona: Persona) -> None:
        super()._reset(slot, persona)
        turns = _SlotTurns()
        if self.greet:
            turns.speaking = True
            turns.words = list(self._offsets[0])
        self._turns[slot] = turns

    def step(self, pcm: np.ndarray, active: np.ndarray) -> StepOutput:
        pcm, active = self.checked_batch(pcm, active)
        out = np.zeros((self.num_slots, FRAME_SIZE), np.float32)
        text: list[str | None] = [None] * self.num_slots
        for slot in np.flatnonzero(active):
            out[slot], text[slot] = self._run(self._turns[slot], pcm[slot])
        self.steps += 1
        return StepOutput(pcm=out, text=text)

    # ---- one slot, one frame ------------------------------------------------------------------

    def _run(self, st: _SlotTurns, x: np.ndarray) -> tuple[np.ndarray, str | None]:
        t0, n = st.heard, len(x)
        loud = np.flatnonzero(np.abs(x) >= self.threshold)
        out = np.zeros(n, np.float32)
        pieces: list[str] = []
        i = 0
        while i < n:
            if st.speaking:
                i = self._speak(st, t0, i, n, loud, out, pieces)
            else:
                i = self._listen(st, t0, i, n, loud)
        st.heard = t0 + n
        return out, ("".join(pieces) or None)

    def _listen(self, st: _SlotTurns, t0: int, i: int, n: int, loud: np.ndarray) -> int:
        """Silent from frame offset `i`: follow the caller; start the reply when it is due.
        Returns the offset reached (the reply's start, or the frame's end)."""
        ahead = loud[loud >= i]
        pending = st.last_sound_end > st.spoke_until  # caller sound the agent has not answered
        due = st.last_sound_end + self.respond_after - t0 if pending else None
        if due is not None and due < n and (ahead.size == 0 or due <= ahead[0]):
            st.speaking, st.clip_pos, st.stop_at = True, 0, None
            st.words = list(self._offsets[st.reply])
            return max(i, due)
        if ahead.size == 0:
            return n
        # The caller's sound from ahead[0] on: it runs until a gap long enough to answer in.
        gaps = np.flatnonzero(np.diff(ahead) > self.respond_after)
        last = ahead[gaps[0]] if gaps.size else ahead[-1]
        st.last_sound_end = t0 + int(last) + 1
        return int(last) + 1

    def _speak(
        self, st: _SlotTurns, t0: int, i: int, n: int, loud: np.ndarray, out: np.ndarray, pieces: list[str]
    ) -> int:
        """Speaking from frame offset `i`: play the clip until it ends or a barge-in stops it.
        Returns the offset reached."""
        clip = self.replies[st.reply].pcm
        if st.stop_at is None:
            barge = loud[loud >= i]
            if barge.size:
                st.stop_at = t0 + int(barge[0]) + self.stop_after
        end = min(n, i + len(clip) - st.clip_pos)
        if st.stop_at is not None:
            end = max(i, min(end, st.stop_at - t0))
        take = end - i
        out[i:end] = clip[st.clip_pos : st.clip_pos + take]
        while st.words and st.words[0][0] < st.clip_pos + take:
            pieces.append(st.words.pop(0)[1])
        st.clip_pos += take
        heard = loud[(loud >= i) & (loud < end)]
        if heard.size:
            st.last_sound_end = t0 + int(heard[-1]) + 1
        finished = st.clip_pos >= len(clip)
        stopped = st.stop_at is not None and t0 + end >= st.stop_at
        if finished or stopped:
            st.speaking = False
            st.spoke_until = t0 + end
            st.words = []
            st.answers += 1
            st.reply = st.answers % len(self.replies)
            if stopped:  # the caller's sound that stopped it is still to be answered
                st.spoke_until = min(st.spoke_until, st.stop_at - self.stop_after)
        return end
