"""Who speaks when: silero-vad (its model ships inside the `silero-vad` package) plus a boundary
refinement, for whole calls (batched) and for the agent's stream as it plays (barge-in cues).

Speech probability comes from silero-vad at 16 kHz, one value per 512-sample (32 ms) window,
the model's state carried from window to window. Segments follow by hysteresis: speech starts at
a window with probability >= `ON`, ends at the first window below `OFF` that begins `MIN_SILENCE`
of silence; segments shorter than `MIN_SPEECH` are dropped. silero's boundaries are whole windows
and its probability lags the sound (by 50-100 ms on synthetic speech, more on a weak final
consonant), so each boundary is then moved to where the sound itself starts or stops, in 10 ms
blocks: a block *sounds* when its level is within `REFINE_DROP_DB` of the segment's loud blocks
(their 95th percentile), `ABOVE_NOISE_DB` above the signal's background (`noise_floor`) and
above `FLOOR_DB`; from the first and last sounding blocks inside the
segment the boundaries follow sounding blocks outwards while they are less than `MIN_SILENCE`
apart (up to `REFINE` beyond the VAD's boundary), and the segment is split wherever its sounding
blocks are `MIN_SILENCE` or more apart (silero's lag can bridge a short pause). The VAD decides
*whether* there is speech; the signal says exactly *when*.
docs/eval.md states the same numbers.
"""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass

import numpy as np

from personaplex_voice.audio.resample import StreamingResampler

VAD_RATE = 16_000
WINDOW = 512  # samples at 16 kHz: 32 ms
WINDOW_S = WINDOW / VAD_RATE
ON, OFF = 0.5, 0.35
MIN_SPEECH_S = 0.09
MIN_SILENCE_S = 0.2
REFINE_S = 0.3
BLOCK_S = 0.01
REFINE_DROP_DB = 30.0
FLOOR_DB = -60.0  # blocks quieter than this are never speech
ABOVE_NOISE_DB = 3.0  # a sounding block stands this far above the top of the background
NOISE_MIN_S = 0.5  # of non-speech needed to measure the background
HIGH_BAND_HZ = 2000.0

_model_lock = threading.Lock()
_shared_model = None


@dataclass(frozen=True)
class Segment:
    start: float  # seconds from the call's start
    end: float

    @property
    def duration(self) -> float:
        return self.end - self.start


def load_model():
    """A fresh silero-vad model (TorchScript; one per stream: it keeps its own state).

    Importing silero_vad sets torch to one thread for the whole process; the engine's thread
    setting is put back."""
    import torch

    threads = torch.get_num_threads()
    try:
        from silero_vad import load_silero_vad
    except ImportError as exc:  # the eval extra is not installed
        from personaplex_voice.errors import UserError

        raise UserError(f"eval needs silero-vad: pip install 'personaplex-voice[eval]' ({exc})") from None
    with warnings.catch_warnings():  # the package's own use of deprecated loaders, not ours to fix
        warnings.simplefilter("ignore", DeprecationWarning)
        model = load_silero_vad()
    torch.set_num_threads(threads)
    return model


def _batch_model():
    global _shared_model
    if _shared_model is None:
        _shared_model = load_model()
    return _shared_model


