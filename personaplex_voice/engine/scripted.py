"""`ScriptedEngine`: an agent with simple, known turn-taking, for tests and dry runs of `eval`.

Each slot listens to its caller with a streaming voice-activity detector (silero-vad, from the
`silero-vad` package of the `eval` extra) and behaves like a polite full-duplex agent whose
timing is set by two numbers:
- `respond_after_ms` after its detector says the caller's speech ended, it starts saying its
  reply: a clip of agent speech, with the reply's words as text pieces spread over the clip as
  the real model's text runs alongside its audio;
- when its detector hears the caller start while it speaks (a barge-in), it stops
  `stop_after_ms` after the speech started.
Nothing happens before the detector has decided (a window of 32 ms at the start, `HANG_S` of
quiet at the end), so the agent is as late as its ears, like a real one. The detector is
silero's, with its own settings, and not `eval`'s rule for boundaries: the tests that check
`eval`'s measures compare them with the audio's known timing, never with this agent's intent.
Replies are used in turn, one per answer. With `greet`, a slot whose caller is still silent
`greet_after_ms` into the call says its first reply, as an agent answering the phone.

Built on the `LoopbackEngine`'s slot bookkeeping (voices, prefill, snapshots), so it is a
complete engine for the SessionManager.
"""

from __future__ import annotations

import copy
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from personaplex_voice.audio.resample import StreamingResampler
from personaplex_voice.engine.base import FRAME_SIZE, SAMPLE_RATE, Persona, StepOutput
from personaplex_voice.engine.loopback import LoopbackEngine

VAD_RATE = 16_000
WINDOW = 512  # silero's window at 16 kHz: 32 ms
SPAN = WINDOW * SAMPLE_RATE // VAD_RATE  # the same window in engine samples
ON, OFF = 0.5, 0.35  # speech starts at a window >= ON and ends after HANG_S of windows < OFF
HANG_S = 0.1


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


@dataclass(frozen=True)
class _Heard:
    """The detector's news: the caller's speech started or ended `at` (engine samples since the
    slot started), decided at `known`."""

    kind: str  # "start" or "end"
    at: int
    known: int


class _CallerEars:
    """silero-vad on one slot's input, streaming: 24 kHz frames in, start/end news out."""

    def __init__(self, model) -> None:
        self._model = model
        self._model.reset_states()
        self._resampler = StreamingResampler(SAMPLE_RATE, VAD_RATE)
        self._pending = np.zeros(0, np.float32)
        self._windows = 0
        self._speaking = False
        self._quiet_from: int | None = None
        self._hang = max(1, round(HANG_S * VAD_RATE / WINDOW))

    def hear(self, pcm: np.ndarray) -> list[_Heard]:
        import torch

        self._pending = np.concatenate([self._pending, self._resampler.process(pcm)])
        news: list[_Heard] = []
        with torch.inference_mode():
            while len(self._pending) >= WINDOW:
                chunk = torch.from_numpy(np.ascontiguousarray(self._pending[:WINDOW]))
                self._pending = self._pending[WINDOW:]
                p = float(self._model(chunk.unsqueeze(0), VAD_RATE).reshape(-1)[0])
                w = self._windows
                self._windows += 1
                if not self._speaking:
                    if p >= ON:
                        self._speaking, self._quiet_from = True, None
                        news.append(_Heard("start", w * SPAN, (w + 1) * SPAN))
                    continue
                if p >= OFF:
                    self._quiet_from = None
                    continue
                if self._quiet_from is None:
                    self._quiet_from = w
                if w - self._quiet_from + 1 >= self._hang:
                    self._speaking = False
                    news.append(_Heard("end", self._quiet_from * SPAN, (w + 1) * SPAN))
                    self._quiet_from = None
        return news


_models_lock = threading.Lock()


def _load_vad():
    """A silero-vad model (copy it per stream: it keeps its state). Importing silero_vad sets
    torch to one thread for the whole process; the setting is put back."""
    import torch

    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
    except ImportError as exc:
        raise RuntimeError(
            f"the scripted agent listens with silero-vad: pip install silero-vad ({exc})"
        ) from None
    with _models_lock, warnings.catch_warnings():  # the package's own deprecated loaders
        warnings.simplefilter("ignore", DeprecationWarning)
        model = load_silero_vad()
    torch.set_num_threads(threads)
    return model


