"""Words heard: an offline speech recogniser on the agent's audio, so `agent_says`, the word
counts and Full-Duplex-Bench's measures judge what a caller would hear, not what the model meant.

The recogniser is pocketsphinx (PyPI `pocketsphinx`, in the `eval` extra): its US English
acoustic model, language model and dictionary ship inside the wheel, so it runs offline with
nothing to download. It is a small, old recogniser: it mishears words a large one would get
(more so on synthetic voices), which is why the model's own text stays beside it as a second,
labelled column and the report shows where the two disagree (docs/eval.md, *Words*).

Only the agent's speech is decoded (its VAD segments, padded by `PAD_S` and merged), each piece as
one utterance: silence costs nothing and each piece's cepstral normalisation sees its own speech.
Word times come from the decoder's 10 ms frames, shifted to the call's timeline.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .measures import Word
from .vad import Segment

RATE = 16_000
FRAMES_PER_S = 100  # pocketsphinx's default frame rate
PAD_S = 0.25  # decoded around each speech segment: the recogniser wants a little silence
_NOT_WORDS = re.compile(r"^(<s>|</s>|<sil>|\[.*\]|\+\+.*\+\+|<unk>)$", re.IGNORECASE)
_ALTERNATE = re.compile(r"\(\d+\)$")  # cmudict's pronunciation variants: "the(2)"


class RecognizerMissing(RuntimeError):
    pass


@dataclass
class Recognizer:
    """One pocketsphinx decoder, used by one thread at a time (the lock), built on first use.
    `seconds` and `audio_s` add up the decoding time and the audio decoded (for benchmarks)."""

    seconds: float = 0.0
    audio_s: float = 0.0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._decoder = None

    def _decoder_or_load(self):
        if self._decoder is None:
            try:
                from pocketsphinx import Decoder
            except ImportError as exc:
                raise RecognizerMissing(
                    f"eval hears the agent with pocketsphinx: pip install 'personaplex-voice[eval]' ({exc}); "
                    "or run with --words text to judge the model's own text instead"
                ) from None
            self._decoder = Decoder(samprate=RATE, loglevel="FATAL")
        return self._decoder

    def words(self, signal: np.ndarray, spans: Sequence[Segment] | None = None) -> list[Word]:
        """The words heard in `signal` (16 kHz mono float), inside `spans` (seconds; None: all
        of it), in time order, on the signal's timeline."""
        duration = len(signal) / RATE
        if spans is None:
            pieces = [(0.0, duration)] if len(signal) else []
        else:
            pieces = _padded(spans, duration)
        out: list[Word] = []
        with self._lock:
            decoder = self._decoder_or_load()
            started = time.perf_counter()
            for lo, hi in pieces:
                chunk = signal[round(lo * RATE) : round(hi * RATE)]
                if len(chunk) < RATE // 10:
                    continue
                pcm = (np.clip(chunk, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
                decoder.start_utt()
                decoder.process_raw(pcm, full_utt=True)
                decoder.end_utt()
                self.audio_s += len(chunk) / RATE
                for seg in decoder.seg():
                    if _NOT_WORDS.match(seg.word):
                        continue
                    text = _ALTERNATE.sub("", seg.word)
                    start = lo + seg.start_frame / FRAMES_PER_S
                    end = lo + (seg.end_frame + 1) / FRAMES_PER_S
                    out.append(Word(text, round(start, 3), round(end, 3)))
            self.seconds += time.perf_counter() - started
        return out


def _padded(spans: Sequence[Segment], duration: float) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for s in sorted(spans, key=lambda s: s.start):
        lo, hi = max(0.0, s.start - PAD_S), min(duration, s.end + PAD_S)
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged if hi > lo]


def text_of(words: Sequence[Word]) -> str:
    return " ".join(w.text for w in words)
