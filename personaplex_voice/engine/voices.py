"""Voice prompts: the voice directories, `.pt` embeddings and audio voices.

A voice is either a `.pt` file in the published format (`{"embeddings": float32 [N, 1, 1, dim],
"cache": int64 [1, 17, C]}`: the LM input embeddings of the voice-prompt steps and the token cache
after them) or an audio file, which is resampled to 24 kHz, loudness-normalised to -24 LUFS
(ITU-R BS.1770, pyloudnorm) and Mimi-encoded at prefill. Names are resolved inside the voice
directories only: a remote caller can never make the engine open an arbitrary path.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from personaplex_voice.engine.base import SAMPLE_RATE, PersonaError, VoiceInfo
from personaplex_voice.errors import UserError

EMBEDDINGS_SUFFIX = ".pt"
AUDIO_SUFFIXES = (".wav", ".flac", ".ogg", ".mp3", ".opus", ".m4a", ".aiff", ".aif")
TARGET_LUFS = -24.0


class VoiceLibrary:
    def __init__(self, dirs: list[Path] | tuple[Path, ...], source: str = "voice-dir"):
        self.dirs = [Path(d) for d in dirs]
        self.source = source

    def _files(self) -> dict[str, Path]:
        found: dict[str, Path] = {}
        for d in self.dirs:
            if not d.is_dir():
                continue
            for path in sorted(d.iterdir()):
                suffix = path.suffix.lower()
                if path.is_file() and (suffix == EMBEDDINGS_SUFFIX or suffix in AUDIO_SUFFIXES):
                    found.setdefault(path.name, path)
        return found

    def list(self) -> list[VoiceInfo]:
        return [
            VoiceInfo(
                name=name, kind="embeddings" if path.suffix.lower() == ".pt" else "audio", source=self.source
            )
            for name, path in self._files().items()
        ]

    def resolve(self, name: str) -> Path:
        """The file of voice `name` ("NATF2" or "NATF2.pt"); PersonaError if unknown or not a plain name."""
        if (
            not isinstance(name, str)
            or not name
            or name in (".", "..")
            or "/" in name
            or "\\" in name
            or "\x00" in name
            or Path(name).is_absolute()
        ):
            raise PersonaError(f"invalid voice name {name!r}: use a name from the voice list")
        files = self._files()
        if name in files:
            return files[name]
        for suffix in (EMBEDDINGS_SUFFIX, *AUDIO_SUFFIXES):
            if name + suffix in files:
                return files[name + suffix]
        raise PersonaError(f"unknown voice {name!r}")


def load_voice_pt(path: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(embeddings float32 [N, 1, 1, dim], cache int64 [1, K, C]) of a published-format `.pt`."""
    path = Path(path)
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # unpickling errors, truncated files, missing files
        raise PersonaError(f"{path.name}: not a readable voice file ({type(exc).__name__})") from None
    if not isinstance(data, dict) or "embeddings" not in data or "cache" not in data:
        raise PersonaError(f"{path.name}: a voice .pt needs 'embeddings' and 'cache'")
    emb, cache = data["embeddings"], data["cache"]
    if not isinstance(emb, torch.Tensor) or emb.dim() != 4 or emb.shape[1:3] != (1, 1) or emb.shape[0] < 1:
        raise PersonaError(f"{path.name}: 'embeddings' must be a [N, 1, 1, dim] tensor")
    if not isinstance(cache, torch.Tensor) or cache.dim() != 3 or cache.shape[0] != 1:
        raise PersonaError(f"{path.name}: 'cache' must be a [1, streams, positions] tensor")
    if not torch.isfinite(emb).all():
        raise PersonaError(f"{path.name}: 'embeddings' contains NaN or infinity")
    return emb.to(torch.float32), cache.to(torch.long)


def normalize_loudness(
    pcm: np.ndarray, sample_rate: int = SAMPLE_RATE, target: float = TARGET_LUFS
) -> np.ndarray:
    """`pcm` scaled to `target` LUFS (BS.1770 integrated loudness), float32."""
    import pyloudnorm

    pcm = np.asarray(pcm, dtype=np.float32)
    try:
        loudness = pyloudnorm.Meter(sample_rate).integrated_loudness(pcm)
    except ValueError as exc:  # shorter than one 400 ms gating block
        raise PersonaError(f"voice prompt audio is too short ({exc})") from None
    if not np.isfinite(loudness):
        raise PersonaError("voice prompt audio is silent")
    gain = np.power(10.0, (target - loudness) / 20.0)
    return (gain * pcm.astype(np.float64)).astype(np.float32)


def load_voice_audio(path: str | Path) -> np.ndarray:
    """A voice prompt audio file as float32 mono 24 kHz at -24 LUFS."""
    from personaplex_voice.audio.io import read_audio

    try:
        pcm = read_audio(path, SAMPLE_RATE)
    except UserError as exc:
        raise PersonaError(str(exc)) from None
    if pcm.size == 0:
        raise PersonaError(f"{Path(path).name}: empty audio")
    return normalize_loudness(pcm)
