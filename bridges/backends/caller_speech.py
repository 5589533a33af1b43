"""`CallerSpeech`: when the caller starts and stops talking, from silero-vad on the caller's audio.

PersonaPlex hears the caller itself and takes its own turns, so no bridge needs a VAD to drive
the model. The frameworks around it do need to know when the caller talks: LiveKit's
`AgentSession` moves `user_state` to "speaking" / "listening" only on the model's
`input_speech_started` / `input_speech_stopped` events when the session has its default VAD
(livekit/agents/voice/agent_activity.py, `_on_input_speech_started`: "if self.vad is None or
self.using_default_vad"), and marks a caller "away" after `user_away_timeout` of both sides
listening; Pipecat's idle controllers, RTVI and latency observers follow
`UserStartedSpeakingFrame` / `VADUserStoppedSpeakingFrame`. A level detector mistakes line
noise for speech and a soft talker for silence; silero-vad does not.

The model is silero-vad's own ONNX file, run on onnxruntime (no torch in a bridge): the one the
`silero-vad` package ships (`silero_vad/data/silero_vad.onnx`), else the copy Pipecat ships
(`pipecat/audio/vad/data/silero_vad.onnx`). One inference session per process serves every
call: the model's recurrent state is an input, so each stream keeps its own.

Input is the model's 24 kHz mono float32 PCM in pieces of any length; it is resampled to 16 kHz
and scored in silero's 512-sample (32 ms) windows, each with the 64 samples before it as context
(the v5 model's input). Speech starts after `start_s` of windows at or above `threshold`, and
stops after `stop_s` of windows below `threshold - 0.15` (silero's own iterator uses the same
hysteresis); `stop_s` defaults to LiveKit's silero plugin's `min_silence_duration` (0.55 s).
"""

from __future__ import annotations

import functools
import importlib.util
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from personaplex_voice.audio.resample import StreamingResampler
from personaplex_voice.engine.base import SAMPLE_RATE

VAD_RATE = 16000
WINDOW = 512  # samples at 16 kHz: 32 ms, the window silero-vad's 16 kHz model scores
CONTEXT = 64  # samples of the window before, prepended to each window (silero v5's input)
WINDOW_S = WINDOW / VAD_RATE

# Where an installed package keeps silero-vad's ONNX model (tried in this order).
_MODEL_FILES = (
    ("silero_vad", ("data", "silero_vad.onnx")),
    ("pipecat", ("audio", "vad", "data", "silero_vad.onnx")),
)


class CallerSpeechUnavailable(RuntimeError):
    """No silero-vad model or no onnxruntime: say what to install."""


def model_path() -> Path:
    """silero-vad's ONNX model from an installed package, found without importing the package
    (importing `silero_vad` would import torch)."""
    for package, parts in _MODEL_FILES:
        spec = importlib.util.find_spec(package)
        for root in (spec.submodule_search_locations or []) if spec is not None else []:
            path = Path(root).joinpath(*parts)
            if path.is_file():
                return path
    raise CallerSpeechUnavailable(
        "caller speech detection needs silero-vad's model: pip install 'personaplex-voice[livekit]' "
        "(or silero-vad), or pass caller_vad=False"
    )


@functools.lru_cache(maxsize=2)
def _inference_session(path: str) -> Any:
    try:
        import onnxruntime
    except ImportError as exc:
        raise CallerSpeechUnavailable(
            f"caller speech detection needs onnxruntime: pip install onnxruntime ({exc})"
        ) from None
    options = onnxruntime.SessionOptions()
    # a 32 ms window takes well under a millisecond on one core; more threads only contend with
    # the event loop and the other calls
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(path, sess_options=options, providers=["CPUExecutionProvider"])


_LOAD_LOCK = threading.Lock()


def load_model() -> Any:
    """The process's shared inference session (loaded once; raises `CallerSpeechUnavailable`)."""
    with _LOAD_LOCK:
        return _inference_session(str(model_path()))


@dataclass(frozen=True)
class SpeechEdge:
    """The caller started or stopped talking, at `at_s` seconds into the audio fed so far."""

    kind: Literal["started", "stopped"]
    at_s: float  # start of the first speech window / end of the last one
    confirmed_s: float  # how much audio after `at_s` it took to be sure (start_s or stop_s)


class CallerSpeech:
    """One caller's speech detector: `update(pcm)` returns the edges that audio confirmed."""

    def __init__(self, *, threshold: float = 0.5, start_s: float = 0.096, stop_s: float = 0.55):
        if not 0.15 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0.15, 1), got {threshold}")
        self._model = load_model()
        self.threshold = threshold
        self._release = threshold - 0.15
        self._start_windows = max(1, round(start_s / WINDOW_S))
        self._stop_windows = max(1, round(stop_s / WINDOW_S))
        self._resampler = StreamingResampler(SAMPLE_RATE, VAD_RATE)
        self._pending = np.zeros(0, np.float32)
        self._context = np.zeros(CONTEXT, np.float32)
        self._state = np.zeros((2, 1, 128), np.float32)
        self._rate = np.array(VAD_RATE, dtype=np.int64)
        self._windows = 0  # windows scored so far
        self._run = 0  # windows in a row on the other side of the current state
        self.speaking = False
        self.probability = 0.0  # the last window's

    @property
    def position_s(self) -> float:
        """Seconds of audio scored so far."""
        return self._windows * WINDOW_S

    def update(self, pcm: np.ndarray) -> list[SpeechEdge]:
        """Feed the caller's next 24 kHz mono float32 audio."""
        audio = self._resampler.process(np.asarray(pcm, np.float32).reshape(-1))
        if self._pending.size:
            audio = np.concatenate([self._pending, audio])
        edges: list[SpeechEdge] = []
        whole = audio.size // WINDOW * WINDOW
        for start in range(0, whole, WINDOW):
            edge = self._score(audio[start : start + WINDOW])
            if edge is not None:
                edges.append(edge)
        self._pending = audio[whole:].copy()
        return edges

    def _score(self, window: np.ndarray) -> SpeechEdge | None:
        x = np.concatenate([self._context, window])[None, :]
        out, self._state = self._model.run(None, {"input": x, "state": self._state, "sr": self._rate})
        self._context = window[-CONTEXT:].copy()
        self._windows += 1
        self.probability = p = float(out[0][0])
        if not self.speaking:
            self._run = self._run + 1 if p >= self.threshold else 0
            if self._run < self._start_windows:
                return None
            self.speaking, self._run = True, 0
            return self._edge("started", self._start_windows)
        self._run = self._run + 1 if p < self._release else 0
        if self._run < self._stop_windows:
            return None
        self.speaking, self._run = False, 0
        return self._edge("stopped", self._stop_windows)

    def _edge(self, kind: Literal["started", "stopped"], windows: int) -> SpeechEdge:
        """The edge lies where the run of `windows` windows that confirmed it began."""
        return SpeechEdge(kind, (self._windows - windows) * WINDOW_S, windows * WINDOW_S)
