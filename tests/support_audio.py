"""Signals and measurements shared by the tests/test_audio_*.py files (and bench/transport.py)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import soundfile

from personaplex_voice.audio.resample import resample

SPEECH_TEXT = (
    "Hello, thanks for calling. I can help you change your booking, check an order, "
    "or answer a question about your account. What would you like to do today?"
)


def espeak_speech(directory: Path, text: str = SPEECH_TEXT) -> tuple[np.ndarray, int]:
    """Real synthetic speech from espeak-ng: (float32 mono, its native rate)."""
    path = directory / "speech.wav"
    subprocess.run(["espeak-ng", "-w", str(path), text], check=True, capture_output=True, timeout=60)
    pcm, rate = soundfile.read(str(path), dtype="float32")
    return pcm, rate


def band_limit(x: np.ndarray, rate: int, low_hz: float, high_hz: float) -> np.ndarray:
    """Zero-phase band-pass by FFT masking: nothing outside [low_hz, high_hz], raised-cosine edges
    100 Hz wide inside it (test-signal shaping)."""
    spectrum = np.fft.rfft(x.astype(np.float64))
    f = np.fft.rfftfreq(len(x), 1 / rate)
    mask = np.clip((f - low_hz) / 100, 0, 1) * np.clip((high_hz - f) / 100, 0, 1)
    mask = 0.5 - 0.5 * np.cos(np.pi * mask)
    return np.fft.irfft(spectrum * mask, len(x)).astype(np.float32)


def telephone_speech(speech: np.ndarray, rate: int, level_dbfs: float = -20.0) -> np.ndarray:
    """Speech as a phone line carries it: 8 kHz, 300-3400 Hz, RMS at ``level_dbfs``."""
    x = band_limit(resample(speech, rate, 8000), 8000, 300, 3400)
    return set_level(x, level_dbfs)


def set_level(x: np.ndarray, level_dbfs: float) -> np.ndarray:
    rms = float(np.sqrt(np.mean(x.astype(np.float64) ** 2)))
    return (x * (10 ** (level_dbfs / 20) / rms)).astype(np.float32)


def snr_db(reference: np.ndarray, test: np.ndarray) -> float:
    reference = reference.astype(np.float64)
    noise = test.astype(np.float64) - reference
    return float(10 * np.log10(np.sum(reference**2) / max(np.sum(noise**2), 1e-30)))


def best_lag(reference: np.ndarray, test: np.ndarray, max_lag: int) -> tuple[int, float]:
    """The lag (test behind reference, may be negative) maximising the normalised cross-correlation
    over the overlapping part, and that correlation. FFT-based: every lag at once."""
    a, b = reference.astype(np.float64), test.astype(np.float64)
    n = len(a) + len(b)
    xc = np.fft.irfft(np.fft.rfft(b, n) * np.conj(np.fft.rfft(a, n)), n)  # xc[lag] = sum a[i] b[i+lag]
    ca, cb = np.concatenate([[0.0], np.cumsum(a * a)]), np.concatenate([[0.0], np.cumsum(b * b)])
    best = (0, -2.0)
    for lag in range(-max_lag, max_lag + 1):
        start_a, start_b = max(0, -lag), max(0, lag)
        m = min(len(a) - start_a, len(b) - start_b)
        if m <= 0:
            continue
        energy = (ca[start_a + m] - ca[start_a]) * (cb[start_b + m] - cb[start_b])
        c = float(xc[lag % n] / np.sqrt(energy + 1e-30))
        if c > best[1]:
            best = (lag, c)
    return best


def fractional_delay(reference: np.ndarray, test: np.ndarray, rate: int) -> float:
    """Delay of ``test`` behind ``reference`` in seconds, to a fraction of a sample: the peak of the
    cross-correlation computed by FFT, refined by parabolic interpolation."""
    n = len(reference) + len(test)
    xc = np.fft.irfft(np.fft.rfft(test, n) * np.conj(np.fft.rfft(reference, n)), n)
    k = int(np.argmax(xc))
    y0, y1, y2 = xc[k - 1], xc[k], xc[(k + 1) % n]
    frac = 0.5 * (y0 - y2) / (y0 - 2 * y1 + y2)
    lag = k if k < n // 2 else k - n
    return (lag + frac) / rate
