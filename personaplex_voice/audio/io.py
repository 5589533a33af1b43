"""Audio files in and out: any format libsndfile reads (WAV, FLAC, OGG, MP3, ...) at any rate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import soundfile

from ..errors import UserError
from .resample import resample

__all__ = ["read_audio", "write_wav"]


def read_audio(path: str | Path, sample_rate: int = 24000) -> np.ndarray:
    """The file's audio as float32 mono at ``sample_rate`` (channels averaged, resampled one-shot).

    Raises UserError naming the file when it is missing or not audio libsndfile can decode.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such audio file")
    try:
        data, file_rate = soundfile.read(str(path), dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as exc:
        raise UserError(f"{path}: cannot read audio ({exc})") from None
    mono = data.mean(axis=1, dtype=np.float32) if data.shape[1] > 1 else data[:, 0]
    return resample(np.ascontiguousarray(mono), int(file_rate), sample_rate)


def write_wav(path: str | Path, pcm: np.ndarray, sample_rate: int, subtype: str = "FLOAT") -> None:
    """Writes mono (or [frames, channels]) audio as WAV; FLOAT keeps samples exactly, PCM_16 clips."""
    soundfile.write(str(path), np.asarray(pcm, dtype=np.float32), sample_rate, subtype=subtype, format="WAV")