def probabilities(signals: list[np.ndarray]) -> list[np.ndarray]:
    """Speech probability per 32 ms window for each 16 kHz signal, all run as one batch."""
    import torch

    if not signals:
        return []
    n_windows = [len(s) // WINDOW for s in signals]
    longest = max(n_windows)
    batch = np.zeros((len(signals), longest * WINDOW), np.float32)
    for i, signal in enumerate(signals):
        batch[i, : n_windows[i] * WINDOW] = signal[: n_windows[i] * WINDOW]
    out = np.zeros((len(signals), longest), np.float32)
    with _model_lock, torch.inference_mode():
        model = _batch_model()
        model.reset_states()
        data = torch.from_numpy(batch)
        for w in range(longest):
            out[:, w] = model(data[:, w * WINDOW : (w + 1) * WINDOW], VAD_RATE).reshape(-1).numpy()
        model.reset_states()
    return [out[i, : n_windows[i]] for i in range(len(signals))]


def segments_from(probs: np.ndarray) -> list[Segment]:
    """Hysteresis over window probabilities (window-exact boundaries)."""
    min_silence = round(MIN_SILENCE_S / WINDOW_S)
    segments: list[Segment] = []
    start: int | None = None
    quiet_from: int | None = None
    for w, p in enumerate(probs):
        if start is None:
            if p >= ON:
                start, quiet_from = w, None
            continue
        if p >= OFF:
            quiet_from = None
        elif quiet_from is None:
            quiet_from = w
        if quiet_from is not None and w - quiet_from + 1 >= min_silence:
            segments.append(Segment(start * WINDOW_S, quiet_from * WINDOW_S))
            start = quiet_from = None
    if start is not None:
        end = quiet_from if quiet_from is not None else len(probs)
        segments.append(Segment(start * WINDOW_S, end * WINDOW_S))
    return [s for s in segments if s.duration >= MIN_SPEECH_S]


def refine(segments: list[Segment], signal: np.ndarray) -> list[Segment]:
    """Move each boundary to the sound's own start/end and split a segment at any silence of
    `MIN_SILENCE_S` or more inside it (see the module docstring)."""
    block = round(BLOCK_S * VAD_RATE)
    n_blocks = len(signal) // block
    if n_blocks == 0 or not segments:
        return segments
    blocks = signal[: n_blocks * block].reshape(n_blocks, block).astype(np.float64)
    spectrum = np.abs(np.fft.rfft(blocks, axis=1)) ** 2
    high_from = round(HIGH_BAND_HZ * block / VAD_RATE)
    bands = [  # the whole band, and the high band where fricatives stand out of a line's hum and rumble
        10 * np.log10(spectrum.sum(axis=1) / block**2 + 1e-12),
        10 * np.log10(spectrum[:, high_from:].sum(axis=1) / block**2 + 1e-12),
    ]
    reach = round(REFINE_S / BLOCK_S)
    gap = round(MIN_SILENCE_S / BLOCK_S)  # quieter blocks than this many in a row end a segment
    floors = [noise_floor(level, segments) for level in bands]
    out: list[Segment] = []
    for seg in segments:
        a, b = int(seg.start / BLOCK_S), min(n_blocks, int(np.ceil(seg.end / BLOCK_S)))
        if b <= a:
            continue
        low = max(0, a - reach, round(out[-1].end / BLOCK_S) if out else 0)
        high = min(n_blocks, b + reach)
        sounds = np.zeros(high - low, bool)
        for level, floor in zip(bands, floors, strict=True):
            loud = float(np.percentile(level[a:b], 95))
            threshold = max(loud - REFINE_DROP_DB, floor + ABOVE_NOISE_DB, FLOOR_DB)
            sounds |= level[low:high] >= threshold
        # A lone 10 ms block is a blip of the line's noise, not speech: sound lasts two blocks.
        paired = sounds.copy()
        paired[1:] &= sounds[:-1] | np.append(sounds[2:], False)
        paired[0] &= len(sounds) > 1 and bool(sounds[1])
        voiced = np.flatnonzero(paired) + low
        inside = np.flatnonzero((voiced >= a) & (voiced < b))
        if inside.size == 0:
            continue  # nothing in it stands out from its surroundings
        first, last = int(inside[0]), int(inside[-1])
        while first > 0 and voiced[first] - voiced[first - 1] <= gap:  # the sound began earlier
            first -= 1
        while last + 1 < len(voiced) and voiced[last + 1] - voiced[last] <= gap:  # it went on
            last += 1
        run = voiced[first : last + 1]
        cuts = np.flatnonzero(np.diff(run) > gap)
        inner = (v for c in cuts for v in (int(run[c]) + 1, int(run[c + 1])))
        bounds = [int(run[0]), *inner, int(run[-1]) + 1]
        for s0, s1 in zip(bounds[::2], bounds[1::2], strict=True):
            if (s1 - s0) * BLOCK_S >= MIN_SPEECH_S:
                out.append(Segment(round(s0 * BLOCK_S, 3), round(s1 * BLOCK_S, 3)))
    return _merge(out)


def noise_floor(level: np.ndarray, segments: list[Segment]) -> float:
    """The top of the signal's background (dB): the 95th percentile 10 ms block outside the VAD's
    speech, when there is at least `NOISE_MIN_S` of it, else the 5th percentile block of all.
    Refined boundaries stay `ABOVE_NOISE_DB` above it, so a noisy line does not stretch speech
    into its noise."""
    quiet = np.ones(len(level), bool)
    for seg in segments:
        quiet[max(0, int(seg.start / BLOCK_S) - 5) : int(np.ceil(seg.end / BLOCK_S)) + 5] = False
    if quiet.sum() * BLOCK_S >= NOISE_MIN_S:
        return float(np.percentile(level[quiet], 95))
    return float(np.percentile(level, 5)) if len(level) else FLOOR_DB


def _merge(segments: list[Segment]) -> list[Segment]:
    merged: list[Segment] = []
    for seg in segments:
        if merged and seg.start - merged[-1].end < MIN_SILENCE_S:
            merged[-1] = Segment(merged[-1].start, max(merged[-1].end, seg.end))
        else:
            merged.append(seg)
    return merged


def detect(signals: list[np.ndarray]) -> list[list[Segment]]:
    """Speech segments of each 16 kHz signal (batched VAD, then refined boundaries)."""
    return [refine(segments_from(p), s) for p, s in zip(probabilities(signals), signals, strict=True)]


class SpeechClock:
    """The agent's speech as it plays, for a barge-in cue: feed what the caller hears, read how
    long the agent's current utterance has lasted. Same model and hysteresis as `detect`, no
    refinement (a cue needs no 10 ms precision); its own model state."""

    def __init__(self, rate: int) -> None:
        self._resampler = StreamingResampler(rate, VAD_RATE) if rate != VAD_RATE else None
        self._model = load_model()
        self._pending = np.zeros(0, np.float32)
        self._windows = 0
        self._start: int | None = None  # window the current utterance started at
        self._quiet_from: int | None = None

    def feed(self, pcm: np.ndarray) -> None:
        import torch

        x = self._resampler.process(pcm) if self._resampler is not None else np.asarray(pcm, np.float32)
        self._pending = np.concatenate([self._pending, x])
        min_silence = round(MIN_SILENCE_S / WINDOW_S)
        with torch.inference_mode():
            while len(self._pending) >= WINDOW:
                chunk = torch.from_numpy(np.ascontiguousarray(self._pending[:WINDOW]))
                self._pending = self._pending[WINDOW:]
                p = float(self._model(chunk.unsqueeze(0), VAD_RATE).reshape(-1)[0])
                w = self._windows
                self._windows += 1
                if self._start is None:
                    if p >= ON:
                        self._start, self._quiet_from = w, None
                    continue
                if p >= OFF:
                    self._quiet_from = None
                elif self._quiet_from is None:
                    self._quiet_from = w
                if self._quiet_from is not None and w - self._quiet_from + 1 >= min_silence:
                    self._start = self._quiet_from = None

    @property
    def speaking_ms(self) -> float:
        """How long the agent's current utterance has lasted so far (0 when it is silent)."""
        if self._start is None or self._quiet_from is not None:
            return 0.0
        return (self._windows - self._start) * WINDOW_S * 1000.0


def fdb_segments(probs: np.ndarray, n_samples: int) -> list[Segment]:
    """Speech as Full-Duplex-Bench's backchannel scorer finds it: silero-vad's own
    `get_speech_timestamps` rule with its default settings, in seconds at its 0.1 s resolution,
    from the same window probabilities `detect` uses."""
    from silero_vad.utils_vad import get_speech_timestamps_from_probs

    found = get_speech_timestamps_from_probs(
        [float(p) for p in probs], sampling_rate=VAD_RATE, return_seconds=True, audio_length_samples=n_samples
    )
    return [Segment(float(s["start"]), float(s["end"])) for s in found]
