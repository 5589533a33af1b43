"""The caller's voice: `say` lines synthesised with espeak-ng, `wav` steps read from files.

Every synthesised clip is 24 kHz float32 mono with its leading and trailing silence (and
breath-level lead-in or tail) cut, so a script's `silence: 2s` is two seconds of silence, not
two seconds plus whatever the synthesiser left at the ends. `wav` files are played as given.
Clips are made once per run (`ClipBook`): repeats and scenarios that say the same line share it.
"""

from __future__ import annotations

import io
import shutil
import subprocess
from pathlib import Path

import numpy as np
import soundfile

from personaplex_voice.audio.io import read_audio
from personaplex_voice.audio.resample import resample
from personaplex_voice.engine.base import SAMPLE_RATE
from personaplex_voice.errors import UserError

from .scenario import Scenario
from .steps import CallerVoice, Say, Wav, speech_of
from .vad import BLOCK_S, REFINE_DROP_DB
from .yaml_source import ScenarioError

ESPEAK = "espeak-ng"
TRIM_LEVEL = 0.003  # |sample| below this at a clip's ends is the synthesiser's silence
SYNTH_TIMEOUT_S = 60.0


def trim(pcm: np.ndarray, level: float = TRIM_LEVEL) -> np.ndarray:
    """The clip from its first to its last *sounding* 10 ms block (within `vad.REFINE_DROP_DB` of
    the clip's loud blocks, as the measures hear sound), each end cut to the sample where the
    signal passes `level`: a synthesiser's breathy lead-in or tail is not speech."""
    block = round(SAMPLE_RATE * BLOCK_S)
    n = len(pcm) // block
    if n == 0:
        return pcm[:0]
    power = np.mean(pcm[: n * block].reshape(n, block).astype(np.float64) ** 2, axis=1)
    db = 10 * np.log10(power + 1e-12)
    sounding = np.flatnonzero(db >= np.percentile(db, 95) - REFINE_DROP_DB)
    first, last = sounding[0] * block, (sounding[-1] + 1) * block
    loud = np.flatnonzero(np.abs(pcm[first:last]) > level)
    if loud.size == 0:
        return pcm[:0]
    return pcm[first + loud[0] : first + loud[-1] + 1]


def synthesize(text: str, voice: CallerVoice, where: str = "say") -> np.ndarray:
    """`text` spoken by espeak-ng, 24 kHz float32, trimmed. ScenarioError (naming `where`) when
    espeak-ng is missing or refuses the voice."""
    exe = shutil.which(ESPEAK)
    if exe is None:
        raise ScenarioError(
            where, "espeak-ng is not installed (`say` steps need it; Debian/Ubuntu: apt install espeak-ng)"
        )
    cmd = [exe, "-v", voice.voice, "-s", str(voice.rate), "-p", str(voice.pitch), "--stdout"]
    try:
        done = subprocess.run(
            cmd, input=text.encode("utf-8"), capture_output=True, timeout=SYNTH_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired:
        raise ScenarioError(where, f"espeak-ng took more than {SYNTH_TIMEOUT_S:g} s for this line") from None
    problem = done.stderr.decode("utf-8", "replace").strip()
    if done.returncode != 0 or not done.stdout or problem:
        raise ScenarioError(
            where, f"espeak-ng could not say it with voice {voice.voice!r} ({problem or 'no audio'})"
        )
    pcm, rate = soundfile.read(io.BytesIO(done.stdout), dtype="float32")
    if pcm.ndim > 1:
        pcm = pcm.mean(axis=1)
    clip = trim(resample(np.ascontiguousarray(pcm, np.float32), int(rate), SAMPLE_RATE))
    if clip.size == 0:
        raise ScenarioError(where, f"espeak-ng made no sound for {text!r}")
    return clip


class ClipBook:
    """Each distinct `say` line and `wav` file of a run, as audio, made once."""

    def __init__(self) -> None:
        self._clips: dict[tuple, np.ndarray] = {}

    @staticmethod
    def key(speech: Say | Wav) -> tuple:
        if isinstance(speech, Say):
            return ("say", speech.text, speech.voice)
        return ("wav", str(speech.path))

    def add(self, speech: Say | Wav) -> np.ndarray:
        key = self.key(speech)
        if key not in self._clips:
            if isinstance(speech, Say):
                self._clips[key] = synthesize(speech.text, speech.voice, speech.where)
            else:
                self._clips[key] = _read_wav(speech.path, speech.where)
        return self._clips[key]

    def get(self, speech: Say | Wav) -> np.ndarray:
        return self._clips[self.key(speech)]

    def add_scenarios(self, scenarios: list[Scenario]) -> None:
        for scenario in scenarios:
            for step in scenario.script:
                speech = speech_of(step)
                if speech is not None:
                    self.add(speech)


def _read_wav(path: Path, where: str) -> np.ndarray:
    try:
        return np.ascontiguousarray(read_audio(path, SAMPLE_RATE), np.float32)
    except UserError as exc:
        raise ScenarioError(where, str(exc)) from None