@dataclass
class _SlotTurns:
    """One slot's conversation; times are engine samples since the slot started."""

    now: int = 0  # samples output so far
    caller_speaking: bool = False
    unanswered_end: int | None = None  # the caller's latest speech ended here and is not answered
    reply_at: int | None = None  # a reply starts here
    speaking: bool = False
    reply: int = 0  # index of the reply being said (or next)
    clip_pos: int = 0
    stop_at: int | None = None  # set by a barge-in
    answers: int = 0
    greeting: bool = False
    words: list[tuple[int, str]] = field(default_factory=list)
    ears: _CallerEars | None = None


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
        greet_after_ms: float = 400.0,
        prefill_s: float = 0.0,
        name: str = "scripted",
    ):
        super().__init__(num_slots=num_slots, delay_frames=0, prefill_s=prefill_s, name=name)
        if not replies or any(len(r.pcm) == 0 or not r.text.split() for r in replies):
            raise ValueError("ScriptedEngine needs replies, each with words and audio")
        if respond_after_ms < 0 or stop_after_ms < 0 or greet_after_ms < 0:
            raise ValueError("respond_after_ms, stop_after_ms and greet_after_ms must be >= 0")
        self.replies = [Reply(r.text, np.asarray(r.pcm, np.float32)) for r in replies]
        self._offsets = [r.word_offsets() for r in self.replies]
        self.respond_after = round(respond_after_ms * SAMPLE_RATE / 1000)
        self.stop_after = round(stop_after_ms * SAMPLE_RATE / 1000)
        self.greet = greet
        self.greet_after = round(greet_after_ms * SAMPLE_RATE / 1000)
        model = _load_vad()
        self._models = [copy.deepcopy(model) for _ in range(num_slots)]  # one per slot: each keeps its state
        self._turns = [_SlotTurns() for _ in range(num_slots)]

    def _reset(self, slot: int, persona: Persona) -> None:
        super()._reset(slot, persona)
        turns = _SlotTurns(ears=_CallerEars(self._models[slot]))
        if self.greet:
            turns.reply_at, turns.greeting = self.greet_after, True
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
        t0 = st.now
        assert st.ears is not None
        news = st.ears.hear(x)
        out = np.zeros(len(x), np.float32)
        pieces: list[str] = []
        for item in news:  # in the order the detector decided them
            self._play(st, min(max(item.known, st.now), t0 + len(x)), t0, out, pieces)
            self._take(st, item)
        self._play(st, t0 + len(x), t0, out, pieces)
        return out, ("".join(pieces) or None)

    def _take(self, st: _SlotTurns, item: _Heard) -> None:
        if item.kind == "start":
            st.caller_speaking = True
            if st.speaking and st.stop_at is None:
                st.stop_at = max(st.now, item.at + self.stop_after)
            if not st.speaking:
                st.reply_at = None  # the caller spoke first: no greeting, no reply into its speech
                st.greeting = False
            return
        st.caller_speaking = False
        st.unanswered_end = item.at
        if not st.speaking:
            st.reply_at = max(st.now, item.at + self.respond_after)

    def _play(self, st: _SlotTurns, until: int, t0: int, out: np.ndarray, pieces: list[str]) -> None:
        """The agent's audio from `st.now` to `until` (engine samples since the slot started)."""
        while st.now < until:
            if st.speaking:
                self._speak(st, until, t0, out, pieces)
            elif st.reply_at is not None and st.reply_at < until:
                st.now = max(st.now, st.reply_at)
                st.reply_at = None
                if st.greeting:
                    st.greeting = False
                else:
                    st.unanswered_end = None
                st.speaking, st.clip_pos, st.stop_at = True, 0, None
                st.words = list(self._offsets[st.reply])
            else:
                st.now = until

    def _speak(self, st: _SlotTurns, until: int, t0: int, out: np.ndarray, pieces: list[str]) -> None:
        clip = self.replies[st.reply].pcm
        end = min(until, st.now + len(clip) - st.clip_pos)
        if st.stop_at is not None:
            end = max(st.now, min(end, st.stop_at))
        take = end - st.now
        out[st.now - t0 : end - t0] = clip[st.clip_pos : st.clip_pos + take]
        while st.words and st.words[0][0] < st.clip_pos + take:
            pieces.append(st.words.pop(0)[1])
        st.clip_pos += take
        st.now = end
        if st.clip_pos >= len(clip) or (st.stop_at is not None and st.now >= st.stop_at):
            st.speaking, st.stop_at, st.words = False, None, []
            st.answers += 1
            st.reply = st.answers % len(self.replies)
            if st.unanswered_end is not None and not st.caller_speaking:  # the barge-in ended first
                st.reply_at = max(st.now, st.unanswered_end + self.respond_after)
